"""Microseconds of graphtree's own work per churning call (issue 45 item 6) on a machine without a GPU.

A graphed function that returns its argument is called with a new shape every time, past the point
where graphtree gives up on recording its new signatures (``churn.streak`` at its limit), so each
call takes the churn path: ``GraphedCallable.__call__`` → ``_run`` → ``_eager_now`` (the
signature, the never-met check, the tree's stream order) → ``_eager``. The native signature's
stand-in (``tests/fakes/gt_fast_hit.py``) reads the CPU tensors as the real one reads CUDA tensors,
the raw stream is ``abs``, and every other native helper is the real one. Prints the median over 9
runs of 3,000 calls. Compare two checkouts by running it with each first on ``PYTHONPATH``::

    PYTHONPATH=. python benchmarks/probes/churn_cpu_time.py
    (cd .before && PYTHONPATH=$PWD TORCH_EXTENSIONS_DIR=/tmp/ext_before python ../benchmarks/probes/churn_cpu_time.py)
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from typing import Any

import torch

import graphtree
from graphtree import _native
from graphtree.tree import graphed as graphed_mod
from graphtree.tree import manager as manager_mod
from graphtree.tree import placement

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fakes"))
from gt_fast_hit import stand_in_signature

CALLS, RUNS = 3000, 9


class _CpuSignature:
    """The built helpers, with the stand-in signature for CPU tensors."""

    signature = staticmethod(stand_in_signature)

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def main() -> None:
    real = _native.wait(600)
    if real is None:
        sys.exit(f"no native helpers: {_native.status()}")
    _native.loaded = _CpuSignature(real)  # type: ignore[assignment]
    graphed_mod._cuda_ok = True
    placement._current_stream = abs
    tree = manager_mod.tree_for(0)
    tree.order._raw_stream = abs
    tree.order._last_raw = 0
    warnings.simplefilter("ignore")  # (graphtree says once that the function churns)

    def same(t: torch.Tensor) -> torch.Tensor:
        return t

    g = graphtree.graphed(same)
    g.churn.streak = g.churn.limit  # (as after its warm-ups of new signatures in a row)
    base = torch.zeros(RUNS * CALLS + 1)
    xs = [base[: n + 1] for n in range(RUNS * CALLS)]  # a shape never met, every call (views of one base)
    runs = []
    with torch.no_grad():
        for r in range(RUNS):
            t0 = time.perf_counter()
            for x in xs[r * CALLS : (r + 1) * CALLS]:
                g(x)
            runs.append((time.perf_counter() - t0) / CALLS * 1e6)
    stats = graphtree.stats()
    assert stats.replays == 0 and stats.recordings == 0, stats  # every call took the churn path
    print(f"a churning call: graphtree's own work {statistics.median(runs):.2f} µs (median of {RUNS} runs of {CALLS})")


if __name__ == "__main__":
    main()
