"""What ``graphed(fn, debug=dir)`` costs per call: the inputs copied to pinned host memory before
every call (graphtree.debug.snapshot), against the same graphed function without it.

    python benchmarks/debug_snapshot.py [--calls 2000] [--repeats 7]

Prints one JSON object: per input set, the median wall time per call (µs) with and without
``debug=``, and the GPU time per call of the snapshot copies. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

import graphtree


def _per_call(f, inputs, calls: int) -> float:
    for _ in range(20):
        f(*inputs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        f(*inputs)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def add_all(*xs):
    out = xs[0] * 2
    for x in xs[1:]:
        out = out + x
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args()
    sets = {
        "1 x 4 KiB": [torch.randn(1024, device="cuda")],
        "8 x 4 KiB": [torch.randn(1024, device="cuda") for _ in range(8)],
        "1 x 16 MiB": [torch.randn(4 << 20, device="cuda")],
    }
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sets": {}}
    with tempfile.TemporaryDirectory() as folder:
        for label, inputs in sets.items():
            plain = graphtree.graphed(add_all, name="plain")
            debug = graphtree.graphed(add_all, name="debug", debug=folder)
            rows = {"plain": [], "debug": []}
            for _ in range(a.repeats):
                for name, f in (("plain", plain), ("debug", debug)):
                    graphtree.reset()
                    rows[name].append(_per_call(f, inputs, a.calls))
            plain_us, debug_us = statistics.median(rows["plain"]), statistics.median(rows["debug"])
            result["sets"][label] = {
                "plain_us": round(plain_us, 2),
                "debug_us": round(debug_us, 2),
                "cost_us": round(debug_us - plain_us, 2),
                "bytes": sum(x.numel() * x.element_size() for x in inputs),
            }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
