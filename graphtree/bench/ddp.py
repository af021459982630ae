"""The ``ddp`` scenario: a data-parallel training step on every GPU of the machine under torchrun
(issue 48), eager DDP (or FSDP2) against graphtree's recording of the whole step and against
PyTorch's documented whole-network capture by hand (``benchmarks/ddp_step.py`` is its script).

Every rank trains its own copy of one model (same initial weights), on batches of its own, with
``DistributedDataParallel`` and ``SGD`` (momentum): the step is ``zero_grad``, forward, the loss,
``backward()`` (DDP's bucketed all-reduces) and ``step()``. Contenders, one after another: eager,
``graphtree.graphed(step)``, and the hand capture (``handwritten``: warm-up iterations on a side
stream, at least 11 so that DDP has rebuilt its buckets, then ``torch.cuda.graph`` around the whole
step; the batch copied into static inputs). Eager runs twice: whether it reproduces its own losses
bit for bit (where it does not, unequal bits say nothing; the largest difference tells noise from a
wrong result). DDP is made on a side stream, as PyTorch's CUDA-graph notes ask, for every contender
alike. FSDP2 (``fully_shard``) in place of DDP is the demo GPT's second case.

Launch::

    torchrun --nproc-per-node 4 -m graphtree bench --scenarios ddp,tp

On a machine without GPUs, the rows can be made over gloo with ``device="cpu"`` (a dry run:
graphtree runs CPU calls eagerly; no hand capture).
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (deterministic cuBLAS, before CUDA starts)
os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")  # (PyTorch's note for capturing NCCL calls)

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import graphtree
from graphtree.bench.contenders import HANDWRITTEN, HandGraph
from graphtree.bench.harness import Result
from graphtree.bench.ranks import compare_to_eager, not_applicable, results_of, run_contenders, with_graphtree_stats
from graphtree.bench.train import GPTLoss, batch_loss, plain_step

if TYPE_CHECKING:
    from graphtree.bench.kit import Ctx

SCENARIO = "ddp"
APPLICABLE = ("eager", "graphtree", HANDWRITTEN)


@dataclass
class StepArgs:
    """One case: ``model`` (gpt, resnet18 or mlp), ``wrap`` (ddp or fsdp2), samples per GPU,
    steps, and steps between synchronisations when timed."""

    model: str = "gpt"
    wrap: str = "ddp"
    batch: int = 8
    steps: int = 100
    round: int = 10


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


def run(name: str, args: StepArgs, device: torch.device, rank: int) -> dict[str, Any]:
    """Contender ``name``'s row: ``args.steps`` steps of ``args.model`` wrapped by ``args.wrap``; its
    median time per step, its first three steps' time, its losses, graphtree's replayed share."""
    model, data = build(args.model, args.batch, device, rank)
    ddp = wrap(model, args.wrap, device)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    step = plain_step(ddp, opt, batch_loss)
    t0 = time.perf_counter()
    if name == "graphtree":
        step = graphtree.graphed(step, name="ddp_step")
    elif name == "hand":  # PyTorch's whole-network capture of a DDP step: DDP rebuilds its buckets
        step = HandGraph(step, *data[0], warmup=11)  # after its first iterations, so 11 warm-ups first
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses = [step(*data[i % len(data)]).clone() for i in range(3)]
    sync()
    first = time.perf_counter() - t0
    times: list[float] = []
    for i in range(3, args.steps, args.round):
        n = min(args.round, args.steps - i)
        sync()
        t = time.perf_counter()
        for k in range(i, i + n):
            losses.append(step(*data[k % len(data)]).clone())
        sync()
        times.append((time.perf_counter() - t) / n)
    row: dict[str, Any] = {
        "contender": name,
        "ms_per_step": statistics.median(times) * 1e3 if times else None,
        "first_three_steps_s": first,
        "losses": torch.stack(losses).tolist(),
    }
    return with_graphtree_stats(row, name, args.steps)


def step_rows(names: list[str], args: StepArgs, device: torch.device, rank: int) -> list[dict[str, Any]]:
    """Every rank's rows of one case: each contender in turn (``hand`` or ``handwritten`` for the
    capture by hand), then eager again as ``eager_again``; losses compared with eager's."""
    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        rows = run_contenders(names, lambda name: run(name, args, device, rank), device)
    finally:
        torch.use_deterministic_algorithms(was[0], warn_only=was[1])  # (the caller's setting back)
    compare_to_eager(rows, "losses", "ms_per_step")  # bit for bit (floats from the same kernels)
    return rows


def cases(quick: bool) -> list[StepArgs]:
    """The demo GPT and timm's ResNet-18 under DDP, the GPT under FSDP2 (100 steps; quick: 30)."""
    steps = 30 if quick else 100
    wanted = (("gpt", "ddp"), ("resnet18", "ddp"), ("gpt", "fsdp2"))
    return [StepArgs(model, wrap, steps=steps) for model, wrap in wanted]


def run_ddp(ctx: Ctx) -> list[Result]:
    """The scenario's rows (every rank runs it; rank 0's rows are written): the demo GPT and timm's
    ResNet-18 under DDP, the GPT under FSDP2, 8 samples per GPU."""
    from graphtree.bench.ranks import start

    rank, world, device = start("cuda" if torch.cuda.is_available() else "cpu")
    names = [n for n in ctx.cfg.contenders if n in APPLICABLE] + ["eager_again"]
    results = [not_applicable(SCENARIO, n, "time_per_step") for n in ctx.cfg.contenders if n not in APPLICABLE]
    with torch.enable_grad():  # (the bench runs its scenarios under no_grad)
        for args in cases(ctx.cfg.quick):
            case = f"{args.model} {args.wrap}, {world} rank(s), {args.batch} per GPU"
            rows = step_rows(["hand" if n == HANDWRITTEN else n for n in names], args, device, rank)
            results += results_of(rows, SCENARIO, case, "time_per_step", "ms_per_step", "losses")
            ctx.log(f"ddp: {case}: " + ", ".join(f"{r['contender']} {r.get('ms_per_step')}" for r in rows))
    return results
