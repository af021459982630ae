"""What a CUDA graph cannot record, found out early and explained in the caller's words.

Three checks guard a recording:

- during warm-up, :class:`SyncWatch` runs the function with torch's sync debug mode on
  ("warn") and notes any operation that waits for the GPU (``.item()``, ``.cpu()``,
  data-dependent shapes...): such a function is never captured, so its capture never fails;
- :class:`OpTracker` remembers the last torch operation, to name it if a capture still fails;
- :func:`explain_capture_error` turns an exception into one line: the operation, the
  caller's file and line, and why a graph cannot hold it.
"""

from __future__ import annotations

import os
import threading
import traceback
import warnings
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from graphtree import _torch

_NO_RESULT: Any = object()  # (a call's outputs may be None)


class CaptureFailed(RuntimeError):
    """The function did something a CUDA graph cannot record; the message says what and where.

    ``pool_tainted``: the stream capture itself failed, and torch will not capture into that
    memory pool again. ``result``: the call's outputs, when the capture ran it whole and running
    it again eagerly would repeat its side effects (``has_result``). ``again``: what failed was
    the moment, not the call (torch.compile traced in the capture): it warms up and records again.
    """

    def __init__(self, message: str, pool_tainted: bool = False, result: Any = _NO_RESULT, again: bool = False) -> None:
        super().__init__(message)
        self.pool_tainted = pool_tainted
        self.result = result
        self.again = again

    @property
    def has_result(self) -> bool:
        return self.result is not _NO_RESULT


class OpTracker(TorchFunctionMode):
    """Remembers the last torch operation called, to name it if the capture fails."""

    def __init__(self) -> None:
        super().__init__()
        self.last: str = ""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.last = str(getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func))
        _torch.note_torch_call()  # (autocast's state, readable here and not below dispatch)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc: Any) -> None:
        _torch.note_torch_call(None)
        super().__exit__(*exc)


_INTERNAL_DIRS = (
    os.path.dirname(os.path.abspath(str(torch.__file__))) + os.sep,
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,  # graphtree/, from graphtree/tree/
)


_SKIP_FILES = {os.path.abspath(warnings.__file__), os.path.abspath(__file__)}


def is_internal(filename: str) -> bool:
    """Whether a source file is torch's or graphtree's own (never the caller's line)."""
    path = os.path.abspath(filename)
    return path.startswith(_INTERNAL_DIRS) or path in _SKIP_FILES


def _where(frames: list[traceback.FrameSummary]) -> str:
    for frame in reversed(frames):
        if not is_internal(frame.filename):
            return f" at {frame.filename}:{frame.lineno} in {frame.name} (`{(frame.line or '').strip()}`)"
    return ""


def explain_capture_error(exc: BaseException, tracker: OpTracker, fn_name: str) -> str:
    """Say which operation broke the capture, at which line of the caller's code."""
    where = _where(traceback.extract_tb(exc.__traceback__))
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    op = f"`{tracker.last}`" if tracker.last else "an operation"
    hint = ""
    low = first.lower()
    if "previous error during capture" in low or "invalidated" in low:
        hint = (
            " The capture had been invalidated before this operation: by an earlier one in this thread"
            " (a finalizer that frees CUDA memory counts: graphtree pauses automatic garbage collection"
            " while it captures, but an explicit gc.collect() or a del in the function still runs one),"
            " or by a CUDA call that another thread of this process made meanwhile (a synchronization)."
        )
    elif "legacy stream" in low:  # (autograd runs a node on the stream its forward ran on)
        hint = (
            " Work of the call runs on the default stream, which no capture can take in: in a backward,"
            " the gradient accumulators of parameters first used there (DistributedDataParallel made on"
            " the default stream makes them so). Build DistributedDataParallel inside"
            " `with torch.cuda.stream(torch.cuda.Stream()):`, as PyTorch's CUDA-graph notes ask (it keeps"
            " them from then on)."
        )
    elif "capturing" in low or "capture" in low or "not permitted" in low:
        hint = (
            " It waits for the GPU or copies to the host (.item(), .cpu(), .tolist(), print, "
            "data-dependent shapes), which a CUDA graph cannot record."
        )
    return f"capture of `{fn_name}` failed: {op}{where} raised {type(exc).__name__}: {first}.{hint}"


def clear_traceback(exc: BaseException | None) -> None:
    """Drop the frames of a failed capture, and of the errors it chained, so the tensors they hold
    are freed now: one the capture allocated in the pool and a reference cycle kept (an error kept
    by the object its frames hold) would still be allocated when the pool's bookkeeping is next
    restored, which then frees its block under it (the process aborts when it dies)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        if tb is not None:
            traceback.clear_frames(tb)
        exc.__traceback__ = None
        exc = exc.__cause__ or exc.__context__


def _set_sync_mode(mode: Any) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Synchronization debug mode is a prototype feature"
        torch.cuda.set_sync_debug_mode(mode)


_SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync debug mode, "warn"


class SyncWatch:
    """Run a warm-up with torch's sync debug mode on and note the first host synchronisation.

    ``found`` is then a one-line reason naming the operation and the caller's line, or ``""``.
    Warnings of other threads pass through untouched; other warnings of this thread are
    re-issued after the run.

    Example::

        with OpTracker() as ops, SyncWatch(ops, "step") as sync:
            fn(x)
        if sync.found:
            print(sync.found)
    """

    def __init__(self, tracker: OpTracker, fn_name: str, allowed: Any = None) -> None:
        self.tracker = tracker
        self.fn_name = fn_name
        self.allowed = allowed  # ``allowed.allow()``: this synchronisation may pass (a break)
        self.found = ""
        self._thread = threading.get_ident()
        self._others: list[Any] = []

    def __enter__(self) -> SyncWatch:
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning
        warnings.showwarning = self._hook
        self._mode = torch.cuda.get_sync_debug_mode()
        _set_sync_mode("warn")
        return self

    def _hook(self, message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if threading.get_ident() != self._thread:
            return self._show(message, category, filename, lineno, file, line)
        text = str(message)
        if _SYNC_WARNING in text:
            if self.found or (self.allowed is not None and self.allowed.allow()):
                return
            op = f"`{self.tracker.last}`" if self.tracker.last else "an operation"
            self.found = (
                f"`{self.fn_name}` synchronizes with the host: {op}"
                f"{_where(traceback.extract_stack()[:-1])} waits for the GPU, which a CUDA graph "
                f"cannot record (.item(), .cpu(), .tolist(), print, data-dependent shapes)"
            )
        else:
            self._others.append((message, category, filename, lineno))

    def __exit__(self, *exc: Any) -> None:
        _set_sync_mode(self._mode)
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)
        for message, category, filename, lineno in self._others:
            warnings.warn_explicit(message, category, filename, lineno)
