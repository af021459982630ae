"""A data-parallel training step under torchrun (issue 48): eager DDP (or FSDP2) against graphtree's
recording of the whole step and against PyTorch's documented whole-network capture by hand.

Every rank trains its own copy of one model (same initial weights), on batches of its own, with
``DistributedDataParallel`` and ``SGD`` (momentum): the step is ``zero_grad``, forward, the loss,
``backward()`` (DDP's bucketed all-reduces) and ``step()``. Contenders, one after another:

- ``eager``: the step as written;
- ``graphtree``: ``graphtree.graphed(step)``, the same function;
- ``hand``: the step captured by hand as PyTorch's CUDA-graph notes describe it for DDP (warm-up
  iterations on a side stream, at least 11 so that DDP has rebuilt its buckets, then
  ``torch.cuda.graph`` around the whole step; the batch copied into static inputs);
- ``eager_again``: eager once more, whether eager reproduces its own losses bit for bit (where it
  does not, as with attention kernels whose backward adds in any order, unequal bits say nothing:
  ``losses_max_abs_diff_to_eager`` tells noise from a wrong result).

DDP is made on a side stream, as those notes ask, for every contender alike.

Per contender: the median time per step (back-to-back steps, synchronised every ``--round``
steps), the first three steps' time, each step's loss compared with eager's bit for bit (with
``torch.use_deterministic_algorithms``), and graphtree's replayed fraction. Rank 0 prints a JSON
row per contender and writes them with ``--json``::

    torchrun --nproc-per-node 4 benchmarks/ddp_step.py [--model gpt|resnet18|mlp] [--steps 100]
        [--batch 8] [--wrap ddp|fsdp2] [--json out.json]

``--wrap fsdp2``: FSDP2's ``fully_shard`` per block instead of DDP (issue 48, item 3: whether the
step is recorded, or runs eagerly with a reason naming what stops it, is the finding).

On a machine without GPUs, ``--device cpu`` runs the eager and graphtree contenders over gloo (a
dry run of the script: graphtree runs CPU calls eagerly).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (deterministic cuBLAS, before CUDA starts)
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # (PyTorch's note for capturing NCCL calls)

import torch
import torch.distributed as dist
from _torchrun import compare_to_eager, report, run_contenders, start, with_graphtree_stats
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphtree
from graphtree.bench.contenders import HandGraph
from graphtree.bench.train import GPTLoss, batch_loss, plain_step


def build(name: str, batch: int, device: torch.device, rank: int) -> tuple[nn.Module, list[tuple[torch.Tensor, ...]]]:
    """The model (same weights on every rank) and four batches of this rank's own."""
    torch.manual_seed(0)
    model: nn.Module
    if name == "gpt":
        from graphtree.demo.gpt import GPTConfig, TinyGPT

        config = GPTConfig(n_layer=4, n_head=4, d_model=256, vocab=2048, max_seq=128)
        model = GPTLoss(TinyGPT(config, batch=1))
    elif name == "resnet18":
        import timm  # (the GPU image has it)

        model = timm.create_model("resnet18", num_classes=100)
    elif name == "mlp":
        model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)), nn.Linear(256, 10))
    else:
        raise SystemExit(f"--model takes gpt, resnet18 or mlp, not {name!r}")
    gen = torch.Generator(device).manual_seed(1000 + rank)
    data: list[tuple[torch.Tensor, ...]] = []
    for _ in range(4):
        if name == "gpt":
            data.append((torch.randint(0, 2048, (batch, 128), device=device, generator=gen),))
        elif name == "resnet18":
            x = torch.randn(batch, 3, 224, 224, device=device, generator=gen)
            data.append((x, torch.randint(0, 100, (batch,), device=device, generator=gen)))
        else:
            x = torch.randn(batch, 256, device=device, generator=gen)
            data.append((x, torch.randint(0, 10, (batch,), device=device, generator=gen)))
    return model.to(device).train(), data


def wrap(model: nn.Module, how: str, device: torch.device) -> nn.Module:
    """``model`` data-parallel: ``DistributedDataParallel``, or FSDP2's ``fully_shard`` on each linear
    and convolution layer (not the demo GPT's) and on the whole."""
    if how == "ddp":
        if device.type != "cuda":
            return DDP(model, gradient_as_bucket_view=True)
        # Made on a side stream, as PyTorch's CUDA-graph notes ask: DDP keeps the parameters'
        # gradient accumulators, and autograd runs each on the stream it was made on. Made on the
        # default stream, no capture of the backward can take them in (on four H200s both graphtree's
        # and the hand capture failed so: "operation would make the legacy stream depend on a
        # capturing blocking stream").
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            ddp = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True)
        torch.cuda.current_stream(device).wait_stream(side)
        return ddp
    from torch.distributed.fsdp import fully_shard

    if not hasattr(model, "gpt"):  # (the demo GPT calls its blocks' parts directly: sharded whole)
        for part in [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d))]:
            fully_shard(part)
    fully_shard(model)
    return model


def run(name: str, args: argparse.Namespace, device: torch.device, rank: int) -> dict[str, Any]:
    model, data = build(args.model, args.batch, device, rank)
    ddp = wrap(model, args.wrap, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    step = plain_step(ddp, opt, batch_loss)
    t0 = time.perf_counter()
    if name == "graphtree":
        step = graphtree.graphed(step, name="ddp_step")
    elif name == "hand":  # PyTorch's whole-network capture of a DDP step: DDP rebuilds its buckets
        step = HandGraph(step, *data[0], warmup=11)  # after its first iterations, so 11 warm-ups first
    losses = [step(*data[i % len(data)]).clone() for i in range(3)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times: list[float] = []
    for i in range(3, args.steps, args.round):
        n = min(args.round, args.steps - i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for k in range(i, i + n):
            losses.append(step(*data[k % len(data)]).clone())
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / n)
    row: dict[str, Any] = {
        "contender": name,
        "ms_per_step": statistics.median(times) * 1e3 if times else None,
        "first_three_steps_s": first,
        "losses": torch.stack(losses).tolist(),
    }
    return with_graphtree_stats(row, name, args.steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", help="gpt, resnet18 or mlp")
    p.add_argument("--batch", type=int, default=8, help="samples per GPU")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--round", type=int, default=10, help="steps between synchronisations when timed")
    p.add_argument("--contenders", default="eager,graphtree,hand,eager_again", help="eager_again: eager once more")
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp2"), help="DistributedDataParallel or FSDP2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    rank, world, device = start(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    rows = run_contenders(args.contenders.split(","), lambda name: run(name, args, device, rank), device)
    compare_to_eager(rows, "losses", "ms_per_step")  # bit for bit (floats from the same kernels)
    head = {"model": args.model, "wrap": args.wrap, "batch_per_rank": args.batch, "steps": args.steps}
    report(rows, head, device, world, rank, args.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
