"""The five contenders, built the same way in every scenario, and the GPU helpers they share.

- ``eager`` -- the plain callable.
- ``handwritten`` -- :class:`HandGraph`: a ``torch.cuda.CUDAGraph`` captured by hand with static
  input buffers; each call copies the inputs in, replays, and returns the static outputs.
- ``compile-reduce-overhead`` -- ``torch.compile(fn, mode="reduce-overhead")`` (inductor kernels
  under cudagraph trees); ``torch.compiler.cudagraph_mark_step_begin()`` before every call.
- ``compile-cudagraphs`` -- ``torch.compile(fn, backend="cudagraphs")`` (aten ops under
  cudagraph trees, no inductor); ``cudagraph_mark_step_begin()`` before every call.
- ``graphtree`` -- ``graphtree.graphed(fn)``; ``graphtree.mark_step()`` before every call.

Every contender is used as documented: the per-iteration "new step" call of the compile
contenders and of graphtree is part of what is timed.

Example::

    call, setup = build(GRAPHTREE, model, (x,))
    y = call(x)
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtree import _torch

EAGER = "eager"
HANDWRITTEN = "handwritten"
COMPILE_RO = "compile-reduce-overhead"
COMPILE_CG = "compile-cudagraphs"
GRAPHTREE = "graphtree"
ALL_CONTENDERS: tuple[str, ...] = (EAGER, HANDWRITTEN, COMPILE_RO, COMPILE_CG, GRAPHTREE)
COMPILED: tuple[str, ...] = (COMPILE_RO, COMPILE_CG)


# --------------------------------------------------------------------------------------------
# the hand-written CUDA graph


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream() -> torch.cuda.Stream:
    """One warm-up side stream per device, shared by every :class:`HandGraph`."""
    dev = torch.cuda.current_device()
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream()
    return _SIDE[dev]


class HandGraph:
    """``fn(*args)`` captured once into a ``torch.cuda.CUDAGraph`` with static input buffers.

    ``clone_inputs=True`` (default) gives the graph its own input buffers, filled by a copy on
    every call; ``False`` captures the given tensors themselves (say the static output of
    another graph), and a call with those same tensors copies nothing. ``pool`` is handed to
    ``torch.cuda.graph``; ``None`` gives the graph a private pool of its own. ``warmup`` eager
    iterations run on a side stream before capture, as the PyTorch docs prescribe.

    Example::

        g = HandGraph(model, x)
        y = g(x_new)        # copy x_new into the static input, replay, return static output
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *example_args: torch.Tensor,
        pool: Any = None,
        warmup: int = 1,
        clone_inputs: bool = True,
    ) -> None:
        for a in example_args:
            if not isinstance(a, torch.Tensor):
                raise TypeError(f"HandGraph takes tensor arguments only, got {type(a).__name__}")
        self.inputs = [a.clone() if clone_inputs else a for a in example_args]
        side = _side_stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.output = fn(*self.inputs)

    def __call__(self, *args: torch.Tensor) -> Any:
        for static, a in zip(self.inputs, args):
            if a.data_ptr() != static.data_ptr():
                static.copy_(a)
        self.graph.replay()
        return self.output


# --------------------------------------------------------------------------------------------
# torch.compile and graphtree


def configure_dynamo() -> None:
    """Raise dynamo's recompile limits and silence the many-shapes warning of cudagraph trees.

    Example::

        configure_dynamo()
    """
    _torch.raise_dynamo_limits()


def compile_fn(name: str, fn: Callable[..., Any], dynamic: bool | None = None) -> Callable[..., Any]:
    """``torch.compile`` ``fn`` the way contender ``name`` does.

    Example::

        c = compile_fn(COMPILE_RO, model)
    """
    if name == COMPILE_RO:
        return torch.compile(fn, mode="reduce-overhead", dynamic=dynamic)
    if name == COMPILE_CG:
        return torch.compile(fn, backend="cudagraphs", dynamic=dynamic)
    raise ValueError(f"not a compile contender: {name}")


def step_begin(name: str) -> Callable[[], None] | None:
    """The "a new iteration begins" call contender ``name`` needs before each call, if any.

    Example::

        begin = step_begin(GRAPHTREE)   # graphtree.mark_step
    """
    if name in COMPILED:
        return torch.compiler.cudagraph_mark_step_begin
    if name == GRAPHTREE:
        import graphtree

        return graphtree.mark_step
    return None


def stepped(fn: Callable[..., Any], begin: Callable[[], None] | None) -> Callable[..., Any]:
    """``fn`` with ``begin()`` called before every call (``fn`` itself if ``begin`` is None).

    Example::

        call = stepped(graphed_model, graphtree.mark_step)
    """
    if begin is None:
        return fn

    def call(*args: Any) -> Any:
        begin()
        return fn(*args)

    return call


def cudagraph_skips() -> int:
    """How many times inductor decided not to use CUDA graphs so far (its own counter).

    Example::

        before = cudagraph_skips(); ...; skipped = cudagraph_skips() > before
    """
    return _torch.inductor_cudagraph_skips()


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``(fn(), seconds)`` with the device synchronized before and after.

    Example::

        out, seconds = timed(lambda: model(x))
    """
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def build(
    name: str, fn: Callable[..., Any], example_args: Sequence[torch.Tensor], record_calls: int = 3
) -> tuple[Callable[..., Any], dict[str, Any]]:
    """Contender ``name``'s version of ``fn`` for fixed-shape inputs like ``example_args``.

    Returns ``(call, setup)``: ``call(*args)`` runs one iteration (the step-begin call
    included) and ``setup`` holds ``{metric: seconds}`` of the set-up work -- ``capture_s`` for
    the hand-written graph (one side-stream warm-up run and the capture) and for graphtree (its
    first two calls: the eager warm-up and the recording), ``compile_s`` for the compile
    contenders (the first call: tracing, compiling and the eager warm-up of cudagraph trees) --
    and a ``note``. Every graphed contender gets ``record_calls`` calls in all, so its graph is
    recorded before any timing; mind that set-up calls run ``fn`` (and its side effects).

    Example::

        call, setup = build(COMPILE_RO, model, (x,))
        setup["compile_s"]
    """
    args = tuple(example_args)
    setup: dict[str, Any] = {"note": ""}
    if name == EAGER:
        return fn, setup
    if name == HANDWRITTEN:
        g, setup["capture_s"] = timed(lambda: HandGraph(fn, *args))
        return g, setup
    if name in COMPILED:
        skips = cudagraph_skips()
        call = stepped(compile_fn(name, fn, dynamic=False), step_begin(name))
        _, setup["compile_s"] = timed(lambda: call(*args))
        for _ in range(max(record_calls - 1, 0)):
            call(*args)
        torch.cuda.synchronize()
        if cudagraph_skips() > skips:
            setup["note"] = "inductor skipped CUDA graphs for this function"
        return call, setup
    if name == GRAPHTREE:
        import graphtree

        call = stepped(graphtree.graphed(fn), graphtree.mark_step)
        # the first call warms up (eagerly, in the pool), the second records
        _, setup["capture_s"] = timed(lambda: [call(*args) for _ in range(2)])
        for _ in range(max(record_calls - 2, 0)):
            call(*args)
        torch.cuda.synchronize()
        setup["note"] = graphtree_note()
        return call, setup
    raise ValueError(f"unknown contender {name!r}")


def graphtree_note() -> str:
    """Why graphtree ran calls eagerly so far (from ``graphtree.stats().eager``), or ``""``.

    Example::

        graphtree_note()   # 'graphtree ran eagerly: autograd x2'
    """
    import graphtree

    eager = graphtree.stats().eager
    if not eager:
        return ""
    return "graphtree ran eagerly: " + ", ".join(f"{k} x{v}" for k, v in sorted(eager.items()))


# --------------------------------------------------------------------------------------------
# memory and clean-up


def settle() -> None:
    """Synchronize, collect garbage and release the allocator's unused cached blocks.

    Example::

        settle(); before = torch.cuda.memory_reserved()
    """
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()


def clear_cublas_workspaces() -> None:
    """Drop cuBLAS's cached per-stream workspaces (as cudagraph trees and graphtree do).

    Example::

        clear_cublas_workspaces()
    """
    _torch.clear_cublas_workspaces()


def reserved_bytes() -> int:
    """``torch.cuda.memory_reserved()`` once only memory something holds is left reserved.

    Synchronizes, drops cuBLAS's cached workspaces (a workspace allocated inside a graph's
    private pool stays reserved with that pool; those in the default pool are released),
    collects garbage and empties the allocator's cache, then reads.

    Example::

        base = reserved_bytes(); graphs = make(); held = reserved_bytes() - base
    """
    torch.cuda.synchronize()
    clear_cublas_workspaces()
    settle()
    return int(torch.cuda.memory_reserved())


def private_pool_bytes() -> int | None:
    """Bytes of allocator segments in private pools (CUDA graph pools, ``MemPool``\\ s).

    Read from ``torch.cuda.memory_snapshot()`` (segments whose ``segment_pool_id`` is not the
    default pool's ``(0, 0)``); ``None`` if the snapshot is not available.

    Example::

        private_pool_bytes()
    """
    try:
        segments = torch.cuda.memory_snapshot()
    except Exception:  # noqa: BLE001
        return None
    total = 0
    for seg in segments:
        pool = tuple(seg.get("segment_pool_id", (0, 0)) or (0, 0))
        if pool != (0, 0):
            total += int(seg.get("total_size", 0))
    return total


def reset_all() -> None:
    """Forget every recording: graphtree's trees, dynamo's caches and cudagraph trees; settle.

    Example::

        reset_all()
    """
    try:
        import graphtree

        graphtree.reset()
    except Exception:  # noqa: BLE001 - clean-up must not fail the run
        pass
    _torch.reset_compiled()
    settle()


# --------------------------------------------------------------------------------------------
# correctness


def _flatten(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _flatten(item)]
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _flatten(x[k])]
    return []


def snapshot(out: Any) -> list[torch.Tensor]:
    """Clones of the tensors in ``out`` (graph outputs are overwritten by the next replay).

    Example::

        ref = snapshot(model(x))
    """
    return [t.detach().clone() for t in _flatten(out)]


def compare(out: Any, ref: Sequence[torch.Tensor], rtol: float, atol: float) -> dict[str, Any]:
    """Whether ``out`` equals the reference tensors: ``{"equal", "bitwise", "max_abs_diff"}``.

    ``equal`` is ``torch.allclose(rtol, atol)`` on every tensor (and same shapes and dtypes);
    ``bitwise`` is ``torch.equal``.

    Example::

        compare(graphed(x), snapshot(model(x)), rtol=1e-4, atol=1e-5)["equal"]
    """
    got = _flatten(out)
    if len(got) != len(ref):
        return {
            "equal": False,
            "bitwise": False,
            "max_abs_diff": None,
            "why": f"{len(got)} output tensors, eager has {len(ref)}",
        }
    equal = bitwise = True
    worst = 0.0
    for g, r in zip(got, ref):
        if g.shape != r.shape or g.dtype != r.dtype:
            return {
                "equal": False,
                "bitwise": False,
                "max_abs_diff": None,
                "why": f"shape/dtype {tuple(g.shape)}/{g.dtype} vs {tuple(r.shape)}/{r.dtype}",
            }
        g = g.to(r.device)
        bitwise = bitwise and torch.equal(g, r)
        if g.is_floating_point():
            equal = equal and torch.allclose(g, r, rtol=rtol, atol=atol)
            if g.numel():
                worst = max(worst, float((g.double() - r.double()).abs().max()))
        else:
            equal = equal and torch.equal(g, r)
            if g.numel():
                worst = max(worst, float((g.long() - r.long()).abs().max()))
    return {"equal": bool(equal), "bitwise": bool(bitwise), "max_abs_diff": worst}
