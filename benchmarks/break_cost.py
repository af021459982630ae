"""What a break costs (issue 26): a function that reads a bool on the host between its kernels,
graphed with breaks on, against the same kernels without the read and against eager.

Per call, CPU-synchronised wall time (the host read waits for the GPU anyway): ``k`` reads split
the call into ``k + 1`` graph segments, each replay launching them with a read between each. Also
the capture time of each recording (``Node.capture_seconds``) and the tree's pool bytes. Run on a
GPU, one process, contenders interleaved::

    python benchmarks/break_cost.py [--reads 1 4] [--calls 500] [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

import graphtree
from graphtree import _native
from graphtree.bench.timing import wall_per_call
from graphtree.tree import manager


def _fn(reads: int, read: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    def f(x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(reads):
            y = y * 2 + 1
            total = y.sum()  # the same kernels either way; only the read differs
            if not read or total > 0:  # (with read: a bool read on the host, a break)
                y = y - 1
        return y * 2

    return f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--calls", type=int, default=500)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    _native.wait(600)
    x = torch.rand(4096, device="cuda")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    for k in a.reads:
        graphtree.reset()
        with_reads, without = _fn(k, True), _fn(k, False)
        g_reads = graphtree.graphed(with_reads, max_break_values=8, name=f"{k} reads")
        g_plain = graphtree.graphed(without, name="no reads")
        fns = {
            "eager, with the reads": lambda f=with_reads: f(x),
            "graphtree, with the reads (breaks)": lambda g=g_reads: (graphtree.mark_step(), g(x)),
            "graphtree, same kernels, no read": lambda g=g_plain: (graphtree.mark_step(), g(x)),
        }
        for f in fns.values():  # warm up, record, replay
            for _ in range(4):
                f()
        torch.testing.assert_close(g_reads(x), with_reads(x))
        samples: dict[str, list[float]] = {n: [] for n in fns}
        for r in range(a.repeats):
            for n in list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]:
                samples[n].append(wall_per_call(fns[n], a.calls, sync=torch.cuda.synchronize))
        nodes = [n for m in manager.managers() for n in m.nodes()]
        capture = {n.name: round(n.capture_seconds * 1e3, 2) for n in nodes}
        s = graphtree.stats()
        rows = {n: statistics.median(v) * 1e6 for n, v in samples.items()}
        out["rows"][f"{k} reads"] = {"us_per_call": rows, "capture_ms": capture, "pool_bytes": s.pool_bytes}
        print(f"{k} read(s) ({k + 1} segments): " + " | ".join(f"{n} {v:.1f} us" for n, v in rows.items()))
        extra = rows["graphtree, with the reads (breaks)"] - rows["graphtree, same kernels, no read"]
        print(f"  per break on replay: {extra / k:.1f} us; capture ms {capture}; {s}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
