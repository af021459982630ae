"""A training step, graphed whole by graphtree, against what a user would otherwise run (issue 28).

One process, on a GPU; every contender trains its own copy of the model with
``AdamW(capturable=True)``:

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
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import graphtree

DEV = "cuda"


class _GPTLoss(nn.Module):
    """The demo GPT whose forward is its training loss (what make_graphed_callables graphs)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(tokens)


def _workload(name: str) -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], Callable[[int], Any]]:
    """The model, its loss on a batch, and the i-th batch."""
    gen = torch.Generator(DEV).manual_seed(0)
    torch.manual_seed(0)
    if name.startswith("resnet18"):
        import timm

        batch = int(name.split("-")[1])
        model = timm.create_model("resnet18", num_classes=100)
        data = [
            (
                torch.randn(batch, 3, 224, 224, device=DEV, generator=gen),
                torch.randint(0, 100, (batch,), device=DEV, generator=gen),
            )
            for _ in range(4)
        ]

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            return F.cross_entropy(m(b[0]), b[1])

    elif name == "gpt":
        from graphtree.demo.gpt import GPTConfig, TinyGPT

        model = _GPTLoss(TinyGPT(GPTConfig(n_layer=4, n_head=4, d_model=256, vocab=2048, max_seq=128), batch=1))
        data = [(torch.randint(0, 2048, (8, 128), device=DEV, generator=gen),) for _ in range(4)]

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            return m(b[0])

    elif name == "mlp":
        model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)), nn.Linear(256, 10))
        data = [
            (torch.randn(32, 256, device=DEV, generator=gen), torch.randint(0, 10, (32,), device=DEV, generator=gen))
            for _ in range(4)
        ]

        def loss(m: nn.Module, b: Any) -> torch.Tensor:
            return F.cross_entropy(m(b[0]), b[1])

    else:
        raise SystemExit(f"unknown workload {name!r}")
    return model.to(DEV).train(), loss, lambda i: data[i % len(data)]


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)


def _plain_step(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    def step(*batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, batch)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def _hand(model: nn.Module, opt: torch.optim.Optimizer, loss_fn: Callable, first: Any) -> Callable[..., torch.Tensor]:
    static = [t.clone() for t in first]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            loss_fn(model, static).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = loss_fn(model, static)
        static_loss.backward()
        opt.step()

    def step(*batch: torch.Tensor) -> torch.Tensor:
        for s, b in zip(static, batch):
            s.copy_(b)
        graph.replay()
        return static_loss.detach()

    return step


def _contender(name: str, model: nn.Module, loss_fn: Callable, first: Any) -> Callable[..., torch.Tensor]:
    opt = _adamw(model)
    if name == "eager":
        return _plain_step(model, opt, loss_fn)
    if name == "graphtree":
        return graphtree.graphed(_plain_step(model, opt, loss_fn), name="train_step")
    if name == "hand":
        return _hand(model, opt, loss_fn, first)
    if name == "make_graphed_callables":
        graphed_model = torch.cuda.make_graphed_callables(model, (first[0],))
        return _plain_step(graphed_model, opt, loss_fn)
    if name == "reduce-overhead":
        compiled = torch.compile(model, mode="reduce-overhead")

        def step(*batch: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(compiled, batch)
            loss.backward()
            opt.step()
            return loss.detach().clone()

        return step
    raise SystemExit(f"unknown contender {name!r}")


def run(workload: str, contenders: list[str], steps: int, rounds: int) -> dict[str, Any]:
    base, loss_fn, batch = _workload(workload)
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
            step = _contender(name, model, loss_fn, batch(0))
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
