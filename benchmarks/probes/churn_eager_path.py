"""Issue 45 item 6: what graphtree's eager path costs a churning call, against eager (per call, synced
and not), and where its time goes (cProfile)."""

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

N = 200
_native.wait(600)  # (they load in the background: time what a long-running process runs)
for host_read in (False, True):
    f = _mlp(host_read)
    xs = [torch.randn(1 + i, 256, device="cuda") for i in range(N)]
    with torch.inference_mode():
        for x in xs:
            f(x)
        torch.cuda.synchronize()
        graphtree.reset()
        g = graphtree.graphed(f)
        g.churn.streak = 10**6  # churning from the start: every new signature takes the eager path
        g(xs[0])

        def synced(fn, xs=xs):
            ts = []
            for x in xs:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                fn(x)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e6

        def unsynced(fn, xs=xs):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for x in xs:
                fn(x)
            cpu = (time.perf_counter() - t0) / N * 1e6
            torch.cuda.synchronize()
            return cpu, (time.perf_counter() - t0) / N * 1e6

        for rnd in range(2):
            graphtree.reset()
            g = graphtree.graphed(f)
            g.churn.streak = 10**6
            e_s, g_s = synced(f), synced(g)
            graphtree.reset()
            g = graphtree.graphed(f)
            g.churn.streak = 10**6
            e_u, g_u = unsynced(f), unsynced(g)
            print(
                f"host_read={host_read} round {rnd}: synced median eager {e_s:.1f} us, "
                f"graphtree {g_s:.1f} us ({g_s / e_s:.3f}x); "
                f"unsynced cpu/total eager {e_u[0]:.1f}/{e_u[1]:.1f}, graphtree {g_u[0]:.1f}/{g_u[1]:.1f} us"
            )
        print("   ", graphtree.stats())
        graphtree.reset()
        g = graphtree.graphed(f)
        g.churn.streak = 10**6
        pr = cProfile.Profile()
        pr.enable()
        for x in xs:
            g(x)
        torch.cuda.synchronize()
        pr.disable()
        out = io.StringIO()
        pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(14)
        print("\n".join(out.getvalue().splitlines()[:30]))
