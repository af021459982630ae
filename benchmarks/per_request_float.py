"""A serving loop's sampling step with a new Python ``temperature`` on every call (issue 45, item 3):
eager against graphtree, calls taken in turn, with how many of graphtree's calls replayed.

A float among the arguments is keyed by its value today, so each request is a new signature (after
the churn rule's warm-ups, plain eager). Item 3's acceptance: the loop at <= 1.0x eager with >= 90 %
of the calls replayed. Run on a GPU::

    python benchmarks/per_request_float.py [--calls 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import graphtree


def sample(logits: torch.Tensor, temperature: float, top_k_mask: torch.Tensor) -> torch.Tensor:
    """Greedy pick after temperature scaling and a top-k mask (deterministic: comparable bitwise)."""
    scaled = logits / temperature
    probs = torch.softmax(scaled.masked_fill(~top_k_mask, float("-inf")), dim=-1)
    return torch.argmax(probs, dim=-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(8, 32000, device="cuda")
    mask = logits > logits.kthvalue(32000 - 50, dim=-1, keepdim=True).values
    temperatures = [0.5 + i / (2 * a.calls) for i in range(a.calls)]
    graphed = graphtree.graphed(sample)
    eager_times: list[float] = []
    graphed_times: list[float] = []
    equal = True
    with torch.inference_mode():
        for t in temperatures:
            for fn, times in ((sample, eager_times), (graphed, graphed_times)):
                graphtree.mark_step()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = fn(logits, t, mask)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                if fn is sample:
                    want = out
                else:
                    equal = equal and torch.equal(out, want)
    s = graphtree.stats()
    row: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "calls": a.calls,
        "eager_total_ms": sum(eager_times) * 1e3,
        "graphtree_total_ms": sum(graphed_times) * 1e3,
        "ratio_total": sum(graphed_times) / sum(eager_times),
        "ratio_median": statistics.median(graphed_times) / statistics.median(eager_times),
        "replayed_fraction": s.replays / a.calls,
        "equal_to_eager": equal,
        "eager_reasons": dict(s.eager),
    }
    print(json.dumps(row, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
