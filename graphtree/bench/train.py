"""The ``train`` scenario: a whole training step per call (issue 28), against the ways a user
would otherwise run it.

Every contender trains its own copy of the model with ``AdamW(capturable=True)``:

- ``eager``: the step as written (``zero_grad``, forward, ``backward()``, ``step()``);
- ``graphtree``: ``graphtree.graphed(step)``, the same function, recorded whole
  (:mod:`graphtree.tree.training_step`);
- ``handwritten``: the whole step captured by hand, as PyTorch's docs show ("whole network
  capture": warm-up on a side stream, ``zero_grad(set_to_none=True)``, forward, backward and step
  inside ``torch.cuda.graph``), the inputs copied into its static tensors;
- ``graphtree-module`` (with ``graphtree``): the user's loop unchanged, the model graphed
  (``graphtree.graphed(model)``): its forward and backward replayed under autograd
  (:mod:`graphtree.tree.module_training`), the optimizer eager;
- ``graphtree+compile`` (with ``graphtree`` and ``compile-reduce-overhead``): the step recorded
  whole as ``graphtree``'s, around ``torch.compile(model)`` (default mode: inductor's fused
  kernels, no CUDA graphs of its own);
- ``make_graphed_callables`` (always in this scenario): the model's forward and backward graphed
  by ``torch.cuda.make_graphed_callables``, the optimizer eager;
- ``compile-reduce-overhead``: ``torch.compile(model, mode="reduce-overhead")``, the optimizer eager.

Per case and contender: the synced wall time per step, the seconds of its first three steps
(warm-ups, captures and compiles included) and the memory it reserved. graphtree's losses over
its first steps are checked against eager's, step by step (they start from the same weights and
see the same batches; the hand capture's warm-ups are steps of their own, so it is not compared).

Example::

    rows = run_train(ctx)
"""

from __future__ import annotations

import copy
import gc
import itertools
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from graphtree.bench import kit, timing
from graphtree.bench.contenders import COMPILE_CG, COMPILE_RO, EAGER, GRAPHTREE, HANDWRITTEN, compile_fn, reset_all
from graphtree.bench.harness import Result, failed, interleaved
from graphtree.bench.kit import MIN_REPEATS, Ctx, Rounds, line, not_run, timing_rows

MGC = "make_graphed_callables"
GT_MODULE = "graphtree-module"
GT_COMPILE = "graphtree+compile"
CASES = ("mlp", "gpt", "resnet18-8", "resnet18-64")
CHECK_STEPS = 8  # steps whose losses graphtree's must equal eager's
STEPS_PER_SAMPLE = 10


class GPTLoss(nn.Module):
    """The demo GPT whose forward is its training loss (what make_graphed_callables graphs)."""

    def __init__(self, gpt: nn.Module) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt.loss(tokens)  # type: ignore[operator]


def workload(name: str) -> tuple[nn.Module, Callable[[nn.Module, Any], torch.Tensor], list[tuple[torch.Tensor, ...]]]:
    """The model of case ``name`` (train mode, on the GPU), its loss of a batch, and four batches.

    ``mlp``: 8 ReLU layers of width 256, batch 32; ``gpt``: the demo GPT (4 layers, d=256, vocab
    2048), 8 sequences of 128 tokens; ``resnet18-<batch>``: timm's ResNet-18, 100 classes, 224x224.

    Example::

        model, loss_fn, batches = workload("mlp")
        loss_fn(model, batches[0]).backward()
    """
    gen = torch.Generator(kit.DEVICE).manual_seed(0)
    torch.manual_seed(0)
    model: nn.Module
    data: list[tuple[torch.Tensor, ...]]
    if name.startswith("resnet18-"):
        import timm  # only when this case runs

        batch = int(name.split("-")[1])
        model = timm.create_model("resnet18", num_classes=100)
        data = [
            (
                torch.randn(batch, 3, 224, 224, device=kit.DEVICE, generator=gen),
                torch.randint(0, 100, (batch,), device=kit.DEVICE, generator=gen),
            )
            for _ in range(4)
        ]
    elif name == "gpt":
        from graphtree.demo.gpt import GPTConfig, TinyGPT

        model = GPTLoss(TinyGPT(GPTConfig(n_layer=4, n_head=4, d_model=256, vocab=2048, max_seq=128), batch=1))
        data = [(torch.randint(0, 2048, (8, 128), device=kit.DEVICE, generator=gen),) for _ in range(4)]
    elif name == "mlp":
        model = nn.Sequential(*(nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(8)), nn.Linear(256, 10))
        data = [
            (
                torch.randn(32, 256, device=kit.DEVICE, generator=gen),
                torch.randint(0, 10, (32,), device=kit.DEVICE, generator=gen),
            )
            for _ in range(4)
        ]
    else:
        raise ValueError(f"unknown training case {name!r}: one of {', '.join(CASES)}")
    return model.to(kit.DEVICE).train(), batch_loss, data


def batch_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A batch's training loss: a language model's forward is its loss (:class:`GPTLoss`), a
    classifier's is cross-entropy against the batch's labels."""
    out = model(batch[0])
    return out if len(batch) == 1 else F.cross_entropy(out, batch[1])


def plain_step(model: Callable[..., Any], opt: torch.optim.Optimizer, loss_fn: Callable) -> Callable[..., torch.Tensor]:
    """The step as a user writes it: zero_grad, forward, backward, step; returns the loss, detached."""

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


def make_step(name: str, model: nn.Module, loss_fn: Callable, first: Any) -> Callable[..., torch.Tensor]:
    """Contender ``name``'s step function for ``model`` (which it trains), given the first batch.

    Example::

        step = make_step("graphtree", model, loss_fn, batches[0])
        loss = step(*batches[0])
    """
    on_gpu = next(model.parameters()).is_cuda  # (the CPU tests run this scenario on a faked GPU)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=on_gpu)
    if name == EAGER:
        return plain_step(model, opt, loss_fn)
    if name == GRAPHTREE:
        import graphtree

        return graphtree.graphed(plain_step(model, opt, loss_fn), name="train_step")
    if name == GT_MODULE:
        import graphtree

        return plain_step(graphtree.graphed(model), opt, loss_fn)
    if name == GT_COMPILE:
        import graphtree

        return graphtree.graphed(plain_step(torch.compile(model), opt, loss_fn), name="train_step_compiled")
    if name == HANDWRITTEN:
        return _hand(model, opt, loss_fn, first)
    if name == MGC:
        return plain_step(torch.cuda.make_graphed_callables(model, (first[0],)), opt, loss_fn)
    if name == COMPILE_RO:
        compiled = compile_fn(COMPILE_RO, model)
        inner = plain_step(compiled, opt, loss_fn)

        def step(*batch: torch.Tensor) -> torch.Tensor:
            torch.compiler.cudagraph_mark_step_begin()
            return inner(*batch).clone()  # (its output is overwritten by the next step)

        return step
    raise ValueError(f"unknown contender {name!r}")


def run_train(ctx: Ctx) -> list[Result]:
    """Wall time per training step, first steps' seconds and memory, per case and contender.

    Example::

        rows = run_train(ctx)
    """
    with torch.enable_grad():  # (the scenarios run under no_grad)
        return _run(ctx)


def _run(ctx: Ctx) -> list[Result]:
    results: list[Result] = []
    # The hand capture is built last: with make_graphed_callables built after it, the hand-captured
    # GPT step's next replay read freed memory (an illegal address, graphtree not in the process;
    # torch 2.11 on the H100; the other order, or either alone, ran clean)
    asked = ctx.cfg.contenders
    wanted = (*asked, MGC, *((GT_MODULE,) if GRAPHTREE in asked else ()))
    if GRAPHTREE in asked and COMPILE_RO in asked:
        wanted = (*wanted, GT_COMPILE)
    names = [n for n in (EAGER, GRAPHTREE, GT_MODULE, GT_COMPILE, MGC, COMPILE_RO, HANDWRITTEN) if n in wanted]
    if COMPILE_CG in ctx.cfg.contenders:
        note = "not applicable: reduce-overhead is this scenario's compile contender"
        results.append(Result("train", "all", COMPILE_CG, "wall_per_step", None, "s", note=note))
    for case in ctx.cfg.train_cases:
        try:
            base, loss_fn, data = workload(case)
        except Exception as exc:  # noqa: BLE001 - a case that cannot be built (no timm) is skipped
            not_run(results, ctx, "train", case, names, "wall_per_step", exc)
            continue
        calls: dict[str, Callable[[], Any]] = {}
        checks: dict[str, dict[str, Any]] = {}
        ref: list[float] = []
        for name in names:
            if ctx.budget.expired():
                break
            # (no reset between contenders: they are timed together below, and torch's cudagraph
            # trees reset under a live reduce-overhead model replayed freed memory on the H100)
            gc.collect()
            torch.cuda.empty_cache()
            reserved = torch.cuda.memory_reserved()
            t0 = time.perf_counter()
            try:
                step = make_step(name, copy.deepcopy(base), loss_fn, data[0])
                losses = [step(*data[i % 4]).item() for i in range(CHECK_STEPS)]
            except Exception as exc:  # noqa: BLE001 - a contender that fails is a row that says why
                results.append(failed("train", case, name, exc, "wall_per_step"))
                ctx.log(f"train: {case}: {name} failed: {exc!r}"[:400])
                continue
            first = time.perf_counter() - t0
            note = f"its first {CHECK_STEPS} steps"
            results.append(Result("train", case, name, "first_steps", first, "s", note=note))
            results.append(Result("train", case, name, "reserved", torch.cuda.memory_reserved() - reserved, "bytes"))
            if name == EAGER:
                ref = losses
            elif name in (GRAPHTREE, GT_MODULE, GT_COMPILE) and ref:
                worst = max(abs(a - b) for a, b in zip(losses, ref))
                checks[name] = {"equal": worst <= 1e-4 * max(abs(b) for b in ref), "bitwise": worst == 0.0}
                checks[name]["max_abs_diff"] = worst
            batches = itertools.cycle(data)
            calls[name] = partial(lambda s, b: s(*next(b)), step, batches)
        if not calls:
            reset_all()
            continue
        rounds = Rounds(repeats=5, warmup=1, stop=ctx.budget.expired, min_repeats=MIN_REPEATS)
        sync = torch.cuda.synchronize
        t = interleaved(calls, timer=partial(timing.wall_per_call, calls=STEPS_PER_SAMPLE, sync=sync), **rounds)
        med = timing_rows(results, "train", case, "wall_per_step", t, checks, {"rtol": 1e-4, "atol": 0.0})
        ctx.log(line(f"train: {case}: wall/step", med))
        del calls
        reset_all()
    return results
