"""Where a churning call's extra time goes (issue 45, item 6: the 20-layer MLP of ``churn.py`` runs
~10 % slower through graphtree's eager path, synced and paired per call, though that path costs a
no-op 7 µs on the H200): the MLP's own time measured *inside* the function, called plain and
through graphtree, beside the whole call's; and the ambient state the function sees in each case
(modes on the stacks, grad and inference mode, the sync debug mode, the current stream, whether
the garbage collector ran). Run on a GPU: ``python benchmarks/probes/churn_inside.py``.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

import graphtree
from graphtree import _native

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from churn import _mlp  # noqa: E402

N = 300


def main() -> None:
    assert _native.wait(600) is not None, _native.status()
    net_call = _mlp(False)
    inside: list[float] = []
    seen: list[Any] = []
    collections = [0]
    gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))

    def f(x: torch.Tensor) -> torch.Tensor:
        seen.append(
            (
                torch._C._len_torch_function_stack(),
                len(_get_current_dispatch_mode_stack()),
                torch.is_grad_enabled(),
                torch.is_inference_mode_enabled(),
                torch.cuda.get_sync_debug_mode(),
                torch.cuda.current_stream().cuda_stream,
            )
        )
        t0 = time.perf_counter()
        y = net_call(x)
        inside.append(time.perf_counter() - t0)
        return y

    g = graphtree.graphed(f, name="mlp")
    xs = [torch.randn(1 + i, 256, device="cuda") for i in range(N + 1)]
    rows: dict[str, dict[str, list[float]]] = {w: {"call": [], "inside": [], "gc": []} for w in ("eager", "graphtree")}
    with torch.inference_mode():
        for x in xs:
            net_call(x)
        graphtree.reset()
        for i in range(N):
            pair = [("eager", f), ("graphtree", g)]
            for w, fn in pair if i % 2 == 0 else pair[::-1]:
                before = collections[0]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if w == "graphtree":
                    graphtree.mark_step()
                fn(xs[i])
                torch.cuda.synchronize()
                rows[w]["call"].append(time.perf_counter() - t0)
                rows[w]["inside"].append(inside[-1])
                rows[w]["gc"].append(collections[0] - before)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, graphtree.stats())
    steady = slice(20, None)  # past graphtree's 8 warm-ups
    for w, r in rows.items():
        call, ins = statistics.median(r["call"][steady]) * 1e6, statistics.median(r["inside"][steady]) * 1e6
        gcs = sum(r["gc"][steady])
        print(f"{w:10} call {call:8.1f} µs   the MLP inside {ins:8.1f} µs   collections {sum(r['gc'])}, {gcs} past 20")
    pairs = list(zip(rows["eager"]["inside"][steady], rows["graphtree"]["inside"][steady]))
    print("inside, median of the calls' own ratios:", round(statistics.median(b / a for a, b in pairs), 3))
    print("state seen (eager, then graphtree's last):", seen[40], seen[-1] if len(seen) > 1 else None)
    print("distinct states seen:", sorted({repr(s) for s in seen}))
    noop = graphtree.graphed(lambda x: x, name="no-op")
    views = [torch.empty(1 + i, 3, device="cuda") for i in range(2 * N)]
    with torch.inference_mode():
        for x in views[:20]:
            noop(x)  # (its warm-ups: churning from then on)
        after_sync, loop = [], []
        for x in views[20:N]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            graphtree.mark_step()
            noop(x)
            after_sync.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for x in views[N:]:
            graphtree.mark_step()
            noop(x)
        loop.append((time.perf_counter() - t0) / N)
    print(
        "graphtree's eager path alone (a no-op churning):",
        f"{statistics.median(after_sync) * 1e6:.1f} µs right after a sync, {loop[0] * 1e6:.1f} µs a call in a loop",
    )


if __name__ == "__main__":
    main()
