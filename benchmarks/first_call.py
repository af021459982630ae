"""What a fresh process pays before its first replay: import torch, CUDA, import graphtree,
graphed(), each call until the first replay, one line per stage, in seconds
(time the whole process from outside to see its start and exit).

    python benchmarks/first_call.py            # stages
    python benchmarks/first_call.py --profile  # and cProfile's top entries of the graphtree part
"""

from __future__ import annotations

import sys
import time

t0 = time.perf_counter()
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


import torch  # noqa: E402

mark("import torch")
torch.zeros(1, device="cuda")
mark("CUDA context")
import graphtree  # noqa: E402

mark("import graphtree")
profile = None
if "--profile" in sys.argv:
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
f = graphtree.graphed(lambda x: x * 2, name="f")
mark("graphed()")
x = torch.zeros(1, device="cuda")
for i in range(f.warmup + 2):
    f(x)
    torch.cuda.synchronize()
    mark(f"call {i + 1}")
if profile is not None:
    profile.disable()
last = t0
for name, t in marks:
    print(f"{t - last:7.3f} s  {name}")
    last = t
print(f"{last - t0:7.3f} s  in all, {graphtree.stats().replays} replay(s)", flush=True)
if profile is not None:
    import pstats

    pstats.Stats(profile).sort_stats("cumulative").print_stats(25)
