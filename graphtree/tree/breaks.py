"""Breakable recordings: a host read ends a graph segment, and its value keys the segment after it.

A call that reads a CUDA scalar on the host (``.item()``, ``bool(t)``, ``int(t)``, ``if t:``; all
are ``aten._local_scalar_dense``) cannot be captured whole. While recording, :class:`Breaks` ends
the capture at such a read, replays what was captured so far, performs the read, and begins the
next segment of the same pool, so the rest of the Python call runs on and is captured. A replay
launches segment 1, performs the same read (on the same memory: a pool block, a placeholder or a
tensor read in place), and launches the segment recorded after that value. Python control flow
that depends on the value is right by construction: each value has its own segments.

A value never seen at a break is recorded on the replay that meets it: the function runs again
from the start, under capture, from the same allocator state, with the earlier reads answered
from the values the replay read; those segments' captures are thrown away (the replay already ran
them), and the first new segment is captured after the new value. That relies on the caching
allocator handing out the same addresses for the same requests from the same state; it is checked,
not assumed: each segment keeps the addresses its operations returned (:attr:`Segment.trace`), and a
re-run that differs fails the recording (eager, with the reason).

Example (what a replay does, in :meth:`graphtree.tree.node.Node.run_segments`)::

    seg = node.first
    seg.launch()
    while seg.read is not None:
        seg = seg.next[value_key(seg.read.value())]
        seg.launch()
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphtree import _torch
from graphtree.tree.capture import is_internal

ITEM = torch.ops.aten._local_scalar_dense.default
READS = frozenset({ITEM, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default})
"""The operations a recording breaks at: every host read of a CUDA scalar goes through one of them
(``bool(t)`` reaches a dispatch mode as ``is_nonzero`` under ``inference_mode``, else as
``_local_scalar_dense``)."""

MAX_VALUES = 8
"""Distinct values one break may take before the call's signature runs eagerly, when breaks are on
(``graphed(..., max_break_values=MAX_VALUES)``): a float loss read for logging has a new value on
every call. Off by default (0) until the whole GPU suite has run with them on: see DESIGN.md."""


def value_key(value: Any) -> Any:
    """The key of a read's value: its type and value (``True`` and ``1`` differ; NaN equals NaN).

    The value itself, not what the code does with it: ``if t.item() > 0:`` keys on the float,
    which may differ on every call (up to ``max_break_values``); ``if t > 0:`` keys on a bool.
    """
    if isinstance(value, float) and value != value:
        return (float, "nan")
    return (type(value), value)


def _where() -> str:
    """The caller's line that read the value (for messages and ``describe()``)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not is_internal(frame.filename):
            return f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    return "an operation of the function"


class Read:
    """Where a break's host read finds its value on replay: the same bytes the recording read."""

    def __init__(self, op: Any, t: torch.Tensor, where: str) -> None:
        self.op = op  # one of READS
        st = t.untyped_storage()
        self.meta = _torch.meta_of(t)
        self.ptr = st.data_ptr()
        self.nbytes = st.nbytes()
        self.device = t.device
        self.where = where

    def value(self) -> Any:
        """Read the value now (waits for the work launched before it on the current stream)."""
        return self.op(_torch.tensor_on(self.meta, _torch.storage_at(self.ptr, self.device, self.nbytes)))


class Segment:
    """One graph of a broken recording, and the segments recorded after each value of its read.

    ``read`` is ``None`` for a call's last segment, whose ``node`` is the recording it completes.
    """

    def __init__(self, graph: torch.cuda.CUDAGraph, read: Read | None, trace: tuple[int, ...]) -> None:
        self.graph = graph
        self.launch = _torch.graph_launcher(graph)
        self.read = read
        self.trace = trace  # addresses its operations returned, in order: the determinism check
        self.next: dict[Any, Segment] = {}
        self.node: Any = None  # the Node a last segment completes
        self.leaves: list[Any] = []  # on a first segment: the Node of every chain that starts with it


class BranchMismatch(RuntimeError):
    """A re-run for a new value did not allocate as the recording it extends did."""


class Breaks(TorchDispatchMode):
    """While capturing a call, ends the segment at each host read and begins the next.

    Args:
        begin: begins capturing into a new graph on the current stream (the recorder's).
        first_replay: before the first segment's replay, copies the call's inputs in.
        prefix: for a value never seen: the segments the replay ran and the values they read;
            their captures are thrown away, and the reads answered with those values.
        placed: addresses of the call's inputs in the pool: the start of the first segment's trace.
    """

    def __init__(
        self,
        begin: Callable[[torch.cuda.CUDAGraph], None],
        new_graph: Callable[[], torch.cuda.CUDAGraph],
        first_replay: Callable[[], None],
        prefix: list[tuple[Segment, Any]] | None = None,
        placed: list[int] | None = None,
        enabled: bool = True,
    ) -> None:
        super().__init__()
        self.enabled = enabled  # False (max_break_values=0): a host read fails the capture as before
        self._begin, self._new_graph, self._first_replay = begin, new_graph, first_replay
        self.prefix = prefix or []
        self.graph = new_graph()
        self.open = False  # a capture into self.graph is under way
        self.trace: list[int] = list(placed or ())
        self.segments: list[Segment] = []  # ended segments, in order (the prefix's own objects first)
        self.values: list[Any] = []  # the value each one's read gave

    def begin(self) -> None:
        self._begin(self.graph)
        self.open = True

    def end(self) -> None:
        self.open = False
        self.graph.capture_end()

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if (
            func not in READS
            or not self.enabled
            or not self.open
            or not (isinstance(args[0], torch.Tensor) and args[0].is_cuda)
        ):
            out = func(*args, **kwargs)
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    self.trace.append(t.data_ptr())
            return out
        t = args[0]
        self.end()
        j = len(self.segments)
        if j < len(self.prefix):  # this segment ran already, in the replay that met a new value
            seg, value = self.prefix[j]
            assert seg.read is not None
            if tuple(self.trace) != seg.trace or t.untyped_storage().data_ptr() != seg.read.ptr:
                raise BranchMismatch(
                    f"running it again for a new value at {seg.read.where} did not allocate as the "
                    f"recording it extends did (segment {j + 1})"
                )
            self.graph = self._new_graph()  # the capture just ended is not needed: drop it
        else:
            if j == 0:
                self._first_replay()
            self.graph.replay()  # what the read needs: the capture ran nothing
            value = func(*args, **kwargs)
            seg = Segment(self.graph, Read(func, t, _where()), tuple(self.trace))
            self.graph = self._new_graph()
        self.segments.append(seg)
        self.values.append(value)
        self.trace = []
        self.begin()
        return value

    def finish(self) -> list[Segment]:
        """The call's segments once its capture ended: the ended ones and the last, linked by value.
        Empty when the call read nothing (an ordinary recording)."""
        if not self.segments:
            return []
        last = Segment(self.graph, None, tuple(self.trace))
        chain = [*self.segments, last]
        for seg, value, after in zip(chain, self.values, chain[1:]):
            seg.next.setdefault(value_key(value), after)
        return chain


class WarmUpReads(TorchDispatchMode):
    """In a warm-up: counts host reads of a CUDA scalar whose synchronisation the sync watch has not
    seen yet (``pending``), so that it lets each pass: they will be breaks.

    (torch hands a warning of its sync debug mode to Python when the outermost call returns, after
    this mode's handler: hence a count, not a flag.)"""

    def __init__(self) -> None:
        super().__init__()
        self.pending = 0

    def allow(self) -> bool:
        """Whether the synchronisation warned about now is one of these reads (and count it off)."""
        if self.pending:
            self.pending -= 1
            return True
        return False

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func in READS and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            self.pending += 1
        return func(*args, **kwargs)
