"""Where the microseconds of one graphtree replay go: each piece of the fast path timed alone.

Run on a GPU: ``python benchmarks/fastpath_breakdown.py``. Prints median microseconds per call of
each piece, then a cProfile of the whole call (sorted by own time).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time

import torch
from per_call import HundredParameters, _raw_copier  # benchmarks/ is on sys.path when this script runs

import graphtree
from graphtree import _native, _torch
from graphtree.tree import fast_hit as _fast_hit
from graphtree.tree import inputs as _inputs
from graphtree.tree import manager as _manager
from graphtree.tree import object_state as _object_state
from graphtree.tree import readable as _readable
from graphtree.tree import state_epoch as _state_epoch
from graphtree.tree.node import statics_packed


def _us(fn, n=3000, reps=7):
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def _raw_memcpy(dst: torch.Tensor, src: torch.Tensor):
    """graphtree's input copier (``cudaMemcpyAsync`` through ``cuda.bindings``) of ``src`` into ``dst``."""
    copy = _raw_copier()
    return lambda: copy(dst.data_ptr(), src.data_ptr(), src.numel() * 4, 0)


def _memcpy_variants(dst: torch.Tensor, src: torch.Tensor) -> dict:
    """Ways to enqueue one device-to-device copy from Python, for comparison."""
    import ctypes

    out = {}
    n = src.numel() * src.element_size()
    raw_stream = torch._C._cuda_getCurrentRawStream
    try:
        from cuda.bindings import driver

        out["cuda.bindings driver cuMemcpyDtoDAsync"] = lambda: driver.cuMemcpyDtoDAsync(
            dst.data_ptr(), src.data_ptr(), n, raw_stream(0)
        )
    except Exception as e:  # noqa: BLE001
        print("no cuda.bindings driver:", e)
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuMemcpyDtoDAsync_v2
        fn.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        out["ctypes libcuda cuMemcpyDtoDAsync_v2"] = lambda: fn(dst.data_ptr(), src.data_ptr(), n, raw_stream(0))
    except Exception as e:  # noqa: BLE001
        print("no ctypes libcuda:", e)
    return out


_data_ptr = torch.Tensor.data_ptr


def _module_rows(x: torch.Tensor) -> dict:
    """The module path in pieces: the nn.Module call, the training flag, the address check."""
    gm = graphtree.graphed(HundredParameters().cuda())
    gc = gm.graphed_callable
    for _ in range(4):
        gm(x)
    statics = gc.static_tensors()
    ptrs = [t.data_ptr() for t in statics]
    idx = list(range(len(statics)))
    check = _torch.data_ptrs_checker()
    packed = statics_packed(statics)
    ident = torch.nn.Identity()
    native = _native.loaded
    return {
        "module: gm(x)": lambda: gm(x),
        "module: graphed callable(x)": lambda: gc(x),
        "module: nn.Identity()(x)": lambda: ident(x),
        "module: check 100 addresses (torch's C++)": lambda: check(statics, ptrs, idx),
        **({"module: check 100 (native)": lambda: native.ptrs_equal(statics, ptrs, idx)} if native else {}),
        # (as a replay checks them, packed as Node packs them)
        **(
            {"module: check 100 (native, packed)": lambda: native.addresses_unchanged(statics, packed)}
            if native
            else {}
        ),
        "module: check 100, list(map(data_ptr))": lambda: list(map(_data_ptr, statics)) == ptrs,
        "module: static_tensors()": gc.static_tensors,
        "module: param_epoch()": _state_epoch.param_epoch,
    }


def main() -> None:
    native = _native.wait(600)
    x = torch.randn(1024, device="cuda")
    sx = x.clone()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        sx * 2 + 1
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = sx * 2 + 1
    step = graphtree.graphed(lambda x: x * 2 + 1, name="two")
    for _ in range(4):
        step(x)
    ptr, nbytes, dev = out.data_ptr(), out.untyped_storage().nbytes(), out.device
    meta = {
        "size": tuple(out.shape),
        "stride": out.stride(),
        "dtype": out.dtype,
        "device": out.device,
        "storage_offset": 0,
    }
    st = _torch.storage_at(ptr, dev, nbytes)
    kept = [None]
    tree_lock = _manager.tree_for(0).lock
    rows = {
        "x.copy_(y)": lambda: sx.copy_(x),
        "graph.replay()": g.replay,
        "storage_at": lambda: _torch.storage_at(ptr, dev, nbytes),
        "tensor_on": lambda: _torch.tensor_on(meta, st),
        "weak_ref + free": lambda: _torch.weak_free(_torch.weak_ref(st)),
        "read_call": lambda: _inputs.read_call((x,), {}, None),
        **({"native signature((x,))": lambda: native.signature((x,), _readable.PLAIN_TYPES)} if native else {}),
        "is_grad_enabled": torch.is_grad_enabled,
        "tree_for": lambda: _manager.tree_for(0),
        "graphtree copier (cudaMemcpyAsync)": _raw_memcpy(sx, x),
        "graphtree call, output kept": lambda: kept.__setitem__(0, step(x)),
        "base.detach()": out.detach,
        "graphtree call": lambda: step(x),
        "fast_hit.entry(step, hits, (x,))": lambda: _fast_hit.entry(step, step.fast_hits, (x,)),
        **({"native ambient()": native.ambient} if native else {}),
        "tree.lock acquire + release": lambda: (tree_lock.acquire(), tree_lock.release()),
        "raw copy + replay": lambda: (sx.copy_(x), g.replay()),
        "graph replay binding (_CUDAGraph.replay)": _torch.graph_launcher(g),
    }
    launch = getattr(native, "graph_launch", None)  # (issue 47: the fast hit's own launch, and detach)
    if launch is not None:
        exec_, stream_of = _torch.graph_exec(g), _torch.raw_stream_getter()
        rows["native graph_launch(exec)"] = lambda: launch(exec_, 0, stream_of(0))
        rows["native detach(base)"] = lambda: native.detach(out)
    # The replay path in layers, each including the ones above it: the differences are each
    # layer's own cost.
    tree = _manager.tree_for(0)
    node = tree.walk.current
    call = _inputs.read_call((x,), {}, None)
    rows.update(
        {
            "key parts (shape, dtype, stride)": lambda: (x.shape, x.dtype, x.stride()),
            "x.get_device() + requires_grad": lambda: (x.get_device(), x.requires_grad),
            "Call(...)": lambda: _inputs.Call((x,), None, (), 0, False, -1, -1, (), 1),
            "HeldTensors()": _object_state.HeldTensors,
            "flatten((x,), {})": lambda: _inputs.flatten((x,), {}),
            "tensor via set_": lambda: torch.empty(0, device=dev).set_(st, 0, meta["size"], meta["stride"]),
            "layer 1: node.replay": lambda: node.replay((x,), -1),
            "layer 2: tree.call (new step)": lambda: tree.call(step, call),
            "layer 3: manager.run": lambda: _manager.run(step, call, 0),
            "layer 4: read_call + run": lambda: _manager.run(step, _inputs.read_call((x,), {}, None), 0),
            "layer 5: step(x)": lambda: step(x),
        }
    )
    rows.update(_memcpy_variants(sx, x))
    rows.update(_module_rows(x))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; native helpers {_native.status()}")
    print("fast tensor ctor:", _torch.tensor_on is not _torch._tensor_on_slow)
    for k, fn in rows.items():
        try:  # (a row whose internal API moved says so; the others still print)
            print(f"{k:34} {_us(fn):8.2f} us")
        except Exception as e:  # noqa: BLE001
            print(f"{k:34} failed: {type(e).__name__}: {e}")
    _print_profile(lambda: step(x), "--- the plain function ---")
    gm = graphtree.graphed(HundredParameters().cuda())
    _print_profile(lambda: gm(x), "--- the 100-parameter module ---")


def _print_profile(call, title: str, n: int = 5000) -> None:
    """cProfile of ``n`` calls, sorted by own time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        call()
    prof.disable()
    torch.cuda.synchronize()
    print(title)
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    with torch.no_grad():  # inference, as people run it; per_call.py does the same
        main()
