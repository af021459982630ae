"""A tiny in-process event bus so that optional parts (the profiler) can watch the tree.

Publishing costs one truthiness test when nobody listens, so it is safe on hot paths.

Events published by :mod:`graphtree.tree`:

- ``"record_begin"`` with ``name`` (the graphed function's name) and ``node`` (its id string),
  just before stream capture starts;
- ``"record_end"`` with ``name``, ``node`` and ``graph`` (the ``torch.cuda.CUDAGraph``), after a
  successful capture;
- ``"replay"`` is deliberately *not* published: replay is the hot path.

Tools above the tree also *provide* what the tree calls on them without importing them
(:func:`provide`, :func:`provided`): ``"debug"``, from :mod:`graphtree.debug`, is the object that
``graphed(fn, debug=dir)`` takes its input snapshots from (``snapshots()``) and writes its dumps with
(``dump_failure(...)``).

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


_provided: dict[str, Any] = {}


def provide(name: str, tool: Any) -> None:
    """Make ``tool`` what :func:`provided` gives for ``name`` (a tool registers itself on import)."""
    _provided[name] = tool


def provided(name: str) -> Any:
    """The tool provided for ``name``; raises ``LookupError`` naming it when none was."""
    try:
        return _provided[name]
    except KeyError:
        raise LookupError(f"graphtree: no {name!r} tool is loaded (import graphtree.{name})") from None
