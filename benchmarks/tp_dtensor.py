"""A decoder parallelised with ``torch.distributed.tensor.parallel`` (issue 48, item 2): each decode
step eager, graphed by graphtree and captured by hand, on every GPU of the machine under torchrun.

The model: token embedding, ``--layers`` residual MLP blocks whose up-projection is
``ColwiseParallel`` and down-projection ``RowwiseParallel`` (DTensor parameters; each block ends in
an all-reduce), a final norm and a replicated LM head; greedy decoding of ``--tokens`` tokens at
batch 1. Parameters are DTensors: graphtree either records their dispatch or runs the step eagerly
with a reason that names it, which the output reports. Rank 0 prints one JSON row per contender::

    torchrun --nproc-per-node 4 benchmarks/tp_dtensor.py [--layers 8] [--d-model 1024] [--tokens 64]
        [--json out.json]

``--device cpu`` runs eager and graphtree over gloo (a dry run: graphtree runs CPU calls eagerly).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _torchrun import compare_to_eager, report, run_contenders, start, with_graphtree_stats
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import graphtree
from graphtree.bench.contenders import HandGraph


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        x = self.embed(token)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)).argmax(-1)  # the next token, greedy


def build(args: argparse.Namespace, device: torch.device, mesh: Any) -> Decoder:
    torch.manual_seed(0)  # the same weights on every rank before sharding
    model = Decoder(args.vocab, args.d_model, args.layers).to(device).eval()
    plan = {f"blocks.{i}.up": ColwiseParallel() for i in range(args.layers)}
    plan.update({f"blocks.{i}.down": RowwiseParallel() for i in range(args.layers)})
    return parallelize_module(model, mesh, plan)


def run(name: str, args: argparse.Namespace, device: torch.device, mesh: Any) -> dict[str, Any]:
    model = build(args, device, mesh)
    step: Any = model
    start = torch.tensor([[1]], device=device)
    if name == "graphtree":
        step = graphtree.graphed(model)
    elif name == "hand":
        step = HandGraph(model, start, warmup=3)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    tokens, times = [], []
    with torch.inference_mode():
        token = start
        for _ in range(args.tokens):
            sync()
            t = time.perf_counter()
            token = step(token).clone()
            sync()
            times.append(time.perf_counter() - t)
            tokens.append(int(token.item()))
    row: dict[str, Any] = {"contender": name, "ms_per_token": statistics.median(times[3:]) * 1e3, "tokens": tokens}
    return with_graphtree_stats(row, name, args.tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--contenders", default="eager,graphtree,hand")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rank, world, device = start(args.device)
    mesh = init_device_mesh(device.type, (world,))
    rows = run_contenders(args.contenders.split(","), lambda name: run(name, args, device, mesh), device)
    compare_to_eager(rows, "tokens", "ms_per_token")
    head = {"layers": args.layers, "d_model": args.d_model, "tokens": args.tokens}
    report(rows, head, device, world, rank, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
