"""Dumps of CUDA faults that surface outside graphed calls.

A fault in a graph replay or an asynchronous kernel is reported by CUDA at a later call that
synchronises: often graphtree's next call (which writes the dumps itself), but as often the
user's own ``torch.cuda.synchronize()``, another library's call, or the interpreter's exit. For
every graphed function with ``debug=dir`` (and ``dump_on_error(..., snapshot=True)``), the
snapshots of its last two calls are in host memory already; this module writes them when such a
fault goes unhandled:

- a CUDA error raised anywhere in Python code (Python 3.12+: a ``sys.monitoring`` ``RAISE``
  callback): the user's ``torch.cuda.synchronize()``, ``.item()``, ``.cpu()``, printing a tensor,
  another library's call. The dumps are written where the error is raised, before any ``except``
  sees it, named on stderr, and each is added as a note to the error itself, so that what reaches
  the user (a traceback, pytest's report, a notebook's cell, an ``except`` clause) names them;
- an uncaught CUDA error (``sys.excepthook``, the only way before Python 3.12): the dumps are
  written and named on stderr, then the usual traceback is printed;
- a CUDA error pending at exit (``atexit``: one ``torch.cuda.synchronize()``, only in a process
  that has such functions and has initialised CUDA).

A CUDA error raised inside a graphed call is left to the call, which writes the dumps itself
(:func:`graphtree.debug.dump.dump_failure`). Costs nothing per call: the hooks are installed when
the first such function is made; the ``RAISE`` callback runs for every exception Python code
raises while such a function lives (a type test for all but CUDA errors).

Example::

    step = graphtree.graphed(step, debug="dumps")   # installs the hooks (once)
"""

from __future__ import annotations

import atexit
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch

from graphtree.tree.replay_error import is_cuda_error

__all__ = ["watch"]

# snapshots -> what writes their dumps (given the error and them: it must not hold them, or they never die)
_watched: weakref.WeakKeyDictionary[Any, Callable[[RuntimeError, Any], list[Path]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_installed = False
_dumped: set[int] = set()  # ids of the CUDA errors already dumped (by a graphed call or here)
_reported: set[str] = set()  # first lines of the CUDA errors dumped here (a dead context repeats its error)
_inside: set[Any] = set()  # code objects of calls that write their own dumps (a graphed call's, dump_on_error's)


def watch(snapshots: Any, dump: Callable[[RuntimeError, Any], list[Path]]) -> None:
    """Call ``dump(error, snapshots)`` (which writes the dumps of their last calls) should a CUDA
    fault surface outside the calls, for as long as ``snapshots`` lives."""
    global _installed
    with _lock:
        _watched[snapshots] = dump
        if not _installed:
            _installed = True
            previous = sys.excepthook

            def excepthook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
                if isinstance(error, RuntimeError) and is_cuda_error(error):
                    dump_all(error)
                previous(kind, error, tb)

            sys.excepthook = excepthook
            atexit.register(_at_exit)
            _monitor_raises()


def handled_inside(code: Any) -> None:
    """A CUDA error raised while a frame of ``code`` is on the stack is left to it: it writes the
    dumps itself (``dump_on_error``'s wrapper; a graphed call's ``__call__`` is known already)."""
    _inside.add(code)


def mark_dumped(error: BaseException) -> None:
    """CUDA error ``error`` got its dumps where it surfaced (a graphed call): none again, neither at
    exit nor when a dead context raises the same error at a later call (the ``RAISE`` callback)."""
    seen: BaseException | None = error
    chain: set[int] = set()
    while seen is not None and id(seen) not in chain:  # (a GraphReplayError names the CUDA error it was
        chain.add(id(seen))  # raised from: that is what a dead context raises again, at a sync or at exit)
        _dumped.add(id(seen))
        _reported.add(_first_line(seen))
        seen = seen.__cause__ or seen.__context__


def dump_all(error: RuntimeError) -> list[Path]:
    """Write the dumps of every watched function's last calls for ``error``; name them on stderr."""
    if id(error) in _dumped:
        return []
    _dumped.add(id(error))
    written: list[Path] = []
    for snapshots, dump in list(_watched.items()):
        if snapshots.calls:
            written += dump(error, snapshots)
    if written:
        print(
            f"graphtree: a CUDA error surfaced outside the graphed calls ({str(error).splitlines()[0]}); the last "
            f"calls of the functions graphed with debug= were dumped: {', '.join(map(str, written))} "
            "(re-run each with `graphtree debug rerun DUMP`)",
            file=sys.stderr,
            flush=True,
        )
    return written


def _monitor_raises() -> None:
    """Have :func:`_on_raise` called for every exception raised in Python code (Python 3.12+), under
    a ``sys.monitoring`` tool id no other tool holds (none free: the excepthook alone)."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return
    from graphtree.tree.graphed import GraphedCallable  # (made by then: watch() is called as one is)

    _inside.add(GraphedCallable.__call__.__code__)
    for tool in (4, 3, 5, 2, 1, 0):  # (the unnamed ids first: debuggers, coverage and profilers keep theirs)
        if monitoring.get_tool(tool) is None:
            monitoring.use_tool_id(tool, "graphtree late CUDA faults")
            monitoring.register_callback(tool, monitoring.events.RAISE, _on_raise)
            monitoring.set_events(tool, monitoring.get_events(tool) | monitoring.events.RAISE)
            return


def _on_raise(code: Any, offset: int, error: BaseException) -> None:
    """A ``RAISE`` event: a CUDA error raised outside the calls that write their own dumps writes
    every watched function's dumps, named on stderr and in notes on ``error``, once per fault (a
    dead context raises the same error again at every later CUDA call). Never raises."""
    if not isinstance(error, RuntimeError) or id(error) in _dumped or not _watched:
        return
    try:
        if not is_cuda_error(error) or _inside_a_call():
            return
        first = _first_line(error)
        if first in _reported:
            _dumped.add(id(error))
            return
        _reported.add(first)  # (first: the dumps' own reads may raise it again, inside dump_all)
        dump_all(error)
    except Exception:  # noqa: BLE001 - a hook must never replace the user's error
        pass


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]


def _inside_a_call() -> bool:
    """Whether this thread is inside a graphed call or a ``dump_on_error`` wrapper, whose own
    handler writes the dumps (and names the call in its error)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _inside:
            return True
        frame = frame.f_back
    return False


def _at_exit() -> None:
    """A fault still pending at exit: one synchronize finds it."""
    if not _watched or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    try:
        torch.cuda.synchronize()
    except RuntimeError as e:
        if is_cuda_error(e) and not _dumped:
            dump_all(e)
