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

Breaks at reads are on by default (``graphed(fn, max_break_values=N)``, N = 8; 0 turns them off). A function marked with
:func:`eager` breaks a recording wherever it is called, breaks on or off: it runs between two
segments on every replay (:class:`EagerPart`), and what it returns besides tensors keys the
segment after it, as a read's value does.

Example (what a replay does, in :meth:`graphtree.tree.node.Node.run_segments`)::

    seg = node.first
    seg.launch()
    while seg.read is not None:
        seg = seg.next[seg.read.key(seg.read.value())]
        seg.launch()
"""

from __future__ import annotations

import functools
import threading
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from graphtree import _torch
from graphtree.tree import draws as _draws
from graphtree.tree.callee import user_code
from graphtree.tree.capture import is_internal
from graphtree.tree.sites import CaptureSites, Site

ITEM = torch.ops.aten._local_scalar_dense.default
READS = frozenset({ITEM, torch.ops.aten.is_nonzero.default, torch.ops.aten.item.default})
"""The operations of a host read of a CUDA scalar: every one goes through one of them (``bool(t)``
reaches a dispatch mode as ``is_nonzero`` under ``inference_mode``, else as ``_local_scalar_dense``)."""

_aten = torch.ops.aten
TO_HOST = frozenset({_aten._to_copy.default, _aten.to.dtype_layout, _aten.to.device, _aten.to.other, _aten.to.dtype})
"""Operations that may copy a CUDA tensor to the host (``.cpu()``, ``.tolist()``, ``.to("cpu")``)."""

MAX_READ_ELEMENTS = 256
"""A copy to the host of at most this many elements is a read (its contents key what follows);
a larger one cannot be keyed and makes the signature eager, as before."""


_wait_watchers: list[Callable[[torch.cuda.Stream], None]] = []


def _watch_event_waits(note: Callable[[torch.cuda.Stream], None]) -> None:
    """Call ``note(stream)`` after every ``torch.cuda.Event.wait`` (which ``Stream.wait_event`` and
    ``Stream.wait_stream`` go through) with the stream made to wait: how a capture learns which side
    streams joined it (a fork). Installed once per process; ``note`` must be cheap when it has nothing
    to do. ``torch.Event`` (the device-generic API) and direct ``cudaStreamWaitEvent`` calls are not seen.
    """
    if note in _wait_watchers:
        return
    _wait_watchers.append(note)
    if len(_wait_watchers) > 1:
        return
    wait = torch.cuda.Event.wait

    def watched(self: torch.cuda.Event, stream: Any = None) -> None:
        if stream is None:
            stream = torch.cuda.current_stream()
        wait(self, stream)
        for watcher in _wait_watchers:
            watcher(stream)

    functools.update_wrapper(watched, wait)
    torch.cuda.Event.wait = watched  # type: ignore[method-assign]


def is_read(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``func(*args, **kwargs)`` reads a CUDA tensor on the host: a scalar, or a copy of a
    small tensor to the CPU."""
    x = args[0] if args else None
    if not (isinstance(x, torch.Tensor) and x.is_cuda):
        return False
    if func in READS:
        return True
    if func not in TO_HOST or x.numel() > MAX_READ_ELEMENTS:
        return False
    target = kwargs.get("device")
    if target is None and len(args) > 1:
        target = args[1].device if isinstance(args[1], torch.Tensor) else args[1]
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def value_key(value: Any) -> Any:
    """The key of a read's value: its type and value (``True`` and ``1`` differ; NaN equals NaN; a
    tensor copied to the host by its dtype, shape and contents).

    The value itself, not what the code does with it: ``if t.item() > 0:`` keys on the float,
    which may differ on every call (up to ``max_break_values``); ``if t > 0:`` keys on a bool.
    """
    if isinstance(value, float) and value != value:
        return (float, "nan")
    if isinstance(value, torch.Tensor):
        return (torch.Tensor, value.dtype, tuple(value.shape), tuple(value_key(v) for v in value.flatten().tolist()))
    return (type(value), value)


def _where() -> str:
    """The caller's line that read the value (for messages and ``describe()``)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if not is_internal(frame.filename):
            return f"{frame.filename}:{frame.lineno} (`{(frame.line or '').strip()}`)"
    return "an operation of the function"


class _View:
    """A CUDA tensor a read or an eager part was given, to view again at the same memory on each replay."""

    def __init__(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        self.meta, self.ptr, self.nbytes, self.device = _torch.meta_of(t), st.data_ptr(), st.nbytes(), t.device

    def tensor(self) -> torch.Tensor:
        return _torch.tensor_on(self.meta, _torch.storage_at(self.ptr, self.device, self.nbytes))


class Read:
    """Where a break's host read finds its value on replay: the same bytes the recording read."""

    def __init__(self, op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> None:
        self.op = op  # one of READS or TO_HOST (see is_read)
        self.source = _View(args[0])  # where the recording read it
        self.rest, self.kwargs = args[1:], kwargs  # (a target device, a dtype: plain values, or a CPU tensor)
        self.where = where

    @staticmethod
    def key(value: Any) -> Any:
        """What the segment after it is keyed on."""
        return value_key(value)

    def describe(self, value: Any) -> str:
        """The break as ``describe()`` shows it."""
        return f"read {value!r} at {self.where}"

    def value(self) -> Any:
        """Read the value now (waits for the work launched before it on the current stream)."""
        return self.op(self.source.tensor(), *self.rest, **self.kwargs)


class EagerPart:
    """A call of a :func:`eager` function between two segments: run again on every replay.

    Its tensor arguments are read where the recording found them (the segment before has just
    written those written by the graph); its other arguments are the recording's. The tensors it
    returns are copied into those it returned while recording (``landing``), which the segments
    after it read; what else it returns keys the segment after it, as a read's value does.
    """

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        self.fn = fn
        self.where = f"the graphtree.eager function `{getattr(fn, '__qualname__', fn)}` ({_where()})"
        leaves, self._spec = _torch.tree_flatten((args, kwargs))
        # a tensor argument: (meta, storage address, bytes) to view it again; anything else as it was
        self._args = [_View(t) if isinstance(t, torch.Tensor) and t.is_cuda else t for t in leaves]
        outs, _ = _torch.tree_flatten(out)
        for t in outs:
            if isinstance(t, torch.Tensor) and not t.is_cuda:
                raise BreakFailed(f"{self.where} returned a {t.device} tensor: return CUDA tensors, or plain values")
        # Copies, made outside the pool: a returned argument (or a view of one) is pool memory that
        # must not stay allocated past the recording.
        self.landing = [t.detach().clone() for t in outs if isinstance(t, torch.Tensor)]
        self.last: Any = None  # what the last run returned, its tensors the landing ones (see land)

    @staticmethod
    def key(value: Any) -> Any:
        """What the segment after it is keyed on: :meth:`value` returns it already."""
        return value

    def describe(self, value: Any) -> str:
        """The break as ``describe()`` shows it."""
        return f"ran {self.where}"

    def value(self) -> Any:
        """Run the function now; copy its tensors into the recorded ones; the key of the rest."""
        leaves = [a.tensor() if isinstance(a, _View) else a for a in self._args]
        args, kwargs = _torch.tree_unflatten(leaves, self._spec)
        was, user_code.active = user_code.active, True  # a graphed function it calls runs inline
        try:
            out = self.fn(*args, **kwargs)
        finally:
            user_code.active = was
        return self.land(out)

    def land(self, out: Any) -> Any:
        """Copy ``out``'s tensors into :attr:`landing`; what the next segment is keyed on."""
        outs, spec = _torch.flatten_outputs(out)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.landing) or any(
            a.shape != b.shape or a.dtype != b.dtype for a, b in zip(tensors, self.landing)
        ):
            raise RuntimeError(
                f"graphtree: {self.where} returned tensors of other shapes or dtypes than while it was "
                f"recorded ({[(tuple(t.shape), t.dtype) for t in tensors]}): what the graph after it reads "
                f"cannot change; return tensors of fixed shapes (or pass their shapes as arguments)"
            )
        for dst, src in zip(self.landing, tensors):
            if dst is not src:
                dst.copy_(src)
        landed = iter(self.landing)
        self.last = _torch.tree_unflatten([next(landed) if isinstance(v, torch.Tensor) else v for v in outs], spec)
        return (str(spec), *(value_key(v) for v in outs if not isinstance(v, torch.Tensor)))


class Segment:
    """One graph of a broken recording, and the segments recorded after each value of its read.

    ``read`` (a host read or an eager part) is ``None`` for a call's last segment, whose ``node``
    is the recording it completes.
    """

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        read: Read | EagerPart | None,
        trace: tuple[int, ...],
        sites: list[Site] | None = None,
        changes_state: bool = False,
    ) -> None:
        self.graph = graph
        self.sites = sites or []  # which Python stack made which of its nodes (tree/sites.py)
        # whether replaying it changes memory the call did not allocate (an input or state written in
        # place) or runs an eager part: then running the call again eagerly after it would do that twice
        self.changes_state = changes_state or isinstance(read, EagerPart)
        self.launch = _draws.launcher(graph)
        self.read = read
        self.trace = trace  # addresses its operations returned, in order: the determinism check
        self.next: dict[Any, Segment] = {}
        self.node: Any = None  # the Node a last segment completes
        self.leaves: list[Any] = []  # on a first segment: the Node of every chain that starts with it

    def unlink(self) -> None:
        """Drop the links of this segment and all after it (nodes and segments refer to each other:
        unlinked, reference counting frees their graphs without waiting for the collector)."""
        stack = [self]
        while stack:
            seg = stack.pop()
            stack.extend(seg.next.values())
            seg.next, seg.node, seg.leaves = {}, None, []


class BreakFailed(RuntimeError):
    """A break that cannot be recorded: a re-run for a new value did not allocate (or read) as the
    recording it extends did, or an eager part returned what a graph cannot take."""


class Breaks(_torch.EagerDispatchMode):
    """While capturing a call, ends the segment at each host read and begins the next.

    Args:
        begin: begins capturing into a new graph on the current stream (the recorder's).
        first_replay: before the first segment's replay, copies the call's inputs in.
        prefix: for a value never seen: the segments the replay ran and the values they read;
            their captures are thrown away, and the reads answered with those values.
        placed: addresses of the call's inputs in the pool: the start of the first segment's trace.
    """

    ignore_compile_internals = _torch.StateWatch.ignore_compile_internals  # (compiled code stays compiled)

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
        self.sites = CaptureSites()  # the nodes each operation adds, for profiles started later
        self.open = False  # a capture into self.graph is under way
        self.trace: list[int] = list(placed or ())
        self.segments: list[Segment] = []  # ended segments, in order (the prefix's own objects first)
        self.values: list[Any] = []  # the value each one's read gave
        self.made: set[int] = set()  # storages this call's operations allocated (all segments)
        self.changes_state = False  # the segment under capture wrote memory the call did not allocate
        self.origin: torch.cuda.Stream | None = None  # the stream the captures begin on
        self.forked: dict[int, torch.cuda.Stream] = {}  # side streams made to wait during a capture
        _watch_event_waits(_on_wait)

    def begin(self) -> None:
        self.origin = torch.cuda.current_stream()
        self._begin(self.graph)
        self.open = True

    def end(self) -> list[torch.cuda.Stream]:
        """End the capture under way, first joining the side streams forked into it (a capture
        cannot end with work of a stream it forked unjoined); returns those streams."""
        joined = self._join()
        _draws.seal(self.graph)
        self.open = False
        with warnings.catch_warnings():
            # a segment with no work (a read right before another, or before the call returns) is
            # an empty graph, which torch warns of as a capture gone wrong; its replay does nothing
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            self.graph.capture_end()
        return joined

    def note_wait(self, stream: torch.cuda.Stream) -> None:
        """A stream was made to wait on an event (see :func:`_watch_event_waits`): if
        the event was the capture's, that stream is forked into it now."""
        origin = self.origin
        raw = getattr(stream, "cuda_stream", None)  # (a torch.Stream has none: not a CUDA one)
        if self.open and origin is not None and raw is not None and raw != origin.cuda_stream:
            self.forked[raw] = stream

    def _join(self) -> list[torch.cuda.Stream]:
        origin = self.origin
        joined = []
        if origin is not None:
            with _torch.no_dispatch_modes():
                for side in self.forked.values():
                    if _torch.stream_capturing(side):
                        origin.wait_stream(side)
                        joined.append(side)
        self.forked = {}
        return joined

    def __enter__(self) -> Breaks:
        self._outer = getattr(_here, "breaks", None)
        _here.breaks = self
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        _here.breaks = self._outer
        super().__exit__(*exc)

    def _break(
        self, same: Callable[[Read | EagerPart | None], bool], run: Callable[[], tuple[Read | EagerPart, Any]]
    ) -> tuple[Segment, Any]:
        """End the segment under capture at a break and begin the next; the segment and the value
        its break gave. ``run`` performs the break (the capture having run nothing, what it needs
        is replayed first) and returns it with its value; when the break re-runs one the prefix
        went through, the prefix's segment and value stand instead, if ``same`` says the break is
        that one and the segment allocated as before.

        Side streams forked into the capture are joined before it ends and forked again into the
        next (a read made on one runs on the capture's own stream), so that the work queued on
        them after the break is captured too: a segment is whole when its graph ends."""
        assert self.origin is not None
        with torch.cuda.stream(self.origin):
            return self._break_on_origin(same, run)

    def _break_on_origin(
        self, same: Callable[[Read | EagerPart | None], bool], run: Callable[[], tuple[Read | EagerPart, Any]]
    ) -> tuple[Segment, Any]:
        forked = self.end()
        j = len(self.segments)
        if j < len(self.prefix):  # this segment ran already, in the replay that met a new value
            seg, value = self.prefix[j]
            if not same(seg.read) or tuple(self.trace) != seg.trace:
                where = seg.read.where if seg.read is not None else "the end of the call"
                raise BreakFailed(
                    f"running it again for a new value did not reach {where} as the recording it "
                    f"extends did, at the same addresses (segment {j + 1})"
                )
            self.graph = self._new_graph()  # the capture just ended is not needed: drop it
            self.sites.take()
        else:
            with _torch.no_dispatch_modes():  # plain eager work, unseen by the recorder's watches
                if j == 0:
                    self._first_replay()
                _draws.replay(self.graph)
                brk, value = run()
            seg = Segment(self.graph, brk, tuple(self.trace), self.sites.take(), self.changes_state)
            self.graph = self._new_graph()
        self.segments.append(seg)
        self.values.append(value)
        self.trace = []
        self.changes_state = False
        # unseen by the recorder's watches: beginning a capture allocates the state of the graph's
        # generator (an eager part's break is met with every watch active; a read's inside them)
        with _torch.no_dispatch_modes():
            self.begin()
            for side in forked:  # forked again into the next segment's capture
                side.wait_stream(torch.cuda.current_stream())  # (the capture's own: see _break)
        return seg, value

    def eager_part(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A :func:`eager` function called while recording: it ends the segment like a host read,
        runs as plain eager code, and its result keys the segment after it."""

        def run() -> tuple[EagerPart, Any]:
            out = fn(*args, **kwargs)
            part = EagerPart(fn, args, kwargs, out)
            return part, part.land(out)

        seg, _key = self._break(lambda brk: isinstance(brk, EagerPart) and brk.fn is fn, run)
        assert isinstance(seg.read, EagerPart)
        # the landing tensors in its structure (what the graph after it reads): in a re-run for a
        # new value, what it returned in the replay, which is not run twice
        return seg.read.last

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.enabled or not self.open or not is_read(func, args, kwargs):
            if self.open and not self.changes_state and _mutable(func):
                self.changes_state = any(
                    _torch.storage_ptr(t.untyped_storage()) not in self.made for t in _written(func, args, kwargs)
                )
            out = self.run(func, args, kwargs)
            outs = out if isinstance(out, (list, tuple)) else (out,)
            for t in outs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    self.trace.append(_torch.storage_ptr(t.untyped_storage()) and t.data_ptr())
            if self.open:
                for t, fresh in zip(outs, _fresh_returns(func)):
                    if fresh and isinstance(t, torch.Tensor):  # (a view shares its input's storage: not made here)
                        self.made.add(_torch.storage_ptr(t.untyped_storage()))
            if self.sites.on and self.open:
                self.sites.after_op(torch.cuda.current_stream().cuda_stream)
            return out
        ptr = args[0].untyped_storage().data_ptr()
        where = _where()  # the user's line, taken where the stack is the read's
        _seg, value = self._break(
            lambda brk: isinstance(brk, Read) and brk.source.ptr == ptr,
            lambda: (Read(func, args, kwargs, where), self.run(func, args, kwargs)),
        )
        return value

    def finish(self) -> list[Segment]:
        """The call's segments once its capture ended: the ended ones and the last, linked by value.
        Empty when the call read nothing (an ordinary recording)."""
        if not self.segments:
            return []
        last = Segment(self.graph, None, tuple(self.trace), self.sites.take(), self.changes_state)
        chain = [*self.segments, last]
        for seg, value, after in zip(chain, self.values, chain[1:]):
            assert seg.read is not None
            seg.next.setdefault(seg.read.key(value), after)
        return chain


class WarmUpReads(_torch.EagerDispatchMode):
    """In a warm-up: counts host reads of a CUDA scalar whose synchronisation the sync watch has not
    seen yet (``pending``), so that it lets each pass: they will be breaks.

    (torch hands a warning of its sync debug mode to Python when the outermost call returns, after
    this mode's handler: hence a count, not a flag.)"""

    ignore_compile_internals = _torch.StateWatch.ignore_compile_internals  # (compiled code stays compiled)

    def __init__(self, count_reads: bool = True) -> None:
        super().__init__()
        self.count_reads = count_reads  # False: breaks at host reads are off; eager parts still pass
        self.pending = 0
        self.inside = 0  # calls of graphtree.eager functions under way: their syncs are theirs
        self.ops = 0  # operators dispatched (not metadata queries): a part too small to graph (tree/parts.py)

    def allow(self) -> bool:
        """Whether the synchronisation warned about now is one of these reads or inside an eager
        part (a read is counted off)."""
        if self.inside:
            return True
        if self.pending:
            self.pending -= 1
            return True
        return False

    def __enter__(self) -> WarmUpReads:
        self._outer = getattr(_here, "warm_up", None)
        _here.warm_up = self
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: Any) -> None:
        _here.warm_up = self._outer
        super().__exit__(*exc)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        self.ops += 1
        if self.count_reads and is_read(func, args, kwargs):
            self.pending += 1
        return self.run(func, args, kwargs)


_here = threading.local()  # .breaks: the recording under way in this thread, if any


@functools.cache
def _mutable(func: Any) -> bool:
    """Whether an operator writes any of its tensor arguments (in place or ``out=``)."""
    schema = getattr(func, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


@functools.cache
def _fresh_returns(func: Any) -> tuple[bool, ...]:
    """For each return of an operator, whether it is new memory (no alias annotation: not a view,
    not an argument handed back)."""
    schema = getattr(func, "_schema", None)
    return tuple(r.alias_info is None for r in schema.returns) if schema is not None else ()


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """The tensors an operator call writes (its arguments whose alias annotation says write)."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        v = kwargs.get(arg.name) if arg.kwarg_only or i >= len(args) else args[i]
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out


def _on_wait(stream: torch.cuda.Stream) -> None:
    """Every ``torch.cuda.Event.wait`` in the process: a side stream forked into this thread's capture."""
    breaks = getattr(_here, "breaks", None)
    if breaks is not None:
        breaks.note_wait(stream)


_F = TypeVar("_F", bound=Callable[..., Any])


def eager(fn: _F) -> _F:
    """Mark ``fn`` to run eagerly on every replay of the graphed function that calls it.

    For what a graph must not freeze: logging, a host-side effect, an operation that cannot be
    captured. While recording, a call of ``fn`` ends the graph segment; ``fn`` runs as plain eager
    code; the next segment begins after it. Every replay runs ``fn`` again between the same two
    segments, on its tensor arguments where the recording found them (so it sees each replay's
    fresh values). Outside a recording it is an ordinary call.

    Constraints: ``fn`` may read any tensor and write into the tensors it is given; a CUDA tensor
    it is given that the call did not make or receive (a global, say) must stay alive at its
    address, as for a graph's own reads. The CUDA
    tensors it returns must keep their shapes and dtypes from call to call: each replay copies them
    into the ones it returned while recording, which the graph after it reads. What else it
    returns (a bool, an int) chooses the recording that follows, as a host read does. A decorator,
    not a ``with`` block: a replay runs no Python but this function.

    Example::

        @graphtree.eager
        def log(loss):
            print(f"loss {loss.item():.4f}")

        @graphtree.graphed
        def step(x, w):
            loss = ((x @ w) ** 2).mean()
            log(loss)                 # runs on every replay, with that replay's loss
            return loss
    """
    if not callable(fn):
        raise TypeError(f"graphtree.eager needs a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        breaks = getattr(_here, "breaks", None)
        if breaks is None or not breaks.open:  # eager code already (a warm-up, an eager run, no tree)
            warming = getattr(_here, "warm_up", None)
            if warming is None:
                return fn(*args, **kwargs)
            warming.inside += 1  # its host syncs are its own: the warm-up's watch lets them pass
            try:
                return fn(*args, **kwargs)
            finally:
                warming.inside -= 1
        return breaks.eager_part(fn, args, kwargs)

    run.__graphtree_eager__ = True  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]
