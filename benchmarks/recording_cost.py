"""What keeping each node's Python stack while recording costs (issue 29, ``graphtree/tree/sites.py``).

Records the demo GPT's decode step (12 layers, d_model 768) in a fresh process, with and without
the bookkeeping (``GRAPHTREE_NO_SITES=1``), several times each, and prints the capture time of each
recording (``Node.capture_seconds``) and the medians. Run on a GPU::

    python benchmarks/recording_cost.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

CHILD = """
import torch, graphtree
from graphtree.demo.gpt import GPTConfig, TinyGPT, greedy_decode
from graphtree.tree import manager
model = TinyGPT(GPTConfig(max_seq=64), batch=1, device="cuda")
step = graphtree.graphed(model.decode_step)
with torch.inference_mode():  # (with autograd on, the step runs eagerly: nothing is recorded)
    greedy_decode(step, model, torch.zeros(1, 1, dtype=torch.long, device="cuda"), 3, before_step=graphtree.mark_step)
nodes = [n for m in manager.managers() for n in m.nodes()]
sites = sum(len(s) for n in nodes for _, s in n.graph_sites)
print("CAPTURE", max(n.capture_seconds for n in nodes), sites)
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    for label, extra in (("with sites", {}), ("without (GRAPHTREE_NO_SITES=1)", {"GRAPHTREE_NO_SITES": "1"})):
        times, sites = [], 0
        for _ in range(a.runs):
            out = subprocess.run(
                [sys.executable, "-c", CHILD], capture_output=True, text=True, env={**os.environ, **extra}, check=True
            ).stdout
            line = next(ln for ln in out.splitlines() if ln.startswith("CAPTURE"))
            t, n = line.split()[1:]
            times.append(float(t))
            sites = int(n)
        print(f"{label}: capture {statistics.median(times) * 1e3:.1f} ms (median of {a.runs}), {sites} sites kept")


if __name__ == "__main__":
    main()
