"""Where a graphed call with a new Python float each time spends its host time (issue 45, item 3):
the five-operator sampler of ``per_request_float.py``, its host time per call without a sync
(eager, graphtree with a new temperature each call, graphtree with one temperature), then a
cProfile of graphtree's calls. Run on a GPU: ``python benchmarks/probes/sampler_profile.py``."""

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
from per_request_float import sample

N = 2000
_native.wait(600)  # (they load in the background: time what a long-running process runs)


def host_us(fn, temps):
    """Median host microseconds per call over 7 rounds of N calls, synced per round only."""
    out = []
    for _ in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for t in temps:
            fn(t)
        out.append((time.perf_counter() - t0) / len(temps) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(out)


torch.manual_seed(0)
logits = torch.randn(8, 32000, device="cuda")
mask = logits > logits.kthvalue(32000 - 50, dim=-1, keepdim=True).values
temps = [0.5 + i / (2 * N) for i in range(N)]
same = [0.7] * N
g = graphtree.graphed(sample, name="sample")
x = torch.randn(1024, device="cuda")
two = graphtree.graphed(lambda x: x * 2 + 1, name="two")
with torch.inference_mode():
    for t in temps[:8]:
        g(logits, t, mask)
        two(x)
    rows = {
        "eager, new temperature": host_us(lambda t: sample(logits, t, mask), temps),
        "graphtree, new temperature": host_us(lambda t: g(logits, t, mask), temps),
        "graphtree, one temperature": host_us(lambda t: g(logits, t, mask), same),
        "graphtree, x * 2 + 1": host_us(lambda t: two(x), same),
    }
    print(torch.cuda.get_device_name(), "torch", torch.__version__, graphtree.stats())
    for k, v in rows.items():
        print(f"{k:32} {v:8.2f} us (host, no sync per call)")
    cases = (("new temperature", lambda t: g(logits, t, mask), temps), ("x * 2 + 1", lambda t: two(x), same))
    for title, fn, ts in cases:
        prof = cProfile.Profile()
        prof.enable()
        for t in ts:
            fn(t)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        print(f"--- cProfile, {title}, {len(ts)} calls, by own time ---")
        print(s.getvalue()[-6000:])
