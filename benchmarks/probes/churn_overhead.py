"""What graphtree's eager path adds to a churning call on the GPU's host (issue 45, item 6: +37 µs
a call on the H200, where its own Python looked like ~10 µs on a CPU): host µs per call, no sync,
of a callable doing nothing (``x[:1]``) and of the 20-layer MLP of ``benchmarks/churn.py``, each
plain and graphed, a new shape every call and the callable churning from the start; and the
Python functions one graphed call runs (how many, and in which graphtree modules).

Run on a GPU: ``python benchmarks/probes/churn_overhead.py``.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from typing import Any

import torch

import graphtree
from graphtree import _native

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from churn import _mlp  # noqa: E402


def per_call_us(fn: Any, xs: list[torch.Tensor], reps: int = 5) -> float:
    """Median over ``reps`` rounds of the mean host µs per call of ``fn(x)`` for each x (no sync)."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in xs:
            graphtree.mark_step()
            fn(x)
        out.append((time.perf_counter() - t0) / len(xs) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(out)


def python_calls(fn: Any, x: torch.Tensor) -> collections.Counter[str]:
    """The Python functions ``fn(x)`` calls, counted by module."""
    seen: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen[frame.f_code.co_filename.rsplit("/", 2)[-2:][-1]] += 1

    sys.setprofile(profile)
    try:
        fn(x)
    finally:
        sys.setprofile(None)
    return seen


def main() -> None:
    assert _native.wait(600) is not None, _native.status()
    base = torch.randn(40, 40, 256, device="cuda")
    views = [base[:a, :b] for a in range(1, 41) for b in range(1, 41)]  # 1,600 shapes, no new memory
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, f in (("x[:1]", lambda x: x[:1]), ("20-layer MLP", _mlp(False))):
        with torch.inference_mode():
            for x in views:
                f(x)
            graphtree.reset()
            g = graphtree.graphed(f, name=name)
            g.churn.streak = 10**6  # churning from the start: every new signature runs eagerly
            rows = []
            for k in range(3):  # new shapes for graphtree each round (a shape met again is warmed up)
                xs = views[k * 500 : (k + 1) * 500]
                rows.append((per_call_us(f, xs, reps=1), per_call_us(g, xs, reps=1)))
            eager = statistics.median(r[0] for r in rows)
            graphed = statistics.median(r[1] for r in rows)
            calls = python_calls(g, views[1599])
        print(f"{name:14} eager {eager:8.2f} µs  graphtree {graphed:8.2f} µs  +{graphed - eager:6.2f} µs a call")
        print("   Python calls in one graphed call, by file:", dict(calls.most_common()), "|", graphtree.stats())


if __name__ == "__main__":
    main()
