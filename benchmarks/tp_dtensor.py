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
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import graphtree


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


Step = Callable[[torch.Tensor], torch.Tensor]


def by_hand(step: Step, first: torch.Tensor) -> Step:
    static = first.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static)

    def replay(token: torch.Tensor) -> torch.Tensor:
        static.copy_(token)
        graph.replay()
        return out

    return replay


def run(name: str, args: argparse.Namespace, device: torch.device, mesh: Any) -> dict[str, Any]:
    model = build(args, device, mesh)
    step: Step = model
    start = torch.tensor([[1]], device=device)
    if name == "graphtree":
        step = graphtree.graphed(model)
    elif name == "hand":
        step = by_hand(model, start)
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
    if name == "graphtree":
        s = graphtree.stats()
        row.update(replayed_fraction=s.replays / args.tokens, eager_reasons=dict(s.eager))
        graphtree.reset()
    return row


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
    cuda = args.device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=torch.device("cuda", local) if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    rows = []
    for name in args.contenders.split(","):
        if name == "hand" and not cuda:
            continue
        try:
            rows.append(run(name, args, device, mesh))
        except Exception as e:  # noqa: BLE001 - a contender that fails is a row that says why
            rows.append({"contender": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        dist.barrier()
    eager = next((dict(r) for r in rows if r["contender"] == "eager" and "tokens" in r), None)
    for r in rows:
        if "tokens" in r and eager is not None:
            r["tokens_equal_to_eager"] = r["tokens"] == eager["tokens"]
            r["ratio_to_eager"] = r["ms_per_token"] / eager["ms_per_token"]
        r.pop("tokens", None)
    if rank == 0:
        head = {
            "device": torch.cuda.get_device_name(local) if cuda else "cpu",
            "torch": torch.__version__,
            "world": world,
            "layers": args.layers,
            "d_model": args.d_model,
            "tokens": args.tokens,
        }
        out = [{**head, **r} for r in rows]
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
