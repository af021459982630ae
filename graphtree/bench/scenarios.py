"""The measured scenarios, by name (``RUNNERS``), and the run that goes through them under one budget.

Each scenario is a module of its own (``overhead``, ``decode``, ``memory``, ``capture``,
``branching``, ``generate``, ``share`` in :mod:`graphtree.bench`; what they share is in
:mod:`~graphtree.bench.kit`). Each builds every selected contender (see
:mod:`graphtree.bench.contenders`), checks its output against eager's, measures, and returns
:class:`~graphtree.bench.harness.Result` rows. A contender that fails (to build, to compile, to
capture, to run) gets a failed row with its error and the scenario goes on with the others.
Timings are interleaved across contenders (:func:`~graphtree.bench.harness.interleaved`) and
reported as medians over repeats.

- ``overhead`` -- :class:`~graphtree.bench.workloads.MMChain` of 1, 16 and 64 small matmul
  kernels: CPU time per call (no sync), wall time per call (synced), GPU-only time (CUDA events).
- ``decode`` -- :class:`graphtree.demo.gpt.TinyGPT` (12 layers, d=768, random weights, static KV
  cache), one token per step at batch 1, 8 and 32: time per token and speedup over eager.
- ``memory`` -- an MLP recorded for batch buckets 1, 8 and 32: graphtree (one tree, one pool),
  hand-written graphs (a private pool each), compile contenders (dynamic batch, one compile):
  bytes the recordings keep reserved.
- ``capture`` -- seconds to record each bucket (1, 8, 32 reported) and the total for 32 buckets.
- ``branching`` -- A->B, then A->B' in the same tree: memory after each, against the sum of
  separate graphs for A, B and B'.
- ``generate`` -- Hugging Face ``generate()`` of a random-weight Llama with a static KV cache:
  time per token (see :mod:`graphtree.bench.generate`; skipped without transformers).
- ``share`` -- handing a graphed step's output to consumer processes (:mod:`graphtree.bench.share`).
- ``breaks`` -- models that read values on the host (:mod:`graphtree.bench.breaks`).
- ``train`` -- a whole training step per call (:mod:`graphtree.bench.train`).
- ``ddp``, ``tp`` -- on every GPU under torchrun: a data-parallel training step
  (:mod:`graphtree.bench.ddp`) and a tensor-parallel decode (:mod:`graphtree.bench.tp`).

Example::

    from graphtree.bench.scenarios import BenchConfig, run_scenarios
    results = run_scenarios(["overhead"], BenchConfig.make(quick=True))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from graphtree.bench.branching import run_branching
from graphtree.bench.capture import run_capture
from graphtree.bench.contenders import configure_dynamo, reset_all
from graphtree.bench.decode import run_decode
from graphtree.bench.harness import Budget, Progress, Result, failed
from graphtree.bench.kit import BUDGET_WEIGHTS, MIN_REPEATS, RANK_SCENARIOS, SCENARIOS, BenchConfig, Ctx
from graphtree.bench.memory import run_memory
from graphtree.bench.overhead import run_overhead

__all__ = [
    "BUDGET_WEIGHTS",
    "INTERRUPTED",
    "MIN_REPEATS",
    "RANK_SCENARIOS",
    "RUNNERS",
    "SCENARIOS",
    "BenchConfig",
    "run_scenarios",
]


def _run_share(ctx: Ctx) -> list[Result]:
    from graphtree.bench.share import run_share  # spawns consumer processes only when it runs

    return run_share(ctx)


def _run_breaks(ctx: Ctx) -> list[Result]:
    from graphtree.bench.breaks import run_breaks  # imports transformers only when its Llama case runs

    return run_breaks(ctx)


def _run_generate(ctx: Ctx) -> list[Result]:
    from graphtree.bench.generate import run_generate  # imports transformers only when it runs

    return run_generate(ctx)


def _run_train(ctx: Ctx) -> list[Result]:
    from graphtree.bench.train import run_train  # imports timm only when its ResNet cases run

    return run_train(ctx)


def _run_ddp(ctx: Ctx) -> list[Result]:
    from graphtree.bench.ddp import run_ddp  # torch.distributed's and timm's imports only when it runs

    return run_ddp(ctx)


def _run_tp(ctx: Ctx) -> list[Result]:
    from graphtree.bench.tp import run_tp  # DTensor's imports only when it runs

    return run_tp(ctx)


# --------------------------------------------------------------------------------------------
# the run


RUNNERS: dict[str, Callable[[Ctx], list[Result]]] = {
    "overhead": run_overhead,
    "decode": run_decode,
    "memory": run_memory,
    "capture": run_capture,
    "branching": run_branching,
    "generate": _run_generate,
    "share": _run_share,
    "breaks": _run_breaks,
    "train": _run_train,
    "ddp": _run_ddp,  # (on every rank, under torchrun: see graphtree.bench.ddp)
    "tp": _run_tp,
}


INTERRUPTED = "Interrupted"
"""Error type of the rows of scenarios stopped (or never started) because of Ctrl-C."""


def run_scenarios(names: Sequence[str], cfg: BenchConfig, log: Progress | None = None) -> list[Result]:
    """Run the named scenarios in order under one time budget; never raises for a contender.

    A scenario that crashes outside any contender gets failed rows for every contender, and
    the run goes on with the next scenario. Ctrl-C stops the run: the stopped scenario and the
    ones after it get failed rows whose error starts with ``Interrupted``, and the rows
    measured so far are returned, so they can still be written.

    Example::

        rows = run_scenarios(["overhead", "memory"], BenchConfig.make(quick=True))
    """
    log = log or Progress()
    budget = Budget(cfg.budget_s, {n: BUDGET_WEIGHTS.get(n, 1.0) for n in names})
    ctx = Ctx(cfg, budget, log)
    configure_dynamo()
    results: list[Result] = []
    interrupted = False
    for name in names:
        if interrupted:
            for c in cfg.contenders:
                results.append(
                    failed(name, "scenario", c, f"{INTERRUPTED}: the run was stopped before this scenario", "scenario")
                )
            continue
        share = budget.begin(name)
        log(f"{name}: starting (budget {share:.0f}s)")
        t0 = time.monotonic()
        n0 = len(results)
        try:
            # no_grad rather than inference_mode: tensors made under inference_mode keep no
            # version counter, and the decode model mutates its KV cache in place, which
            # torch.compile tracks; no_grad suits every contender
            with torch.no_grad():
                results.extend(RUNNERS[name](ctx))
        except KeyboardInterrupt:
            interrupted = True
            log(f"{name}: interrupted; the rows measured so far will be written")
            for c in cfg.contenders:
                results.append(
                    failed(name, "scenario", c, f"{INTERRUPTED}: the run was stopped during this scenario", "scenario")
                )
        except Exception as exc:  # noqa: BLE001 - a crashed scenario must not end the run
            log(f"{name}: crashed: {exc!r}")
            for c in cfg.contenders:
                results.append(failed(name, "scenario", c, exc, "scenario"))
        finally:
            try:
                reset_all()
            except Exception:  # noqa: BLE001
                pass
        seen = {r.contender for r in results[n0:]}
        for c in cfg.contenders:
            if c not in seen:
                results.append(
                    failed(name, "scenario", c, "NoResult: the scenario produced no row for this contender", "scenario")
                )
        log(f"{name}: done in {time.monotonic() - t0:.1f}s")
    return results
