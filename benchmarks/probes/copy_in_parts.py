"""What each part of the sampler's replay costs the host (issue 45, item 3): the five-operator
sampler of ``per_request_float.py`` graphed, and the pieces of its copy-in called alone, each timed
without a sync (mean of N calls) and with a sync around each call (median), as
``sampler_breakdown.py`` found graphtree's copy-in at 25 us of host time after a sync (H200).

Pieces: the native ``copy_in`` with its two device-to-device copies and its one
``cuStreamWriteValue64`` (the temperature), with the copies only, with the write only; a
``fill_`` of a device scalar (a kernel, as a hand-written graph fills it); an 8-byte
``cuMemcpyHtoDAsync`` from pageable memory (staged by the driver). Then the graphed sampler with the
temperature as a float and as a 0-dim CUDA tensor, the graphtree modules one call stops in, and a
cProfile of its calls. Run on a GPU: ``python benchmarks/probes/copy_in_parts.py``.
"""

from __future__ import annotations

import cProfile
import ctypes
import io
import json
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch

import graphtree
from graphtree import _native
from graphtree.tree import manager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fakes"))
from gt_fast_hit import module_stops  # noqa: E402
from per_request_float import sample  # noqa: E402

N = 2000


def timed(fn: Any) -> dict[str, float]:
    """Host µs per call: the mean of N calls in a row, and the median of N calls each between syncs."""
    with torch.inference_mode():
        for i in range(20):
            fn(0.5 + i / 100)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(N):
            fn(0.5 + i / (2 * N))
        loop = (time.perf_counter() - t0) / N
        torch.cuda.synchronize()
        host, synced = [], []
        for i in range(N):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(0.5 + i / (2 * N))
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            host.append(t1 - t0)
            synced.append(time.perf_counter() - t0)
    return {
        "loop_us": loop * 1e6,
        "host_after_sync_us": statistics.median(host) * 1e6,
        "synced_us": statistics.median(synced) * 1e6,
    }


def main() -> None:
    assert _native.wait(600) is not None, _native.status()  # (they load in the background)
    torch.manual_seed(0)
    logits = torch.randn(8, 32000, device="cuda")
    mask = logits > logits.kthvalue(32000 - 50, dim=-1, keepdim=True).values
    dev = torch.cuda.current_device()
    g = graphtree.graphed(sample, name="sample")
    with torch.inference_mode():
        for k in range(12):
            graphtree.mark_step()
            g(logits, 0.5 + k / 100, mask)
    node = manager.tree_for(dev).hit
    assert node is not None
    fills, copies, writes = node.inputs._native
    native = _native.loaded
    stream = torch.cuda.current_stream().cuda_stream
    launch = node._launch
    scalar = torch.ones((), device="cuda")
    ways: dict[str, Any] = {
        "copy_in: 2 copies + 1 write": lambda t: native.copy_in(stream, (logits, t, mask), copies, writes),
        "copy_in: 2 copies": lambda t: native.copy_in(stream, (logits, t, mask), copies, ()),
        "copy_in: 1 write": lambda t: native.copy_in(stream, (logits, t, mask), (), writes),
        "fill_ of a device scalar": scalar.fill_,
        "launch": lambda t: launch(),
        "copy_in (all) + launch": lambda t: (native.copy_in(stream, (logits, t, mask), copies, writes), launch()),
        "copy_in (2 copies) + fill_ + launch": lambda t: (
            native.copy_in(stream, (logits, t, mask), copies, ()),
            scalar.fill_(t),
            launch(),
        ),
    }
    try:
        from cuda.bindings import driver

        host_value = ctypes.c_double(0.0)
        dst, cu_stream = driver.CUdeviceptr(scalar.data_ptr()), driver.CUstream(stream)

        def h2d(t: float) -> None:
            host_value.value = t
            (err,) = driver.cuMemcpyHtoDAsync(dst, ctypes.addressof(host_value), 8, cu_stream)
            assert err == driver.CUresult.CUDA_SUCCESS, err

        ways["cuMemcpyHtoDAsync 8 B, pageable (cuda.bindings)"] = h2d
    except ImportError as e:
        print("no cuda.bindings:", e)

    def marked(t: float) -> Any:
        graphtree.mark_step()
        return g(logits, t, mask)

    g_dev = graphtree.graphed(sample, name="sample, device temperature")
    t_dev = torch.ones((), device="cuda")

    def marked_dev(t: float) -> Any:
        graphtree.mark_step()
        return g_dev(logits, t_dev, mask)

    ways["graphtree, mark_step, float temperature"] = marked
    ways["graphtree, mark_step, 0-dim CUDA temperature"] = marked_dev
    ways["eager"] = lambda t: sample(logits, t, mask)
    rows: dict[str, Any] = {}
    for w, fn in ways.items():
        try:
            rows[w] = timed(fn)
        except (RuntimeError, AssertionError, TypeError) as e:  # (one way failing leaves the others' figures)
            rows[w] = f"{type(e).__name__}: {e}"
    with torch.inference_mode():
        stops, returns = module_stops(lambda: marked(0.61))
    prof = cProfile.Profile()
    with torch.inference_mode():
        prof.enable()
        for i in range(500):
            marked(0.5 + i / 1000)
        prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "native": _native.status(),
        "plan": {"fills": len(fills), "copies": len(copies) // 3, "writes": len(writes) // 2},
        "stats": str(graphtree.stats()),
        "stops": stops,
        "returns": returns,
        "ways": rows,
    }
    print(json.dumps(out, indent=1))
    print(s.getvalue()[-5000:])


if __name__ == "__main__":
    main()
