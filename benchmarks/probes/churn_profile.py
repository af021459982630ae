"""Where a churning graphed call's time goes (issue 45, item 6): eager vs graphtree per phase."""

import cProfile
import io
import pstats
import statistics
import sys
import time

import torch

import graphtree
from graphtree import _native

sys.path.insert(0, "benchmarks")
from churn import _mlp

N = int(sys.argv[1]) if len(sys.argv) > 1 else 120
_native.wait(600)  # (they load in the background: time what a long-running process runs)
for host_read in (False, True):
    f = _mlp(host_read)
    xs = [torch.randn(1 + i, 256, device="cuda") for i in range(N + 1)]
    xs2 = [torch.randn(1 + i, 256, device="cuda") for i in range(N + 1)]
    with torch.inference_mode():
        for x in xs2:  # cuBLAS's heuristics for every shape, once, for both sides
            f(x)
        torch.cuda.synchronize()

        def per_call(fn):
            ts = []
            for i in range(N):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(i)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return ts

        e = per_call(lambda i, f=f, xs=xs: f(xs[i]))
        graphtree.reset()
        g = graphtree.graphed(f)
        gt = per_call(lambda i, g=g, xs=xs: (graphtree.mark_step(), g(xs[i])))
        s = graphtree.stats()
        print(
            f"host_read={host_read}: eager median {statistics.median(e) * 1e3:.3f} ms total {sum(e) * 1e3:.1f} ms; "
            f"graphtree median {statistics.median(gt) * 1e3:.3f} total {sum(gt) * 1e3:.1f} "
            f"ratio {sum(gt) / sum(e):.3f}; "
            f"first 20 graphtree/eager: {[round(a / b, 2) for a, b in zip(gt[:20], e[:20])]}"
        )
        print("   ", s)
        # profiled (as run in call 3: the sizes alternate with ones met before, so these calls warm up:
        # what it shows is the warm-ups' cost, per dispatch-mode handler)
        pr = cProfile.Profile()
        pr.enable()
        for i in range(N):
            graphtree.mark_step()
            g(xs2[i] if i % 2 else xs[i])
        torch.cuda.synchronize()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(18)
        print("\n".join(out.getvalue().splitlines()[:40]))
