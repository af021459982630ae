"""A training step, graphed whole by graphtree, against what a user would otherwise run (issue 28).

One process, on a GPU, contenders one after another (``graphtree bench --scenarios train`` runs the
same models and contenders interleaved, from :mod:`graphtree.bench.train`); every contender trains
its own copy of the model with ``AdamW(capturable=True)``:

- ``eager``: the step as written (``zero_grad``, forward, ``backward()``, ``step()``);
- ``graphtree``: ``graphtree.graphed(step)``, the same function, recorded whole;
- ``hand``: the whole step captured by hand (PyTorch's "whole network capture": warm-up on a side
  stream, ``zero_grad(set_to_none=True)``, forward, backward and step in ``torch.cuda.graph``);
- ``make_graphed_callables``: the model's forward and backward graphed, the optimizer eager;
- ``reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``, the optimizer eager.

For each: the median time per step (rounds of back-to-back steps, synchronised), the time of its
first three steps (warm-ups and captures included), the memory reserved on top of the model,
and, for graphtree, the largest relative difference of its losses from eager's, step by step::

    python benchmarks/train_step.py [--workloads resnet18-8,resnet18-64,gpt,mlp] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from typing import Any

import torch

import graphtree
from graphtree.bench import train
from graphtree.bench.contenders import COMPILE_RO, HANDWRITTEN

NAMES = {"hand": HANDWRITTEN, "reduce-overhead": COMPILE_RO}  # this script's names for the bench's contenders


def run(workload: str, contenders: list[str], steps: int, rounds: int) -> dict[str, Any]:
    base, loss_fn, data = train.workload(workload)

    def batch(i: int) -> Any:
        return data[i % len(data)]

    rows: dict[str, Any] = {}
    ref_losses: list[float] = []
    for name in contenders:
        graphtree.reset()
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        model = copy.deepcopy(base)
        reserved0 = torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        try:
            step = train.make_step(NAMES.get(name, name), model, loss_fn, batch(0))
            losses = [step(*batch(i)).item() for i in range(3)]
        except Exception as e:  # noqa: BLE001 - a contender that fails is a row that says why
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{workload:12} {name:24} failed: {rows[name]['error']}", flush=True)
            continue
        first_s = time.perf_counter() - t0
        losses += [step(*batch(i)).item() for i in range(3, steps)]
        times = []
        for _ in range(rounds):
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i in range(steps):
                step(*batch(i))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) / steps)
        row: dict[str, Any] = {
            "ms_per_step": statistics.median(times) * 1e3,
            "ms_per_step_rounds": [round(t * 1e3, 4) for t in times],
            "first_three_steps_s": first_s,
            "reserved_mb": (torch.cuda.memory_reserved() - reserved0) / 2**20,
        }
        if name == "eager":
            ref_losses = losses
        elif name == "graphtree" and ref_losses:
            row["worst_rel_loss_diff"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            row["stats"] = str(graphtree.stats())
        rows[name] = row
        print(
            f"{workload:12} {name:24} {row['ms_per_step']:8.3f} ms/step  first 3 steps {first_s:6.2f} s  "
            f"+{row['reserved_mb']:7.1f} MB"
            + (f"  worst loss diff {d:.1e}" if (d := row.get("worst_rel_loss_diff")) else ""),
            flush=True,
        )
        del step, model
    eager = rows.get("eager", {}).get("ms_per_step")
    if eager:
        for row in rows.values():
            if "ms_per_step" in row:
                row["speedup_vs_eager"] = eager / row["ms_per_step"]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workloads", default="mlp,gpt,resnet18-8,resnet18-64")
    ap.add_argument("--contenders", default="eager,graphtree,hand,make_graphed_callables,reduce-overhead")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    out = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "results": {w: run(w, args.contenders.split(","), args.steps, args.rounds) for w in args.workloads.split(",")},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
