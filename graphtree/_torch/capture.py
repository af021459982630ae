"""What graphtree does to torch while it warms up and captures a call: the allocator's routing into
a tree's pool, beginning a capture and cleaning up after one that failed, the random generators a
capture draws from (tree/draws.py says why), and the dispatch mode that watches it all (StateWatch).

Part of :mod:`graphtree._torch`, which re-exports every name here: these touch torch private
APIs too, gated by torch version as the rest of it.
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphtree import _streams
from graphtree._torch.gate import (
    _UNSAFE_TAG,
    _private,
    _strided,
    generator_key,
    storage_ptr,
    weak_expired,
    weak_free,
    weak_ref,
)


def begin_allocate_to_pool(device: int, pool_id: tuple[int, int]) -> None:
    """Route this thread's allocations on ``device`` into ``pool_id`` (``_cuda_beginAllocateCurrentThreadToPool``).

    Warm-ups run this way, so their memory comes from (and returns to) the tree's pool.
    """
    _private("_cuda_beginAllocateCurrentThreadToPool")(device, pool_id)


def end_allocate_to_pool(device: int, pool_id: tuple[int, int]) -> None:
    """Stop routing allocations into ``pool_id`` (``_cuda_endAllocateToPool``) and drop the
    reference :func:`begin_allocate_to_pool` took (``_cuda_releasePool``)."""
    _private("_cuda_endAllocateToPool")(device, pool_id)
    _private("_cuda_releasePool")(device, pool_id)


def end_failed_capture(device: int, pool_id: tuple[int, int], began: bool = True, isolated: bool = False) -> int:
    """Undo what a capture that raised left behind; returns how many routing entries it removed.

    When ``cudaStreamEndCapture`` fails, torch's ``capture_end`` throws before it stops routing
    allocations into the pool, before the CUDA random generators leave capture mode, and without
    the graph ever giving back the reference it took on the pool. The first makes the next
    capture into the pool fail ("already recording to mempool_id"), the second the next random op
    ("Offset increment outside graph capture"), the third keeps the pool's memory reserved for
    good (measured: 18 MiB stayed reserved after a failed capture on an H200, none with the
    release). All three are undone here: the routing entries are removed, an empty capture on a
    scratch stream puts the generators back in normal mode, and, if ``capture_begin`` had
    succeeded (``began``), the pool reference is released (``_cuda_releasePool``).

    An ``isolated`` capture (:func:`begin_capture` kept the default generator out) left only its
    stand-ins in capture mode, which nothing else draws from: no empty capture then, for torch's
    would put the default generator in capture mode for a moment, and another thread's random op
    would fail in it.
    """
    removed = 0
    while removed < 8:
        try:
            _private("_cuda_endAllocateToPool")(device, pool_id)
        except RuntimeError:  # nothing (more) routed there
            break
        removed += 1
    if began:
        _private("_cuda_releasePool")(device, pool_id)
    if not isolated:
        capture_empty(torch.cuda.CUDAGraph(), device)
    return removed


def stream_capturing(stream: torch.cuda.Stream) -> bool:
    """Whether ``stream`` is capturing into a CUDA graph now."""
    with torch.cuda.stream(stream):
        return torch.cuda.is_current_stream_capturing()


def end_open_capture(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """End the capture ``graph`` left open on ``stream`` (its ``capture_begin`` or ``capture_end``
    raised before ``cudaStreamEndCapture``); True when it ended, so that the graph now owns its
    reference on the pool. A stream left capturing would fail every later operation queued on it."""
    if not stream_capturing(stream):
        return False
    with torch.cuda.stream(stream):
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - the capture is broken: end_failed_capture cleans up
            return False
        return True


_empty_capture_lock = threading.Lock()


def begin_capture(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, device: int, standin: torch.Generator | None
) -> bool:
    """Begin capturing into ``graph`` on the current stream, in thread-local mode; True when the
    device's default CUDA generator was kept out of it.

    With a ``standin`` and graphtree's native CUDA part (torch before 2.12), the capture registers the
    stand-in's state instead of the default generator's (``_native.capture_begin_isolated``), so that
    other threads' random ops are not disturbed while it runs; the capture's own random ops must
    then draw from the stand-in (:func:`draw_from`), and its replays go through
    ``_native.replay_drawing`` (tree/draws.py). Otherwise torch's own ``capture_begin``.
    """
    from graphtree import _native  # loaded after this module, in the background

    begin = getattr(_native.capture, "capture_begin_isolated", None)
    if standin is None or begin is None:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[arg-type]  # (int, int)
        return False
    begin(graph, pool or (0, 0), standin)
    return True


def capture_empty(
    graph: torch.cuda.CUDAGraph, device: int, pool: tuple[int, int] | None = None, isolated: bool = False
) -> None:
    """Capture nothing into ``graph`` on a scratch stream of ``device`` (into ``pool`` if given).

    ``isolated``: keep the default CUDA generator out of it where graphtree's native CUDA part is
    built, so that other threads' random ops are not disturbed; not when the empty capture is meant
    to put that generator back in normal mode (:func:`end_failed_capture`).

    torch warns "The CUDA Graph is empty", which is meant here: the warning is silenced, one
    thread at a time (``warnings.catch_warnings`` is process-wide state; two threads inside it
    at once restore each other's filters, and the warning leaks).
    """
    with _empty_capture_lock, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.cuda.device(device), _streams.borrowed(device) as stream, torch.cuda.stream(stream):
            begin_capture(graph, pool, device, torch.Generator(device=f"cuda:{device}") if isolated else None)
            graph.capture_end()


_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


class RandomOutsideCapture(RuntimeError):
    """A random operation a capture that keeps the default generator out cannot give a stand-in
    (see :func:`draw_from`): it would not draw eager's numbers, so the call runs eagerly."""


@functools.cache
def _generator_overload(func: Any) -> Any:
    """``func`` if it takes a ``generator``, else its overload with the same arguments and a
    ``generator`` (``aten.randn.default`` -> ``aten.randn.generator``), or None."""
    names = {a.name for a in func._schema.arguments}
    if "generator" in names:
        return func
    packet = func.overloadpacket
    for name in packet.overloads():
        other = getattr(packet, name)
        if {a.name for a in other._schema.arguments} == names | {"generator"}:
            return other
    return None


def generator_of(func: Any, args: tuple, kwargs: dict) -> torch.Generator | None:
    """The ``generator`` argument a random operation was given, or None (it draws from the default one)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            gen = kwargs.get("generator", args[i] if i < len(args) and not a.kwarg_only else None)
            return gen if isinstance(gen, torch.Generator) else None
    return None


def draw_from(
    standin_of: Callable[[torch.Generator | None], torch.Generator], func: Any, args: tuple, kwargs: dict
) -> Any:
    """Run the random operation ``func`` drawing from ``standin_of(g)`` in place of the generator ``g``
    it was given (None: the default one), through the same kernel as eager.

    Operators without a generator argument take their overload that has one (``aten.randn.default``
    -> ``aten.randn.generator``: the same kernel); ``native_dropout``'s kernel is ``_fused_dropout``'s
    with a bool mask (the same draws and the same output; the mask is made bool). Others (the fused
    attention kernels with dropout on) can only draw from the default generator: they raise
    :class:`RandomOutsideCapture` naming the operator, before anything is launched."""
    if func is _NATIVE_DROPOUT:
        x, p, train = (*args, *kwargs.values(), None)[:3]
        if train is not False and p < 1 and x.numel():  # (else it draws nothing)
            out, mask = torch.ops.aten._fused_dropout(x, 1.0 - p, generator=standin_of(None))
            return out, mask.bool()
        return func(*args, **kwargs)
    target = _generator_overload(func)
    if target is None:
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:  # torch checks before it launches anything: the capture is intact
            if "not in capture mode" not in str(e):
                raise
            raise RandomOutsideCapture(
                f"{func.name()} draws random numbers from the device's default generator only, which a "
                "recording cannot hand eager's sequence on torch < 2.12 while other threads may draw"
            ) from None
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    named["generator"] = standin_of(named.get("generator"))
    return target(**named)


_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default
_HOST_READS = frozenset(
    {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default, torch.ops.aten.is_nonzero.default}
)
_AS_STRIDED = frozenset({torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_copy.default})
# Operators that, called under a dispatch mode (graphtree's watches), compute otherwise than eagerly
# (found by the OpInfo sweep, issue 44), with why:
_RNG_STATE_OUT = "returns its random-number state as CUDA tensors in a capture, as CPU tensors eagerly"
_UNLIKE_EAGER = {
    "aten::_efficient_attention_forward": _RNG_STATE_OUT,
    "aten::_flash_attention_forward": _RNG_STATE_OUT,
}


def _span(size: Any, stride: Any, offset: int) -> tuple[int, int]:
    """The first and last storage offsets a view of ``size`` and ``stride`` at ``offset`` reaches
    (last < first: no element)."""
    lo = hi = offset
    for n, s in zip(size, stride):
        if n == 0:
            return offset, offset - 1
        lo, hi = lo + min(0, (n - 1) * s), hi + max(0, (n - 1) * s)
    return lo, hi


def strided_elsewhere(x: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``as_strided(x, size, stride, storage_offset)`` (``args`` after ``x``) may view memory
    other than ``x``'s own elements: an explicit ``storage_offset`` (it counts from the start of the
    storage, not from ``x``), a view past ``x``'s first or last element, or ``x`` with gaps."""
    named = dict(zip(("size", "stride", "storage_offset"), args))
    named.update(kwargs)
    if named.get("storage_offset") is not None:
        return True
    offset = int(x.storage_offset())
    lo, hi = _span(named["size"], named["stride"], offset)
    if hi < lo:
        return False
    first, last = _span(x.shape, x.stride(), offset)
    if lo < first or hi > last:
        return True
    step = 1  # dense: each dimension's stride the product of the sizes of those with smaller strides
    for s, n in sorted((s, n) for n, s in zip(x.shape, x.stride()) if n != 1):
        if s != step:
            return True
        step *= n
    return False


# --- dispatch modes that run operators as eager runs them ----------------------------------------
# torch calls a dispatch mode's handler with every key above Python off, autocast's included, and an
# operator's kernel then calls the operators inside it without autocast. For most operators that is
# what eager does too (autocast has cast their inputs, or they call nothing autocast casts); for
# these, eager's kernels run their inside under autocast (linalg_pinv's matmuls: bfloat16 eagerly,
# float32 below a mode; found by the OpInfo sweep, issue 44, on CUDA, where no operator autocast
# casts calls them):
_AUTOCAST_INSIDE = frozenset({"aten::linalg_pinv"})


_at_call = threading.local()  # .autocast: CUDA autocast on at the last torch call (note_torch_call)


_NOW = object()


def note_torch_call(state: Any = _NOW) -> None:
    """A torch function is being called (a function mode's handler, before dispatch, where autocast's
    state can still be read): :class:`EagerDispatchMode` runs the operators it reaches as eager.
    ``note_torch_call(None)``: no call is under way (the function mode ends)."""
    _at_call.autocast = torch.is_autocast_enabled("cuda") if state is _NOW else state


class EagerDispatchMode(TorchDispatchMode):
    """A dispatch mode whose handler runs each operator as eager would (:meth:`run`): the operators
    of :data:`_AUTOCAST_INSIDE` with CUDA autocast on inside them where it was on at the torch call
    that reached them (:func:`note_torch_call`; else where the mode was entered). Only the innermost
    mode's handler runs the kernel: every graphtree mode uses :meth:`run`."""

    _autocast = False

    def __enter__(self) -> Any:
        self._autocast = torch.is_autocast_enabled("cuda")
        return super().__enter__()

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func(*args, **kwargs)``, as eager runs it."""
        at_call = getattr(_at_call, "autocast", None)
        if func._schema.name not in _AUTOCAST_INSIDE or not (self._autocast if at_call is None else at_call):
            return func(*args, **kwargs)
        excluded = torch._C._dispatch_tls_local_exclude_set().remove(torch._C.DispatchKey.AutocastCUDA)
        with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
            return func(*args, **kwargs)


# --- the CUDA generators' state, set or read by the code of a warm-up or capture ------------------
_STATE_FUNCTIONS = (
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "manual_seed",
    "manual_seed_all",
    "seed",
    "seed_all",
)
_watching = threading.local()  # .watch: this thread's active StateWatch
_wrapped: dict[str, Any] = {}  # torch.cuda's own functions, while wrapped
_wrap_lock = threading.Lock()
_wrap_count = 0


def _noting(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def noted(*args: Any, **kwargs: Any) -> Any:
        watch = getattr(_watching, "watch", None)
        if watch is not None and not watch.generator_state:
            watch.generator_state = f"torch.cuda.{name}"
        return fn(*args, **kwargs)

    return noted


def _watch_generator_state(on: bool) -> None:
    """Wrap torch.cuda's functions that read or set the CUDA generators' state while any StateWatch
    is active (``torch.manual_seed``, ``torch.random.fork_rng`` and ``torch.utils.checkpoint`` call
    them through the module), so that a watch notes them: a recording draws from a stand-in
    generator (tree/draws.py), and such a call would read or set the real one. Calls of other
    threads pass through."""
    global _wrap_count
    with _wrap_lock:
        _wrap_count += 1 if on else -1
        if on and _wrap_count == 1:
            for name in _STATE_FUNCTIONS:
                fn = getattr(torch.cuda, name, None)
                if fn is not None:
                    _wrapped[name] = fn
                    setattr(torch.cuda, name, _noting(name, fn))
        elif not on and _wrap_count == 0:
            for name, fn in _wrapped.items():
                setattr(torch.cuda, name, fn)
            _wrapped.clear()


class StateWatch(EagerDispatchMode):
    """While active, notes what the operations of a warm-up or capture do to memory.

    - ``written``: which of the ``watched`` storages (data_ptr -> leaf index) an operation
      writes to. Read from the operators' schemas (an argument whose alias info says it is
      written), so it works for inference tensors too, which keep no version counter.
    - ``made``: weak references (:func:`weak_ref`) to the storages the operations allocated
      (returned, and not one of those they were given: in-place and view results are not
      new), by address: :meth:`kept` says which are still alive after the call.
    - ``read`` (only with ``track_reads``): ``(weak ref, nbytes)`` of every CUDA storage an
      operation was given, by address: what a graph captured under this watch reads.
    - ``strided``: the first ``as_strided`` of a watched storage that may view memory beyond the
      tensor it is given (:func:`strided_elsewhere`), as ``"aten::as_strided on input i"``: a copied
      input's placeholder holds that input's elements only, at another storage offset.
    - ``host_read``: the first watched CPU tensor (a 0-dim input, which a recording fills into a
      CUDA placeholder) an operation read on the host, by leaf index (-1: none). ``.item()`` and
      operators that take it as a host value (``torch.tensor_split``'s indices) read it so; given the
      placeholder, they would synchronize or refuse a CUDA tensor.

    Release the weak references with :meth:`close`.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code inside the call is compiled (under a mode that says False, dynamo skips the
        frame, and goes on skipping its code), and the watch sees the compiled artifact's operators."""
        return True

    def __init__(self, watched: dict[int, int], track_reads: bool = False) -> None:
        super().__init__()
        self.watched = watched
        self.written: list[int] = []
        self.made: dict[int, int] = {}
        self.read: dict[int, tuple[int, int]] = {}
        self.unsafe = ""  # the first operation tagged torch.Tag.cudagraph_unsafe, by name
        self.host_read = -1  # the first watched CPU input read on the host, by leaf index
        self.strided = ""  # the first as_strided that may view memory beyond a watched input
        self.generator_state = ""  # the first torch.cuda function that read or set a generator's state
        self.unlike_eager = ""  # the first operator that computes otherwise under a dispatch mode, and why
        # random ops draw from standin_of(their generator) (tree/draws.py); explicit CUDA generators seen,
        # by generator_key
        self.standin_of: Callable[[torch.Generator | None], torch.Generator] | None = None
        self.generators: dict[int, torch.Generator] = {}
        self._track_reads = track_reads

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _UNSAFE_TAG is not None and not self.unsafe and _UNSAFE_TAG in func.tags:
            self.unsafe = str(func.name())
        if func in _HOST_READS and self.host_read < 0 and self.watched:
            x = args[0] if args else None
            if isinstance(x, torch.Tensor) and not x.is_cuda and x.layout is _strided:
                self.host_read = self.watched.get(storage_ptr(x.untyped_storage()), -1)
        if not self.unlike_eager:
            name = func._schema.name
            why = _UNLIKE_EAGER.get(name)
            if why:
                self.unlike_eager = f"{name} ({why})"
        if func in _AS_STRIDED and not self.strided and self.watched and isinstance(args[0], torch.Tensor):
            idx = self.watched.get(storage_ptr(args[0].untyped_storage()))
            if idx is not None and strided_elsewhere(args[0], args[1:], kwargs):
                self.strided = f"{func.name()} on input {idx}"
        if self.watched and func._schema.is_mutable:
            for i, arg in enumerate(func._schema.arguments):
                info = arg.alias_info
                if info is None or not info.is_write:
                    continue
                val = kwargs.get(arg.name) if arg.kwarg_only else (args[i] if i < len(args) else kwargs.get(arg.name))
                if isinstance(val, torch.Tensor) and val.layout is _strided and not val.is_nested:
                    idx = self.watched.get(storage_ptr(val.untyped_storage()))
                    if idx is not None and idx not in self.written:
                        self.written.append(idx)
        given: set[int] = set()  # storages the operation was given: what it returns of them is not new
        for a in (*args, *kwargs.values()):
            for t in a if isinstance(a, (list, tuple)) else (a,):
                if isinstance(t, torch.Tensor) and t.is_cuda and t.layout is _strided and not t.is_nested:
                    st = t.untyped_storage()
                    ptr = storage_ptr(st)
                    given.add(ptr)
                    if self._track_reads and ptr and ptr not in self.read:
                        self.read[ptr] = (weak_ref(st), st.nbytes())
        seeded = _SEEDED in func.tags
        if seeded:
            gen = generator_of(func, args, kwargs)
            if gen is not None and gen.device.type == "cuda":
                self.generators[generator_key(gen)] = gen
        out = (
            draw_from(self.standin_of, func, args, kwargs)
            if seeded and self.standin_of
            else self.run(func, args, kwargs)
        )
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_cuda and t.layout is _strided and not t.is_nested:
                st = t.untyped_storage()
                ptr = storage_ptr(st)
                if ptr and ptr not in given:
                    old = self.made.get(ptr)
                    if old is None or weak_expired(old):
                        if old is not None:
                            weak_free(old)
                        self.made[ptr] = weak_ref(st)
        return out

    def kept(self, known: set[int]) -> list[int]:
        """Addresses of storages the operations made that are still alive, other than ``known``
        (the ``StorageImpl`` pointers of :func:`storage_id` of the outputs and inputs)."""
        return [ptr for ptr, r in self.made.items() if not weak_expired(r) and r not in known]

    def __enter__(self) -> StateWatch:
        _watch_generator_state(True)
        self._outer_watch = getattr(_watching, "watch", None)
        _watching.watch = self
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        _watching.watch = self._outer_watch
        _watch_generator_state(False)
        super().__exit__(*exc)

    def close(self) -> None:
        """Release every weak reference the watch holds."""
        for r in self.made.values():
            weak_free(r)
        for r, _ in self.read.values():
            weak_free(r)
        self.made.clear()
        self.read.clear()
