"""What handing a graph eager's random numbers costs per replay, without graphtree's call around it.

Four launchers of the same three kernels (a mul, a uniform draw or a fill, an add), timed in one
process, interleaved, CPU microseconds per launch (median of the repeats):

- ``torch, no draw`` / ``torch, draw``: a graph captured with ``torch.cuda.graph`` and its
  ``replay()``; with a draw, torch's replay prologue launches two ``fill_`` kernels first.
- ``graphtree, no draw`` / ``graphtree, draw``: captured as graphtree's recordings are, with the
  generator kept out (``tree/draws.py``), replayed through ``draws.launcher``: plain, or
  ``_native.launch_drawing`` (the generator's seed and offset written with ``cuStreamWriteValue64``).

    python benchmarks/random_replay.py [--launches 5000] [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from graphtree import _native, _torch
from graphtree.tree import draws


def with_draw(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + torch.rand_like(x)


def without_draw(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + torch.ones_like(x)


def _torch_graph(fn, x):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(x)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(x)
    return g.replay


def _graphtree_graph(fn, x):
    g, watch, s = torch.cuda.CUDAGraph(), _torch.StateWatch({}), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        draws.Draws(0).begin(g, torch.cuda.graph_pool_handle(), watch)
        with watch:
            fn(x)
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    draws.replay(g)  # the first replay learns what it draws
    return draws.launcher(g), g


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("random_replay needs a CUDA GPU")
        return 2
    helpers = _native.wait(900)
    x = torch.randn(1024, device="cuda")
    keep = []
    rows = {"torch, no draw": _torch_graph(without_draw, x), "torch, draw": _torch_graph(with_draw, x)}
    for name, fn in (("graphtree, no draw", without_draw), ("graphtree, draw", with_draw)):
        launch, g = _graphtree_graph(fn, x)
        rows[name] = launch
        keep.append(g)
    times: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(a.repeats):
        for name, launch in rows.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(a.launches):
                launch()
            times[name].append((time.perf_counter() - t0) / a.launches * 1e6)
            torch.cuda.synchronize()
    res = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "writes": helpers.drawing_writes() if hasattr(helpers, "drawing_writes") else "n/a",
        "cpu_us": {k: statistics.median(v) for k, v in times.items()},
    }
    c = res["cpu_us"]
    res["draw_us_torch"] = c["torch, draw"] - c["torch, no draw"]
    res["draw_us_graphtree"] = c["graphtree, draw"] - c["graphtree, no draw"]
    print(f"{res['device']}, torch {res['torch']}, writes: {res['writes']}, median of {a.repeats} x {a.launches}")
    for k, v in c.items():
        print(f"{k:24} {v:8.2f} us/launch (CPU)")
    print(f"a draw costs torch's replay {res['draw_us_torch']:.2f} us, graphtree's {res['draw_us_graphtree']:.2f} us")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
