"""What every benchmark scenario shares: the run's configuration and context, its inputs, the checks
against eager, the rows it writes, bucketed recordings. Each scenario is a module of its own
(:mod:`~graphtree.bench.overhead`, ``decode``, ``memory``, ``capture``, ``branching``, ``generate``,
``share``); :mod:`~graphtree.bench.scenarios` runs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict

import torch

from graphtree.bench import contenders
from graphtree.bench.contenders import (
    ALL_CONTENDERS,
    COMPILED,
    EAGER,
    GRAPHTREE,
    HANDWRITTEN,
    build,
    cudagraph_skips,
    graphtree_note,
    reset_all,
    settle,
    step_begin,
    stepped,
    timed,
)
from graphtree.bench.harness import Budget, Progress, Result, Timings, failed, format_value, run_contender
from graphtree.demo.gpt import GPTConfig

SCENARIOS: tuple[str, ...] = (
    "overhead",
    "decode",
    "memory",
    "capture",
    "branching",
    "generate",
    "share",
    "breaks",
    "train",
)
"""Scenario names, in the order they run."""

RANK_SCENARIOS: tuple[str, ...] = ("ddp", "tp")
"""Scenarios of every GPU of the machine, one rank each, under torchrun: they run alone, when asked."""

BUDGET_WEIGHTS: dict[str, float] = {
    "overhead": 2.0,
    "decode": 4.0,
    "memory": 1.0,
    "capture": 1.5,
    "branching": 1.0,
    "generate": 2.0,
    "share": 1.0,
    "breaks": 1.5,
    "train": 2.0,
    "ddp": 3.0,
    "tp": 1.0,
}
"""Relative share of the time budget per scenario (unused time rolls over to later ones)."""

MIN_REPEATS = 3
"""Measured rounds every timing gets even when its scenario's time budget is spent."""

TOL_MM = {"rtol": 1e-4, "atol": 1e-5}
"""Tolerance of the overhead check (the same cuBLAS fp32 matmuls in every contender)."""
TOL_MLP = {"rtol": 1e-3, "atol": 1e-4}
"""Tolerance of the memory, capture and branching checks (inductor may fuse GELU differently)."""
TOL_LOGITS = {"rtol": 1e-3, "atol": 1e-3}
"""Tolerance of the decode check on the logits (inductor fuses LayerNorm/softmax differently)."""


@dataclass
class BenchConfig:
    """Sizes, repeats and the time budget of a run; :meth:`make` gives the full or quick set.

    Example::

        cfg = BenchConfig.make(quick=True, contenders=("eager", "graphtree"))
    """

    quick: bool = False
    contenders: tuple[str, ...] = ALL_CONTENDERS
    budget_s: float = 420.0
    # overhead
    kernels: tuple[int, ...] = (1, 16, 64)
    mm_rows: int = 16
    mm_dim: int = 64
    overhead_calls: int = 100
    overhead_repeats: int = 15
    overhead_warmup: int = 3
    # decode
    gpt: GPTConfig = field(default_factory=GPTConfig)
    decode_batches: tuple[int, ...] = (1, 8, 32)
    decode_steps: int = 64
    decode_check_steps: int = 8
    decode_repeats: int = 5
    decode_warmup: int = 1
    # memory and branching (the MLP's shape)
    mem_buckets: tuple[int, ...] = (1, 8, 32)
    mlp_d: int = 1024
    mlp_hidden: int = 4096
    mlp_layers: int = 2
    mlp_tokens: int = 64
    branch_batch: int = 32
    branch_iters: int = 3
    # capture
    capture_buckets: int = 32
    capture_report: tuple[int, ...] = (1, 8, 32)
    capture_d: int = 256
    capture_hidden: int = 1024
    capture_layers: int = 2
    capture_tokens: int = 8
    capture_repeats: int = 3
    # train (graphtree.bench.train.CASES)
    train_cases: tuple[str, ...] = ("mlp", "gpt", "resnet18-8", "resnet18-64")

    @classmethod
    def make(
        cls, quick: bool = False, contenders: Sequence[str] | None = None, budget_s: float | None = None
    ) -> BenchConfig:
        """The full configuration, or with ``quick`` a small one for a smoke run (about a minute).

        Example::

            BenchConfig.make(quick=True).decode_batches   # (1, 8)
        """
        cfg = cls(quick=quick)
        if quick:
            cfg = replace(
                cfg,
                budget_s=240.0,
                overhead_calls=20,
                overhead_repeats=5,
                overhead_warmup=2,
                gpt=GPTConfig(n_layer=2, n_head=4, d_model=128, vocab=1024, max_seq=64),
                decode_batches=(1, 8),
                decode_steps=16,
                decode_check_steps=4,
                decode_repeats=3,
                mlp_d=256,
                mlp_hidden=1024,
                mlp_tokens=16,
                branch_batch=8,
                mem_buckets=(1, 8),
                capture_buckets=8,
                capture_report=(1, 8),
                capture_d=128,
                capture_hidden=256,
                capture_repeats=2,
            )
        if contenders is not None:
            cfg.contenders = tuple(contenders)
        if budget_s is not None:
            cfg.budget_s = float(budget_s)
        return cfg

    def describe(self) -> dict[str, Any]:
        """The configuration as plain JSON values (for the document's ``meta``)."""
        d = {k: v for k, v in self.__dict__.items() if k != "gpt"}
        d["gpt"] = dict(self.gpt.__dict__)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


@dataclass
class Ctx:
    cfg: BenchConfig
    budget: Budget
    log: Progress


class Rounds(TypedDict):
    """The keyword arguments of :func:`interleaved` that one case's timers share."""

    repeats: int
    warmup: int
    stop: Callable[[], bool]
    min_repeats: int


# --------------------------------------------------------------------------------------------
# shared pieces


DEVICE = "cuda"
"""Where the workloads live (the benchmark's single GPU: the current CUDA device)."""


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)).to(DEVICE)


def check_extra(check: dict[str, Any] | None, tol: dict[str, float]) -> dict[str, Any]:
    if not check:
        return {}
    out: dict[str, Any] = {k: check[k] for k in ("bitwise", "max_abs_diff", "why") if k in check}
    out.update(tol)
    return out


def merge_checks(checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    diffs = [c["max_abs_diff"] for c in checks if c.get("max_abs_diff") is not None]
    merged: dict[str, Any] = {
        "equal": all(c["equal"] for c in checks),
        "bitwise": all(c["bitwise"] for c in checks),
        "max_abs_diff": max(diffs) if diffs else None,
    }
    why = [c["why"] for c in checks if c.get("why")]
    if why:
        merged["why"] = why[0]
    return merged


def cleanup_after_error(_: BaseException) -> None:
    """After a failed contender: drop every recording and cached compile, release memory."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a broken context must not stop the clean-up
        pass
    try:
        reset_all()
    except Exception:  # noqa: BLE001
        settle()


def build_all(
    ctx: Ctx,
    scenario: str,
    case: str,
    fn: Callable[..., Any],
    example_args: Sequence[torch.Tensor],
    verify: Callable[[Callable[..., Any]], dict],
    results: list[Result],
    prepare: Callable[[], None] | None = None,
) -> tuple[dict[str, Callable[..., Any]], dict[str, dict[str, Any]]]:
    """Build every contender for a fixed-shape workload, check it, and add its set-up rows."""
    calls: dict[str, Callable[..., Any]] = {}
    checks: dict[str, dict[str, Any]] = {}
    for name in ctx.cfg.contenders:

        def one(name: str = name) -> list[Result]:
            if name in COMPILED:  # only compiling is slow enough to skip
                ctx.budget.check(f"{name} in {scenario}/{case}")
            if prepare is not None:
                prepare()
            call, setup = build(name, fn, example_args)
            if prepare is not None:
                prepare()
            checks[name] = verify(call)
            calls[name] = call
            rows = []
            for metric in ("capture_s", "compile_s"):
                if metric in setup:
                    rows.append(Result(scenario, case, name, metric, setup[metric], "s", note=setup["note"]))
            if setup["note"]:
                ctx.log(f"{scenario}: {case}: {name}: note: {setup['note']}")
            return rows

        t0 = time.monotonic()
        n_before = len(results)
        run_contender(results, scenario, case, name, one, metric="setup", on_error=cleanup_after_error)
        if name in calls:
            equal = "equal to eager" if checks[name]["equal"] else "DIFFERS from eager"
            ctx.log(f"{scenario}: {case}: {name} ready in {time.monotonic() - t0:.1f}s, {equal}")
        else:
            ctx.log(f"{scenario}: {case}: {name} FAILED: {results[n_before].error}")
    return calls, checks


def timing_rows(
    results: list[Result],
    scenario: str,
    case: str,
    metric: str,
    t: Timings,
    checks: dict[str, dict[str, Any]],
    tol: dict[str, float],
    note: str = "",
) -> dict[str, float]:
    """Append one row per contender of ``t`` (median and spread); return the medians."""
    medians: dict[str, float] = {}
    for name in t.samples:
        if name in t.errors:
            results.append(failed(scenario, case, name, t.errors[name], metric))
            continue
        s = t.summary(name)
        if s is None:
            results.append(failed(scenario, case, name, "NoSamples: time budget spent", metric))
            continue
        medians[name] = s["median"]
        check = checks.get(name)
        results.append(
            Result(
                scenario,
                case,
                name,
                metric,
                s["median"],
                "s",
                equal_to_eager=None if check is None else check["equal"],
                stats=s,
                note=note,
                extra=check_extra(check, tol),
            )
        )
    return medians


def line(label: str, medians: dict[str, float], unit: str = "s") -> str:
    return label + ": " + " | ".join(f"{n} {format_value(v, unit)}" for n, v in medians.items())


def run_logged(ctx: Ctx, results: list[Result], scenario: str, case: str, name: str, fn: Callable[[], Any]) -> Any:
    """:func:`run_contender` that also prints a progress line when the contender fails."""
    n_before = len(results)
    out = run_contender(results, scenario, case, name, fn, on_error=cleanup_after_error)
    if out is None and len(results) > n_before and not results[n_before].ok:
        ctx.log(f"{scenario}: {name} FAILED: {results[n_before].error}")
    return out


def not_run(
    results: list[Result], ctx: Ctx, scenario: str, case: str, names: Sequence[str], metric: str, exc: BaseException
) -> None:
    """A case that cannot be built (an optional library missing): a "not run" row per contender, and a line."""
    for name in names:
        results.append(Result(scenario, case, name, metric, None, "s", note=f"not run: {exc}"))
    ctx.log(f"{scenario}: {case}: not run: {exc}")


def skip_all(results: list[Result], ctx: Ctx, scenario: str, case: str, exc: BaseException) -> None:
    for name in ctx.cfg.contenders:
        results.append(failed(scenario, case, name, exc, "setup"))


def bucketed(
    name: str,
    fn: Callable[..., Any],
    xs: dict[int, torch.Tensor],
    per_bucket: Callable[[int, float], None] | None = None,
) -> tuple[Callable[..., Any], dict[str, Any], list[Any]]:
    """Contender ``name`` recorded for every batch size in ``xs`` (largest first).

    Returns ``(call, setup, keep)``: ``keep`` holds what must stay alive for the recordings.
    ``per_bucket(size, seconds)`` receives the time to record each bucket; ``setup`` may hold
    ``compile_s`` (the first call of a compile contender, excluded from the per-bucket times).
    """
    sizes = sorted(xs, reverse=True)
    top = sizes[0]
    setup: dict[str, Any] = {"note": ""}
    report = per_bucket or (lambda size, seconds: None)
    if name == EAGER:
        for s in sizes:
            fn(xs[s])
        return fn, setup, []
    if name == HANDWRITTEN:
        graphs: dict[int, contenders.HandGraph] = {}
        for s in sizes:
            graphs[s], secs = timed(lambda: contenders.HandGraph(fn, xs[s]))  # noqa: B023 - called at once; a private pool each
            report(s, secs)

        def call_hand(x: torch.Tensor) -> Any:
            return graphs[x.shape[0]](x)

        return call_hand, setup, [graphs]
    if name in COMPILED:
        skips = cudagraph_skips()
        call = stepped(contenders.compile_fn(name, fn), step_begin(name))
        first = xs[top].clone()
        torch._dynamo.mark_dynamic(first, 0)  # (imported by torch.compile above)
        _, setup["compile_s"] = timed(lambda: call(first))
        for s in sizes:
            # cudagraph trees run a new shape eagerly once, then record it; the largest size
            # already had its eager run inside the compile call
            n = 1 if s == top else 2
            _, secs = timed(lambda: [call(xs[s]) for _ in range(n)])  # noqa: B023 - timed() calls it at once
            report(s, secs)
        if cudagraph_skips() > skips:
            setup["note"] = "inductor skipped CUDA graphs for this function"
        return call, setup, [call]
    if name == GRAPHTREE:
        import graphtree

        g = graphtree.graphed(fn, buckets=sizes, bucket_dim=0)
        for s in sizes:
            _, secs = timed(lambda: g.warm_up(xs[s], sizes=[s]))  # noqa: B023 - timed() calls it at once
            report(s, secs)
        setup["note"] = graphtree_note()
        return stepped(g, graphtree.mark_step), setup, [g]
    raise ValueError(f"unknown contender {name!r}")


def summary(xs: list[float]) -> dict[str, float]:
    from graphtree.bench.harness import summarize

    return summarize(xs)
