"""The one module of graphtree that touches torch private APIs.

Everything here is version-gated: graphtree is tested against torch 2.11 to 2.13. Each
wrapper says what it is for. A private function that is missing raises
:class:`PrivateAPIMissing` naming it and the torch version, so a torch upgrade fails loudly
at the exact feature that broke instead of corrupting memory.

The CUDA-only functions (``torch._C._cuda_*`` and friends) are absent from CPU builds; they
are looked up lazily, at first use, never at import.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

from graphtree import _streams

TESTED_TORCH = ((2, 11), (2, 13))
"""Oldest and newest torch (major, minor) whose private APIs graphtree was checked against."""


def _parse_version(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TORCH_VERSION = _parse_version(torch.__version__)
VERSION_SUPPORTED = TESTED_TORCH[0] <= TORCH_VERSION <= TESTED_TORCH[1]


class PrivateAPIMissing(RuntimeError):
    """A torch private function graphtree relies on does not exist in this torch build."""


_warned_version = False


@functools.cache  # resolved once per name: some are called on every step (invalidate_storage)
def _private(name: str) -> Callable[..., Any]:
    global _warned_version
    if not VERSION_SUPPORTED and not _warned_version:
        _warned_version = True
        warnings.warn(
            f"graphtree is tested with torch {TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to "
            f"{TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]}; torch {torch.__version__}'s private APIs "
            "may behave differently (run the GPU tests: python -m pytest -m gpu)",
            RuntimeWarning,
            stacklevel=3,
        )
    fn = getattr(torch._C, name, None)
    if fn is None:
        raise PrivateAPIMissing(
            f"graphtree needs torch._C.{name}, which torch {torch.__version__} does not have "
            f"(graphtree is tested with torch {TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to "
            f"{TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]} with CUDA)"
        )
    return fn


def has_private(name: str) -> bool:
    """Whether ``torch._C.<name>`` exists here (used by tests and ``graphtree doctor``)."""
    return getattr(torch._C, name, None) is not None


# --- pytrees: flatten the arguments and outputs of a call -------------------------------------
from torch.utils import _pytree  # noqa: E402  (private module, stable since torch 2.0)

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
pytree_nodes: dict[type, Any] = _pytree.SUPPORTED_NODES
"""The types pytrees flatten (live: registrations made later are in it); any other type is a leaf,
but namedtuples, which pytrees flatten implicitly."""


# --- allocator checkpoints: branch the tree without multiplying memory -------------------------
def checkpoint_pool(device: int, pool_id: tuple[int, int]) -> Any:
    """Snapshot which blocks of ``pool_id`` are allocated (``_cuda_getCheckpointState``).

    Taken right after a recording, so that a later sibling can be recorded from exactly the
    allocator state its parent left behind.
    """
    return _private("_cuda_getCheckpointState")(device, pool_id)


def restore_pool(device: int, state: Any, live_storages: Sequence[int]) -> None:
    """Put the pool's bookkeeping back to ``state`` (``_cuda_setCheckpointPoolState``).

    ``live_storages`` are the ``StorageImpl`` pointers of outputs the caller still holds; the
    allocator hands them deleters so that dropping them later frees their blocks. Blocks that
    were allocated in ``state`` but whose tensors died must be freed afterwards with
    :func:`raw_delete`.
    """
    _private("_cuda_setCheckpointPoolState")(device, state, [], list(live_storages))


def raw_delete(ptr: int) -> None:
    """Free one caching-allocator block by address (``_cuda_cudaCachingAllocator_raw_delete``)."""
    _private("_cuda_cudaCachingAllocator_raw_delete")(ptr)


# --- storages at recorded addresses: hand out replay outputs without copying -------------------
def _storage_at_missing(ptr: int, device: torch.device, nbytes: int) -> torch.UntypedStorage:
    return _private("_construct_storage_from_data_pointer")(ptr, device, nbytes)  # raises PrivateAPIMissing


storage_at: Callable[[int, torch.device, int], torch.UntypedStorage] = (
    getattr(torch._C, "_construct_storage_from_data_pointer", None) or _storage_at_missing
)
"""``storage_at(ptr, device, nbytes)``: a storage viewing ``nbytes`` at ``ptr`` that owns
nothing (``_construct_storage_from_data_pointer``). Replay outputs are built on these: the
memory belongs to the pool, not to the tensor."""


def meta_of(t: torch.Tensor) -> dict[str, Any]:
    """``t``'s layout in the form :data:`tensor_on` takes (size, stride, dtype, device, offset)."""
    return {
        "size": tuple(t.shape),
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }


def _tensor_on_slow(meta: dict[str, Any], storage: torch.UntypedStorage) -> torch.Tensor:
    t = torch.empty((0,), dtype=meta["dtype"], device=meta["device"])
    return t.set_(storage, meta["storage_offset"], meta["size"], meta["stride"])


tensor_on: Callable[[dict[str, Any], torch.UntypedStorage], torch.Tensor] = (
    getattr(torch._C, "_construct_CUDA_Tensor_From_Storage_And_Metadata", None) or _tensor_on_slow
)
"""``tensor_on(meta, storage)``: a CUDA tensor with ``meta``'s size, stride, dtype and storage
offset on ``storage``, built in C++ (``_construct_CUDA_Tensor_From_Storage_And_Metadata``,
several times faster than ``Tensor.set_``; the slow path is the fallback)."""


def graph_launcher(graph: torch.cuda.CUDAGraph) -> Callable[[], None]:
    """A zero-argument callable that replays ``graph``, skipping torch's Python wrapper.

    ``torch.cuda.CUDAGraph.replay`` is a Python method around the C++ one
    (``torch._C._CUDAGraph.replay``); on the replay path that hop is a measurable share.
    """
    base = getattr(torch._C, "_CUDAGraph", None)
    replay = getattr(base, "replay", None)
    if replay is None:  # pragma: no cover - other torch layouts
        return graph.replay
    return replay.__get__(graph)


# Weak references to storages, as bare ints: cheaper than a Python object on the replay path.
# An int is the StorageImpl pointer; it stays valid for the functions below while not expired.
weak_ref = cast(Callable[[torch.UntypedStorage], int], torch.UntypedStorage._weak_ref)
"""``weak_ref(storage)``: a weak reference (an int) that must be released with :func:`weak_free`."""
weak_expired = cast(Callable[[int], bool], torch.UntypedStorage._expired)
"""``weak_expired(ref)``: whether no tensor holds the storage any more."""
weak_free: Callable[[int], None] = torch.UntypedStorage._free_weak_ref
"""``weak_free(ref)``: release a weak reference."""
storage_use_count: Callable[[int], int] = torch._C._storage_Use_Count
"""``storage_use_count(ref)``: how many tensors and storage objects hold the storage of a weak
reference (0 once it died): what tells a replay output the caller dropped from one still held
while graphtree keeps a tensor on it itself."""


def storage_ref(s: torch.UntypedStorage) -> int:
    """The ``StorageImpl*`` of a storage object, as :func:`storage_use_count` takes it (equals a live
    :func:`weak_ref` of it)."""
    return cast(int, s._cdata)


def storage_id(t: torch.Tensor) -> int:
    """The ``StorageImpl*`` of a tensor's storage; equals a live :func:`weak_ref` of it."""
    return t.untyped_storage()._cdata


def invalidate_storage(cdata: int, message: str) -> None:
    """Make every later access to a storage raise ``RuntimeError(message)``.

    If the storage still owns its pool block (a recording or warm-up output, or one given a
    deleter by :func:`restore_pool`), the block goes back to the pool first
    (``_free_And_Remove_DeleterFn``); then the data pointer is swapped for one that raises
    (``_set_storage_data_ptr_access_error_msg``).
    """
    if _private("_has_Standard_Deleter")(cdata):
        _private("_free_And_Remove_DeleterFn")(cdata)
    _private("_set_storage_data_ptr_access_error_msg")(cdata, message)


def _ptrs_equal_py(tensors: list[torch.Tensor], ptrs: list[int], idx: list[int]) -> bool:
    return all(tensors[i].data_ptr() == ptrs[i] for i in idx)


def data_ptrs_checker() -> Callable[[list[torch.Tensor], list[int], list[int]], bool]:
    """``check(tensors, ptrs, idx)``: whether ``tensors[i].data_ptr() == ptrs[i]`` for i in idx.

    One C++ loop (``_tensors_data_ptrs_at_indices_equal``) where torch has it. Its arguments are
    Python lists converted on every call: for a module's hundred parameters that conversion, not
    the loop, is most of the cost (9-14 µs on the GPU machines' hosts). graphtree's own native
    helpers (``graphtree/_native``), once built, replace it on the replay path.
    """
    return getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None) or _ptrs_equal_py


def foreach_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copy ``srcs`` into ``dsts`` with one fused launch where torch can (``_foreach_copy_``)."""
    torch._foreach_copy_(list(dsts), list(srcs))


def copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New tensors equal to ``tensors``, in one call (``_foreach_mul`` by 1: exact, a few launches)."""
    return list(torch._foreach_mul(tensors, 1.0)) if tensors else []


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached workspaces (``_cuda_clearCublasWorkspaces``).

    Called before and after every warm-up and recording: a workspace first allocated inside the
    tree's pool would otherwise stay in use by cuBLAS while the pool's checkpoints treat its
    memory as free.
    """
    fn = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if fn is not None:
        fn()


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


def end_failed_capture(device: int, pool_id: tuple[int, int], began: bool = True) -> int:
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
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int] | None, device: int, decoy: torch.Generator | None
) -> bool:
    """Begin capturing into ``graph`` on the current stream, in thread-local mode; True when the
    device's default CUDA generator was kept out of it.

    With a ``decoy`` and graphtree's native CUDA part (torch before 2.12), the capture registers the
    decoy's state instead of the default generator's (``_native.capture_begin_isolated``), so that
    other threads' random ops are not disturbed while it runs; the capture's own random ops must
    then draw from the decoy (:func:`draw_from`). Otherwise torch's own ``capture_begin``.
    """
    from graphtree import _native  # loaded after this module, in the background

    begin = getattr(_native.loaded, "capture_begin_isolated", None)
    if decoy is None or begin is None:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")  # type: ignore[arg-type]  # (int, int)
        return False
    begin(graph, pool or (0, 0), decoy)
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


from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402


@contextlib.contextmanager
def no_dispatch_modes() -> Iterator[None]:
    """The operations inside bypass every active ``TorchDispatchMode`` (an eager part of a broken
    recording runs as plain eager code, unseen by the recorder's watches)."""
    with _disable_current_modes():
        yield


_strided = torch.strided
_UNSAFE_TAG = getattr(torch.Tag, "cudagraph_unsafe", None)
"""Operators tagged so read host state a graph would freeze (inductor's trees honour it too)."""


_SEEDED = getattr(torch.Tag, "nondeterministic_seeded", None)


class RandomOutsideCapture(RuntimeError):
    """A random operation that can only draw from the device's default generator, met in a capture
    that keeps that generator out (see :func:`draw_from`)."""


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


def draw_from(gen: torch.Generator, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run the random operation ``func`` with ``gen`` as its generator where it was given none.

    Operators without a generator argument take their overload that has one; dropout
    (``aten.dropout``, ``aten.native_dropout``) becomes its two steps, a Bernoulli mask drawn from
    ``gen`` and a scaled product. Others (scaled dot-product attention) run as they are: they draw
    only with dropout on, and then raise :class:`RandomOutsideCapture` naming the operator."""
    if func is _DROPOUT or func is _NATIVE_DROPOUT:
        x, p, train = (*args, *kwargs.values(), None)[:3]
        if train is False:
            return func(*args, **kwargs)
        # (torch's CUDA kernel draws even for p == 0: the mask is all ones then, drawn from nothing)
        if p == 0:
            mask = torch.ones_like(x, dtype=torch.bool)
        else:
            mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p, generator=gen)
        out = x * mask * (0.0 if p == 1 else 1.0 / (1.0 - p))
        return out if func is _DROPOUT else (out, mask)
    target = _generator_overload(func)
    if target is None:
        try:
            return func(*args, **kwargs)
        except RuntimeError as e:  # torch checks before it launches anything: the capture is intact
            if "not in capture mode" not in str(e):
                raise
            raise RandomOutsideCapture(
                f"{func.name()} draws random numbers from the device's default generator only, which "
                f"graphtree keeps out of its captures (so that other threads can draw from it meanwhile)"
            ) from None
    named = dict(zip((a.name for a in func._schema.arguments), args))
    named.update(kwargs)
    if named.get("generator") is None:
        named["generator"] = gen
    return target(**named)


_DROPOUT = torch.ops.aten.dropout.default
_NATIVE_DROPOUT = torch.ops.aten.native_dropout.default


def readable_storage(t: Any) -> torch.UntypedStorage | None:
    """``t.untyped_storage()`` where ``t`` is a dense tensor whose storage can be read, else ``None``:
    sparse, nested, meta and fake tensors, and outputs graphtree invalidated, are not touched."""
    if not isinstance(t, torch.Tensor) or t.layout is not _strided or t.is_nested or t.is_meta:
        return None
    try:
        st = t.untyped_storage()
        st.data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return st


def storage_ptr(st: torch.UntypedStorage) -> int:
    """``st.data_ptr()``, or 0 for a storage Python cannot read: a wrapper subclass's, such as the
    functional collectives' ``_wrap_tensor_autograd`` handles (found on the H100 under torch 2.11:
    dispatch modes that read every storage raised there)."""
    try:
        return int(st.data_ptr())
    except RuntimeError:
        return 0


class StateWatch(TorchDispatchMode):
    """While active, notes what the operations of a warm-up or capture do to memory.

    - ``written``: which of the ``watched`` storages (data_ptr -> leaf index) an operation
      writes to. Read from the operators' schemas (an argument whose alias info says it is
      written), so it works for inference tensors too, which keep no version counter.
    - ``made``: weak references (:func:`weak_ref`) to the storages the operations allocated
      (returned, and not one of those they were given: in-place and view results are not
      new), by address: :meth:`kept` says which are still alive after the call.
    - ``read`` (only with ``track_reads``): ``(weak ref, nbytes)`` of every CUDA storage an
      operation was given, by address: what a graph captured under this watch reads.

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
        self.generator: torch.Generator | None = None  # random ops draw from it, not the default one
        self._track_reads = track_reads

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _UNSAFE_TAG is not None and not self.unsafe and _UNSAFE_TAG in func.tags:
            self.unsafe = str(func.name())
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
        if self.generator is not None and _SEEDED in func.tags:
            out = draw_from(self.generator, func, args, kwargs)
        else:
            out = func(*args, **kwargs)
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

    def close(self) -> None:
        """Release every weak reference the watch holds."""
        for r in self.made.values():
            weak_free(r)
        for r, _ in self.read.values():
            weak_free(r)
        self.made.clear()
        self.read.clear()


def weak_data_ptr(ref: int) -> int:
    """The data address of a live storage known by its weak reference (0 if it died).

    (``UntypedStorage._new_with_weak_ptr``, as torch's cudagraph trees read theirs.)
    """
    if weak_expired(ref):
        return 0
    return torch.UntypedStorage._new_with_weak_ptr(ref).data_ptr()


@functools.cache
def raw_copier() -> Callable[[int, int, int, int], None] | None:
    """``copy(dst_ptr, src_ptr, nbytes, device)``: a device-to-device ``cudaMemcpyAsync`` on the
    device's current stream, or ``None`` where ``cuda.bindings`` is missing.

    For a contiguous input of the recorded shape this does what ``Tensor.copy_`` does, minus
    the dispatcher and TensorIterator set-up: on the replay path that is most of the cost of
    the copy. Stream order is the same as ``copy_``'s (the current stream). Resolved once, at
    the first recording that can use it, not at import. Once graphtree's native helpers are
    built, the same ``cudaMemcpyAsync`` of the runtime torch loaded is called from C++.
    """
    try:
        from cuda.bindings import runtime as cudart
    except Exception:  # noqa: BLE001 - absent or broken cuda-bindings: Tensor.copy_ does the copy
        return None
    memcpy = cudart.cudaMemcpyAsync
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    ok = cudart.cudaError_t.cudaSuccess
    current_stream = raw_stream_getter()
    if current_stream is None:
        return None

    from graphtree import _native

    def copy(dst: int, src: int, nbytes: int, device: int) -> None:
        native = _native.loaded  # the same call without cuda.bindings' argument conversions
        if native is not None and native.copy_d2d(dst, src, nbytes, current_stream(device)):
            return
        (err,) = memcpy(dst, src, nbytes, kind, current_stream(device))
        if err != ok:
            raise RuntimeError(f"graphtree: cudaMemcpyAsync of an input failed: {err}")

    return copy


def raw_stream_getter() -> Callable[[int], int] | None:
    """``get(device)``: the raw handle of torch's current stream on ``device``
    (``torch._C._cuda_getCurrentRawStream``), or ``None`` on a build without it (CPU builds).

    For hot paths that need the current stream on every call: 0.17 µs where
    ``torch.cuda.current_stream(device)`` took 3.1 µs (H100 host, torch 2.11, median of 5000).
    """
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)


# --- autograd's version counters, put back after a capture (tree/module_training.py) -------------
def set_versions(tensors: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
    """Set the autograd version counters of ``tensors`` to ``versions`` (``_unsafe_set_version_counter``)."""
    torch._C._autograd._unsafe_set_version_counter(tuple(tensors), tuple(versions))


# --- torch.compile, for the benchmark's compile contenders ---------------------------------------
def raise_dynamo_limits() -> None:
    """Let dynamo recompile for many shapes and silence cudagraph trees' many-shapes warning
    (``torch._dynamo.config``, ``torch._inductor.config``): the benchmark compiles on purpose."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    cfg = torch._dynamo.config
    for name, value in (
        ("recompile_limit", 64),
        ("cache_size_limit", 64),
        ("accumulated_recompile_limit", 1024),
        ("accumulated_cache_size_limit", 1024),
    ):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    triton = getattr(inductor_config, "triton", None)
    if triton is not None and hasattr(triton, "cudagraph_dynamic_shape_warn_limit"):
        triton.cudagraph_dynamic_shape_warn_limit = None


def inductor_cudagraph_skips() -> int:
    """How often inductor chose not to use CUDA graphs so far (``torch._dynamo.utils.counters``)."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["inductor"]["cudagraph_skips"])
    except Exception:  # noqa: BLE001 - a moved counter must not fail a benchmark
        return 0


def reset_compiled() -> None:
    """Forget every compiled function and inductor's cudagraph trees: the next benchmark case starts clean."""
    with contextlib.suppress(Exception):  # (best effort between benchmark cases)
        import torch._dynamo

        torch._dynamo.reset()
    with contextlib.suppress(Exception):
        from torch._inductor import cudagraph_trees

        cudagraph_trees.reset_cudagraph_trees()


def cudnn_compiled_version() -> int | None:
    """The cuDNN version torch was built with (``torch._C._cudnn.getCompileVersion``), or None."""
    try:
        major, minor, patch = torch._C._cudnn.getCompileVersion()
    except Exception:  # noqa: BLE001 - a build without cuDNN, or a moved API
        return None
    return major * 10000 + minor * 100 + patch


def torch_profiler_active() -> bool:
    """Whether a torch.profiler / Kineto session is running (``torch._C._autograd._profiler_enabled``)."""
    try:
        return bool(torch._C._autograd._profiler_enabled())
    except Exception:  # noqa: BLE001 - a moved private API means no profiler we can see
        return False


def global_module_hooks() -> bool:
    """Whether a global module hook is registered (``register_module_forward_hook`` and the like):
    it runs around every module's call, which a replay of a module does not make."""
    m = torch.nn.modules.module
    kinds = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
    return any(getattr(m, f"_global_{kind}", None) for kind in kinds)


# --- torch.distributed: the process groups of collectives, and the store ranks agree through ----


def resolve_process_group(name: str) -> Any:
    """The process group a functional collective names (``distributed_c10d._resolve_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    resolve = getattr(c10d, "_resolve_process_group", None)
    if resolve is None:
        raise PrivateAPIMissing(f"torch {torch.__version__} has no distributed_c10d._resolve_process_group")
    return resolve(name)


def grad_off_inside(fn: Any) -> bool:
    """Whether ``fn`` (a function, bound method or module) runs with autograd off whatever the
    caller's mode: wrapped by ``@torch.no_grad()`` or ``@torch.inference_mode()`` (the wrapper
    ``torch.utils._contextlib.context_decorator`` makes, its context in the closure cell ``ctx_factory``)."""
    if isinstance(fn, torch.nn.Module):
        fn = getattr(fn, "forward", None)
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    if code is None or code.co_name != "decorate_context":
        return False
    cells = dict(zip(code.co_freevars, getattr(fn, "__closure__", None) or ()))
    try:
        owner = getattr(cells["ctx_factory"].cell_contents, "__self__", None)
    except (KeyError, ValueError):
        return False
    if isinstance(owner, torch.inference_mode):
        return bool(getattr(owner, "mode", False))
    return isinstance(owner, torch.no_grad)


def default_store() -> Any:
    """The store ``init_process_group`` made (every rank of the job reaches it), or None."""
    from torch.distributed import distributed_c10d as c10d

    get = getattr(c10d, "_get_default_store", None)
    if get is None:
        raise PrivateAPIMissing(f"torch {torch.__version__} has no distributed_c10d._get_default_store")
    try:
        return get()
    except (RuntimeError, ValueError):  # no default process group
        return None
