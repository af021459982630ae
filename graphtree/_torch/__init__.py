"""The one package of graphtree that touches torch private APIs.

Everything here is version-gated: graphtree is tested against torch 2.11 to 2.13. Each
wrapper says what it is for. A private function that is missing raises
:class:`PrivateAPIMissing` naming it and the torch version, so a torch upgrade fails loudly
at the exact feature that broke instead of corrupting memory.

The CUDA-only functions (``torch._C._cuda_*`` and friends) are absent from CPU builds; they
are looked up lazily, at first use, never at import.

Its parts, whose names are all importable from here: ``gate.py`` (the version gate and the helpers
every part shares), ``capture.py`` (what graphtree does to torch while it warms up and captures a
call: pool routing, capture begin and clean-up, random generators, the watching dispatch mode), and
this module (the rest).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch

# --- pytrees: flatten the arguments and outputs of a call -------------------------------------
from torch.utils import _pytree

from graphtree._torch.gate import (  # noqa: F401 - re-exported: the version gate and shared helpers
    _UNSAFE_TAG,
    TESTED_TORCH,
    TORCH_VERSION,
    VERSION_SUPPORTED,
    PrivateAPIMissing,
    _private,
    _strided,
    generator_key,
    has_private,
    storage_ptr,
    storage_use_count,
    tensor_impl,
    weak_expired,
    weak_free,
    weak_ref,
)

tree_flatten = _pytree.tree_flatten
tree_unflatten = _pytree.tree_unflatten
pytree_nodes: dict[type, Any] = _pytree.SUPPORTED_NODES
"""The types pytrees flatten (live: registrations made later are in it); any other type is a leaf,
but namedtuples, which pytrees flatten implicitly."""


def _whole_size(x: Any) -> bool:
    return type(x) is torch.Size


def flatten_outputs(tree: Any) -> tuple[list[Any], Any]:
    """:func:`tree_flatten` of what a function returned, each ``torch.Size`` one leaf: torch registers
    ``torch.Size`` as a pytree node whose unflatten makes a plain ``tuple`` (torch.fx's proxy_tensor),
    so outputs rebuilt from their leaves would change type (``torch.broadcast_shapes``). A Size holds
    ints only: as a leaf it is returned as it was."""
    return _pytree.tree_flatten(tree, is_leaf=_whole_size)


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

CONJ, NEG = 1, 2
"""The bits :func:`lazy_bits` returns."""


def lazy_bits(t: torch.Tensor) -> int:
    """``t``'s conjugate (:data:`CONJ`) and negative (:data:`NEG`) bits: a view made by ``torch.conj``
    (or ``.imag`` of one) reads its memory conjugated (negated). A tensor rebuilt on the memory
    (:data:`tensor_on`, ``as_strided`` of another view) does not carry them."""
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


def flip_bits(t: torch.Tensor, bits: int) -> torch.Tensor:
    """A view of ``t`` with the bits set in ``bits`` flipped (``torch._neg_view``, ``Tensor.conj``): no copy."""
    if bits & NEG:
        t = torch._neg_view(t)
    if bits & CONJ:
        t = t.conj()
    return t


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


def graph_exec(graph: torch.cuda.CUDAGraph) -> int:
    """The ``cudaGraphExec_t`` a replay of ``graph`` launches, as an int (``raw_cuda_graph_exec``),
    or 0 where torch has no such method or the graph is not instantiated (a stand-in in tests).

    Valid while ``graph`` lives and is not reset: whoever launches it holds the graph."""
    raw = getattr(graph, "raw_cuda_graph_exec", None)
    if raw is None:
        return 0
    try:
        return int(raw())
    except RuntimeError:  # (not captured, or kept un-instantiated: keep_graph=True)
        return 0


# Weak references to storages, as bare ints: cheaper than a Python object on the replay path.
# An int is the StorageImpl pointer; it stays valid for the functions below while not expired.
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


from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402


@contextlib.contextmanager
def no_dispatch_modes() -> Iterator[None]:
    """The operations inside bypass every active ``TorchDispatchMode`` (an eager part of a broken
    recording runs as plain eager code, unseen by the recorder's watches)."""
    with _disable_current_modes():
        yield


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


def weak_data_ptr(ref: int) -> int:
    """The data address of a live storage known by its weak reference (0 if it died).

    (``UntypedStorage._new_with_weak_ptr``, as torch's cudagraph trees read theirs.)
    """
    if weak_expired(ref):
        return 0
    return torch.UntypedStorage._new_with_weak_ptr(ref).data_ptr()


@functools.cache
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


def dynamo_traces() -> int:
    """How many frames dynamo has traced in this process so far (``counters["frames"]["total"]``),
    plus the graphs it compiled (``counters["stats"]["unique_graphs"]``, should either counter
    move): each trace reads and sets the generators' states and may sync, whether or not a graph
    comes of it (a frame skipped, a recompile that hit its limit). 0 while ``torch._dynamo`` is not
    imported (not imported here: a program that never compiles must not pay for it)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    try:
        return int(utils.counters["frames"]["total"]) + int(utils.counters["stats"]["unique_graphs"])
    except Exception:  # noqa: BLE001 - a moved counter: no compile seen
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


def switch_getter(name: str) -> Callable[[], Any]:
    """``torch._C.<name>``: the getter of a global switch that decides which kernels a call runs
    (determinism, cuDNN, TF32, the SDPA backends: ``tree/ambient.py`` keys calls by them), or a getter
    of False where this torch has no such switch (it then runs as with the switch off)."""
    return getattr(torch._C, name, None) or (lambda: False)


float32_matmul_precision = cast(Callable[[], str], torch._C._get_float32_matmul_precision)
"""``torch.get_float32_matmul_precision()`` without its Python frame: "highest", "high" or "medium"
(raises under torch's ``fp32_precision`` API, as the public one does)."""
cublas_fp16_reduction = torch._C._get_cublas_allow_fp16_reduced_precision_reduction
"""cuBLAS's fp16 reduced-precision reduction: a bool, or ``(allow_reduced, allow_splitk)`` (torch 2.12 on)."""
cublas_bf16_reduction = torch._C._get_cublas_allow_bf16_reduced_precision_reduction
"""The same for bf16."""
preferred_blas = torch._C._get_blas_preferred_backend
"""The preferred BLAS backend (``torch.backends.cuda.preferred_blas_library()`` without its frame),
an enum whose ``int`` is its value."""


def gpu_spin(cycles: int) -> None:
    """Queue a kernel on the current stream that spins for ``cycles`` GPU clock cycles
    (``torch.cuda._sleep``, torch's own test helper): benchmarks keep the GPU busy with it while the
    host queues the work they time."""
    torch.cuda._sleep(cycles)


_HOOK_KINDS = ("forward_hooks", "forward_pre_hooks", "backward_hooks", "backward_pre_hooks")
GLOBAL_MODULE_HOOKS: tuple[dict[int, Any], ...] = tuple(
    getattr(torch.nn.modules.module, f"_global_{kind}", {None: "a torch without this dict: always there"})
    for kind in _HOOK_KINDS
)
"""torch's global module hooks (``register_module_forward_hook`` and the like), the dicts themselves:
torch adds to and removes from them in place and never binds new ones (2.11-2.13), so that
``any(GLOBAL_MODULE_HOOKS)`` asks, with no Python frame, what ``nn.Module._call_impl`` asks (on a
torch without one of them it is always true: every module call goes through ``nn.Module.__call__``)."""

jit_tracing = torch._C._get_tracing_state
"""The ``torch.jit.trace`` under way, or None (``nn.Module._call_impl`` calls ``_slow_forward`` then)."""


def global_module_hooks() -> bool:
    """Whether a global module hook is registered (``register_module_forward_hook`` and the like):
    it runs around every module's call, which a replay of a module does not make."""
    m = torch.nn.modules.module
    return any(getattr(m, f"_global_{kind}", None) for kind in _HOOK_KINDS)


def hook_handle_class() -> type:
    """The class whose ``next_id`` :func:`hook_handles_made` reads (the native fast replay reads it)."""
    return torch.utils.hooks.RemovableHandle


def hook_handles_made() -> int:
    """How many hook handles torch has made in this process (``RemovableHandle.next_id``: every
    ``register_*_hook`` makes one), or -1 where torch does not count them: a number that moved
    says a hook may have been registered since."""
    count = getattr(torch.utils.hooks.RemovableHandle, "next_id", None)
    return count if isinstance(count, int) else -1


# --- torch.distributed: the process groups of collectives, and the store ranks agree through ----


def resolve_process_group(name: str) -> Any:
    """The process group a functional collective names (``distributed_c10d._resolve_process_group``)."""
    from torch.distributed import distributed_c10d as c10d

    resolve = getattr(c10d, "_resolve_process_group", None)
    if resolve is None:
        raise PrivateAPIMissing(f"torch {torch.__version__} has no distributed_c10d._resolve_process_group")
    return resolve(name)


def ddp_timed_iterations(ddp: Any) -> int | None:
    """How many of its first iterations a ``DistributedDataParallel`` model has timed with CUDA
    events (its logger's ``iteration``, from ``_get_ddp_logging_data``: it counts up to 10, then
    stays), or None where this torch does not say."""
    get = getattr(ddp, "_get_ddp_logging_data", None)
    try:
        n = get().get("iteration") if get is not None else None
    except RuntimeError:  # (a model whose reducer is gone)
        return None
    return n if isinstance(n, int) else None


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


from graphtree._torch.capture import (  # noqa: E402, F401 - re-exported; it imports the helpers above
    EagerDispatchMode,
    RandomOutsideCapture,
    StateWatch,
    begin_allocate_to_pool,
    begin_capture,
    capture_empty,
    draw_from,
    end_allocate_to_pool,
    end_failed_capture,
    end_open_capture,
    generator_of,
    note_torch_call,
    stream_capturing,
)
