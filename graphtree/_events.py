"""A tiny in-process event bus so that optional parts (the profiler) can watch the tree.

Publishing costs one truthiness test when nobody listens, so it is safe on hot paths.

Events published by :mod:`graphtree.tree`:

- ``"record_begin"`` with ``name`` (the graphed function's name) and ``node`` (its id string),
  just before stream capture starts;
- ``"record_end"`` with ``name``, ``node`` and ``graph`` (the ``torch.cuda.CUDAGraph``), after a
  successful capture;
- ``"replay"`` is deliberately *not* published: replay is the hot path.

Example::

    from graphtree import _events
    _events.subscribe("record_begin", lambda **kw: print("recording", kw["name"]))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_listeners: dict[str, list[Callable[..., None]]] = {}


def subscribe(event: str, fn: Callable[..., None]) -> Callable[[], None]:
    """Call ``fn(**payload)`` on every ``event``; returns a function that unsubscribes."""
    _listeners.setdefault(event, []).append(fn)

    def unsubscribe() -> None:
        fns = _listeners.get(event, [])
        if fn in fns:
            fns.remove(fn)

    return unsubscribe


def publish(event: str, **payload: Any) -> None:
    """Deliver ``payload`` to the listeners of ``event`` (none: nothing happens)."""
    for fn in _listeners.get(event, ()):
        fn(**payload)
