"""The ``tp`` scenario: a decoder parallelised with ``torch.distributed.tensor.parallel`` (issue 48,
item 2), each decode step eager, graphed by graphtree and captured by hand, on every GPU of the
machine under torchrun (``benchmarks/tp_dtensor.py`` is its script).

The model: token embedding, residual MLP blocks whose up-projection is ``ColwiseParallel`` and
down-projection ``RowwiseParallel`` (DTensor parameters; each block ends in an all-reduce), a final
norm and a replicated LM head; greedy decoding at batch 1. Parameters are DTensors: graphtree
either records their dispatch or runs the step eagerly with a reason that names it, which the rows
report. Launch::

    torchrun --nproc-per-node 4 -m graphtree bench --scenarios ddp,tp
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

import graphtree
from graphtree.bench.contenders import HANDWRITTEN, HandGraph
from graphtree.bench.harness import Result
from graphtree.bench.ranks import compare_to_eager, not_applicable, results_of, run_contenders, with_graphtree_stats

if TYPE_CHECKING:
    from graphtree.bench.kit import Ctx

SCENARIO = "tp"
APPLICABLE = ("eager", "graphtree", HANDWRITTEN)


@dataclass
class DecodeArgs:
    """The decoder's size and the tokens decoded."""

    layers: int = 8
    d_model: int = 1024
    vocab: int = 32000
    tokens: int = 64


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


def build(args: DecodeArgs, device: torch.device, mesh: Any) -> nn.Module:
    """The decoder, the same weights on every rank, its blocks' projections parallelised over ``mesh``."""
    torch.manual_seed(0)  # the same weights on every rank before sharding
    model = Decoder(args.vocab, args.d_model, args.layers).to(device).eval()
    plan: dict[str, ParallelStyle] = {f"blocks.{i}.up": ColwiseParallel() for i in range(args.layers)}
    plan.update({f"blocks.{i}.down": RowwiseParallel() for i in range(args.layers)})
    return parallelize_module(model, mesh, plan)


def run(name: str, args: DecodeArgs, device: torch.device, mesh: Any) -> dict[str, Any]:
    """Contender ``name``'s row: ``args.tokens`` greedy tokens, its median time per token (past the
    first three) and the tokens."""
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


def decode_rows(names: list[str], args: DecodeArgs, device: torch.device, world: int) -> list[dict[str, Any]]:
    """Every rank's rows: each contender in turn (``hand`` for the capture by hand), tokens compared
    with eager's."""
    mesh = init_device_mesh(device.type, (world,))
    rows = run_contenders(names, lambda name: run(name, args, device, mesh), device)
    compare_to_eager(rows, "tokens", "ms_per_token")
    return rows


def decode_args(quick: bool) -> DecodeArgs:
    """8 layers of d1024, 64 tokens (quick: 2 layers of d256, 16 tokens)."""
    return DecodeArgs(layers=2, d_model=256, tokens=16) if quick else DecodeArgs()


def run_tp(ctx: Ctx) -> list[Result]:
    """The scenario's rows (every rank runs it; rank 0's rows are written)."""
    from graphtree.bench.ranks import start

    _rank, world, device = start("cuda" if torch.cuda.is_available() else "cpu")
    args = decode_args(ctx.cfg.quick)
    names = ["hand" if n == HANDWRITTEN else n for n in ctx.cfg.contenders if n in APPLICABLE]
    results = [not_applicable(SCENARIO, n, "time_per_token") for n in ctx.cfg.contenders if n not in APPLICABLE]
    rows = decode_rows(names, args, device, world)
    case = f"{args.layers} layers of d{args.d_model}, {world} rank(s)"
    results += results_of(rows, SCENARIO, case, "time_per_token", "ms_per_token", "tokens")
    ctx.log(f"tp: {case}: " + ", ".join(f"{r['contender']} {r.get('ms_per_token')}" for r in rows))
    return results
