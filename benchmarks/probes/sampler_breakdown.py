"""Where the five-operator sampler's graphed call loses to a graph of it written by hand (issue 45,
item 3: 1.22x eager against the hand graph's 0.75x, H200, twenty-third session), timed as
``per_request_float.py`` times it (synchronised around each call) and without a sync per call.

Each way runs the same recording or the same kind of graph, the ways taken in turn per call:

- ``eager``; ``graphtree`` as the benchmark calls it (``mark_step()`` before each call) and without
  ``mark_step()``; how many of its calls took the fast hit;
- the recording's own copy-in and launch, called directly (``InputPlan.copy_in``, ``Node._launch``):
  graphtree's device work without its call path;
- its launch alone; the hand graph of ``per_request_float.hand_graphs`` with the logits copied in.

Run on a GPU: ``python benchmarks/probes/sampler_breakdown.py [--calls 1000] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import graphtree
from graphtree import _native
from graphtree.bench.contenders import HandGraph
from graphtree.tree import manager

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "fakes"))
from gt_fast_hit import counting_fast_replays  # noqa: E402
from per_request_float import sample  # noqa: E402


def main() -> None:
    assert _native.wait(600) is not None, _native.status()  # (they load in the background)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(8, 32000, device="cuda")
    mask = logits > logits.kthvalue(32000 - 50, dim=-1, keepdim=True).values
    g = graphtree.graphed(sample, name="sample")
    with torch.inference_mode():
        for k in range(12):
            graphtree.mark_step()
            g(logits, 0.5 + k / 100, mask)
        node = manager.tree_for(torch.cuda.current_device()).hit
        assert node is not None, graphtree.stats()
        plan = node.inputs
        static_t = torch.ones((), device="cuda")
        hand = HandGraph(sample, logits, static_t, mask, warmup=3)
        _, hand_t, hand_mask = hand.inputs

        def marked(t: float) -> Any:
            graphtree.mark_step()
            return g(logits, t, mask)

        def by_hand(t: float) -> Any:
            hand_t.fill_(t)
            return hand(logits, hand_t, hand_mask)

        def copy_and_launch(t: float) -> None:
            plan.copy_in((logits, t, mask), 3)
            node._launch()

        ways = {
            "eager": lambda t: sample(logits, t, mask),
            "graphtree, mark_step each call": marked,
            "graphtree": lambda t: g(logits, t, mask),
            "its copy-in and launch": copy_and_launch,
            "its launch": lambda t: node._launch(),
            "hand graph, logits copied in": by_hand,
        }
        synced: dict[str, list[float]] = {w: [] for w in ways}
        host: dict[str, list[float]] = {w: [] for w in ways}
        with counting_fast_replays() as fast:
            for i in range(a.calls):
                t = 0.5 + i / (2 * a.calls)
                for w, fn in ways.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn(t)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    synced[w].append(time.perf_counter() - t0)
                    host[w].append(t1 - t0)
        eager = statistics.median(synced["eager"])
        rows = {
            w: {
                "synced_median_us": statistics.median(synced[w]) * 1e6,
                "ratio_to_eager": statistics.median(synced[w]) / eager,
                "host_median_us": statistics.median(host[w]) * 1e6,
            }
            for w in ways
        }
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls": a.calls,
        "graphtree_calls_fast": sum(fast),
        "graphtree_calls_counted": len(fast),
        "stats": str(graphtree.stats()),
        "ways": rows,
    }
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
