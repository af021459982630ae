"""The six measured scenarios; correctness against eager is checked inside each of them.

Each scenario builds every selected contender (see :mod:`graphtree.bench.contenders`), checks
its output against eager's, measures, and returns :class:`~graphtree.bench.harness.Result` rows.
A contender that fails (to build, to compile, to capture, to run) gets a failed row with its
error and the scenario goes on with the others. Timings are interleaved across contenders
(:func:`~graphtree.bench.harness.interleaved`) and reported as medians over repeats.

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

Example::

    from graphtree.bench.scenarios import BenchConfig, run_scenarios
    results = run_scenarios(["overhead"], BenchConfig.make(quick=True))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypedDict

import torch

from graphtree import _torch
from graphtree.bench import timing
from graphtree.bench.contenders import (
    ALL_CONTENDERS,
    COMPILED,
    EAGER,
    GRAPHTREE,
    HANDWRITTEN,
    HandGraph,
    build,
    compare,
    compile_fn,
    configure_dynamo,
    cudagraph_skips,
    graphtree_note,
    private_pool_bytes,
    reserved_bytes,
    reset_all,
    settle,
    snapshot,
    step_begin,
    stepped,
    timed,
)
from graphtree.bench.harness import (
    Budget,
    Progress,
    Result,
    Timings,
    failed,
    format_value,
    interleaved,
    run_contender,
)
from graphtree.bench.workloads import MLP, MMChain
from graphtree.demo.gpt import GPTConfig

SCENARIOS: tuple[str, ...] = ("overhead", "decode", "memory", "capture", "branching", "generate", "share")
"""Scenario names, in the order they run."""

BUDGET_WEIGHTS: dict[str, float] = {
    "overhead": 2.0,
    "decode": 4.0,
    "memory": 1.0,
    "capture": 1.5,
    "branching": 1.0,
    "generate": 2.0,
    "share": 1.0,
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
class _Ctx:
    cfg: BenchConfig
    budget: Budget
    log: Progress


class _Rounds(TypedDict):
    """The keyword arguments of :func:`interleaved` that one case's timers share."""

    repeats: int
    warmup: int
    stop: Callable[[], bool]
    min_repeats: int


# --------------------------------------------------------------------------------------------
# shared pieces


DEVICE = "cuda"
"""Where the workloads live (the benchmark's single GPU: the current CUDA device)."""


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(DEVICE)


def _check_extra(check: dict[str, Any] | None, tol: dict[str, float]) -> dict[str, Any]:
    if not check:
        return {}
    out: dict[str, Any] = {k: check[k] for k in ("bitwise", "max_abs_diff", "why") if k in check}
    out.update(tol)
    return out


def _merge_checks(checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
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


def _cleanup_after_error(_: BaseException) -> None:
    """After a failed contender: drop every recording and cached compile, release memory."""
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a broken context must not stop the clean-up
        pass
    try:
        reset_all()
    except Exception:  # noqa: BLE001
        settle()


def _build_all(
    ctx: _Ctx,
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
        run_contender(results, scenario, case, name, one, metric="setup", on_error=_cleanup_after_error)
        if name in calls:
            equal = "equal to eager" if checks[name]["equal"] else "DIFFERS from eager"
            ctx.log(f"{scenario}: {case}: {name} ready in {time.monotonic() - t0:.1f}s, {equal}")
        else:
            ctx.log(f"{scenario}: {case}: {name} FAILED: {results[n_before].error}")
    return calls, checks


def _timing_rows(
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
                extra=_check_extra(check, tol),
            )
        )
    return medians


def _line(label: str, medians: dict[str, float], unit: str = "s") -> str:
    return label + ": " + " | ".join(f"{n} {format_value(v, unit)}" for n, v in medians.items())


def _run_logged(ctx: _Ctx, results: list[Result], scenario: str, case: str, name: str, fn: Callable[[], Any]) -> Any:
    """:func:`run_contender` that also prints a progress line when the contender fails."""
    n_before = len(results)
    out = run_contender(results, scenario, case, name, fn, on_error=_cleanup_after_error)
    if out is None and len(results) > n_before and not results[n_before].ok:
        ctx.log(f"{scenario}: {name} FAILED: {results[n_before].error}")
    return out


def _skip_all(results: list[Result], ctx: _Ctx, scenario: str, case: str, exc: BaseException) -> None:
    for name in ctx.cfg.contenders:
        results.append(failed(scenario, case, name, exc, "setup"))


# --------------------------------------------------------------------------------------------
# 1. per-call overhead


def run_overhead(ctx: _Ctx) -> list[Result]:
    """CPU, wall and GPU time per call of 1-, 16- and 64-kernel functions, per contender.

    Example::

        rows = run_overhead(ctx)
    """
    cfg = ctx.cfg
    results: list[Result] = []
    sync = torch.cuda.synchronize
    hz = timing.calibrate_spin()
    for k in cfg.kernels:
        case = f"{k} kernel" + ("s" if k != 1 else "")
        try:
            model = MMChain(k, cfg.mm_dim, seed=k).to(DEVICE)
            x = _randn(cfg.mm_rows, cfg.mm_dim, seed=100 + k)
            ref = snapshot(model(x))
        except Exception as exc:  # noqa: BLE001
            _skip_all(results, ctx, "overhead", case, exc)
            continue
        calls, checks = _build_all(
            ctx,
            "overhead",
            case,
            model,
            (x,),
            lambda call: compare(call(x), ref, **TOL_MM),  # noqa: B023 - used in this iteration only
            results,
        )
        fns = {n: partial(c, x) for n, c in calls.items()}
        common = _Rounds(
            repeats=cfg.overhead_repeats, warmup=cfg.overhead_warmup, stop=ctx.budget.expired, min_repeats=MIN_REPEATS
        )
        cpu = interleaved(fns, timer=partial(timing.cpu_per_call, calls=cfg.overhead_calls, sync=sync), **common)
        med = _timing_rows(
            results,
            "overhead",
            case,
            "cpu_per_call",
            cpu,
            checks,
            TOL_MM,
            note=f"CPU time per call, no sync; {cfg.overhead_calls} calls/sample",
        )
        ctx.log(_line(f"overhead: {case}: cpu/call", med))
        wall = interleaved(fns, timer=partial(timing.wall_per_call, calls=cfg.overhead_calls, sync=sync), **common)
        med = _timing_rows(
            results,
            "overhead",
            case,
            "wall_per_call",
            wall,
            checks,
            TOL_MM,
            note=f"synced wall time per call; {cfg.overhead_calls} calls/sample",
        )
        ctx.log(_line(f"overhead: {case}: wall/call", med))
        # keep the GPU busy for a few times the slowest CPU issue time, so the events see
        # only GPU execution
        cpu_medians = [s for n in fns if (s := cpu.summary(n)) is not None]
        issue = max([s["median"] for s in cpu_medians] or [1e-4])
        spin = timing.spin_cycles_for(max(1e-3, 4 * issue), hz)
        gpu = interleaved(fns, timer=partial(timing.gpu_time, spin_cycles=spin), **common)
        med = _timing_rows(
            results,
            "overhead",
            case,
            "gpu_time",
            gpu,
            checks,
            TOL_MM,
            note="GPU-only time of one call (CUDA events after a GPU spin)",
        )
        ctx.log(_line(f"overhead: {case}: gpu time", med))
        del fns, calls  # release the recordings before resetting
        reset_all()
    return results


# --------------------------------------------------------------------------------------------
# 2. decode


def run_decode(ctx: _Ctx) -> list[Result]:
    """Time per token of greedy-style decoding (teacher-forced tokens) at each batch size.

    Every contender wraps the same model (same weights, same static KV cache); each timed
    sample is one run of ``decode_steps`` steps from position 0, synchronized at both ends.

    Example::

        rows = run_decode(ctx)
    """
    from graphtree.demo.gpt import TinyGPT

    cfg = ctx.cfg
    results: list[Result] = []
    sync = torch.cuda.synchronize
    steps = min(cfg.decode_steps, cfg.gpt.max_seq)
    n_check = min(cfg.decode_check_steps, steps)
    for b in cfg.decode_batches:
        case = f"batch {b}"
        try:
            model = TinyGPT(cfg.gpt, b, device=DEVICE, seed=0)
            model.requires_grad_(False)
            toks = torch.randint(cfg.gpt.vocab, (steps, b, 1), generator=_gen(b)).to(DEVICE)
            positions = torch.arange(cfg.gpt.max_seq, device=DEVICE)
            model.reset_cache()
            ref = [snapshot(model.decode_step(toks[i], positions[i])) for i in range(n_check)]
        except Exception as exc:  # noqa: BLE001
            _skip_all(results, ctx, "decode", case, exc)
            continue

        # verify and run are called within this iteration only: the loop variables they read are current
        def verify(call: Callable[..., Any]) -> dict[str, Any]:
            model.reset_cache()  # noqa: B023
            return _merge_checks(
                [
                    compare(call(toks[i], positions[i]), ref[i], **TOL_LOGITS)  # noqa: B023
                    for i in range(n_check)
                ]
            )

        calls, checks = _build_all(
            ctx, "decode", case, model.decode_step, (toks[0], positions[0]), verify, results, prepare=model.reset_cache
        )

        def run(call: Callable[..., Any]) -> None:
            # positions >= the current one are masked, so no cache reset is needed between runs
            for i in range(steps):
                call(toks[i], positions[i])  # noqa: B023

        fns = {n: partial(run, c) for n, c in calls.items()}
        t = interleaved(
            fns,
            repeats=cfg.decode_repeats,
            warmup=cfg.decode_warmup,
            timer=timing.per_unit(partial(timing.wall_per_call, calls=1, sync=sync), steps),
            stop=ctx.budget.expired,
            min_repeats=MIN_REPEATS,
        )
        med = _timing_rows(
            results,
            "decode",
            case,
            "time_per_token",
            t,
            checks,
            TOL_LOGITS,
            note=f"one decode step (one token per sequence), {steps} steps/sample; "
            f"checked on {n_check} teacher-forced steps",
        )
        ctx.log(_line(f"decode: {case}: per token", med))
        if EAGER in med:
            for name, v in med.items():
                if name == EAGER:
                    continue
                results.append(
                    Result(
                        "decode",
                        case,
                        name,
                        "speedup",
                        med[EAGER] / v,
                        "x",
                        equal_to_eager=checks[name]["equal"],
                        note="eager time per token / this one",
                    )
                )
        del fns, calls  # release the recordings before resetting
        reset_all()
    return results


# --------------------------------------------------------------------------------------------
# 3. memory


def _bucketed(
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
        graphs: dict[int, HandGraph] = {}
        for s in sizes:
            graphs[s], secs = timed(lambda: HandGraph(fn, xs[s]))  # noqa: B023 - called at once; a private pool each
            report(s, secs)

        def call_hand(x: torch.Tensor) -> Any:
            return graphs[x.shape[0]](x)

        return call_hand, setup, [graphs]
    if name in COMPILED:
        skips = cudagraph_skips()
        call = stepped(compile_fn(name, fn), step_begin(name))
        first = xs[top].clone()
        _torch.mark_dynamic(first, 0)
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


def run_memory(ctx: _Ctx) -> list[Result]:
    """Bytes held by each contender's recordings of buckets 1, 8 and 32.

    Measured as the growth of ``torch.cuda.memory_reserved()`` from before the contender is
    built to after all its buckets are recorded, each read after synchronize, ``gc.collect()``
    and ``torch.cuda.empty_cache()`` (so only memory something still holds is counted).

    Example::

        rows = run_memory(ctx)
    """
    cfg = ctx.cfg
    results: list[Result] = []
    case = "buckets " + ",".join(str(b) for b in cfg.mem_buckets)
    try:
        mlp = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=1).to(DEVICE)
        xs = {b: _randn(b, cfg.mlp_tokens, cfg.mlp_d, seed=200 + b) for b in cfg.mem_buckets}
        refs = {b: snapshot(mlp(x)) for b, x in xs.items()}
    except Exception as exc:  # noqa: BLE001
        _skip_all(results, ctx, "memory", case, exc)
        return results
    for name in ctx.cfg.contenders:

        def one(name: str = name) -> list[Result]:
            if name in COMPILED:  # only compiling is slow enough to skip
                ctx.budget.check(f"{name} in memory")
            base = reserved_bytes()
            base_private = private_pool_bytes()
            call, setup, keep = _bucketed(name, mlp, xs)
            check = _merge_checks([compare(call(xs[b]), refs[b], **TOL_MLP) for b in xs])
            held = reserved_bytes() - base
            private = private_pool_bytes()
            extra = _check_extra(check, TOL_MLP)
            if private is not None and base_private is not None:
                extra["private_pool_bytes"] = private - base_private
            if name == GRAPHTREE:
                import graphtree

                extra["graphtree_pool_bytes"] = graphtree.stats().pool_bytes
            rows = [
                Result(
                    "memory",
                    case,
                    name,
                    "graph_bytes",
                    held,
                    "bytes",
                    equal_to_eager=check["equal"],
                    extra=extra,
                    note=setup["note"] or _MEMORY_NOTES.get(name, ""),
                )
            ]
            if "compile_s" in setup:
                rows.append(Result("memory", case, name, "compile_s", setup["compile_s"], "s"))
            ctx.log(
                f"memory: {name}: {format_value(held, 'bytes')} held for "
                f"{len(xs)} buckets, {'equal' if check['equal'] else 'DIFFERS'}"
            )
            del call, keep
            reset_all()
            return rows

        _run_logged(ctx, results, "memory", case, name, one)
    return results


_MEMORY_NOTES = {
    EAGER: "eager keeps no recordings (its cached blocks are released before reading)",
    HANDWRITTEN: "one CUDAGraph with its own private pool per bucket, plus static inputs",
    GRAPHTREE: "one tree, one shared pool; buckets recorded largest first",
}
for _c in COMPILED:
    _MEMORY_NOTES[_c] = "dynamic batch (mark_dynamic dim 0); cudagraph trees record each size"


# --------------------------------------------------------------------------------------------
# 4. capture time


def run_capture(ctx: _Ctx) -> list[Result]:
    """Seconds to record each bucket (1..N, largest first) and their total, per contender.

    The hand-written graphs and graphtree are rebuilt ``capture_repeats`` times (interleaved)
    and report medians; the compile contenders record once (their compile is reported apart
    as ``compile_s``). Eager records nothing and gets a not-applicable row.

    Example::

        rows = run_capture(ctx)
    """
    cfg = ctx.cfg
    results: list[Result] = []
    n = cfg.capture_buckets
    total_case = f"{n} buckets"
    report = [b for b in cfg.capture_report if b <= n]
    try:
        mlp = MLP(cfg.capture_d, cfg.capture_hidden, cfg.capture_layers, seed=2).to(DEVICE)
        xs = {b: _randn(b, cfg.capture_tokens, cfg.capture_d, seed=300 + b) for b in range(1, n + 1)}
        refs = {b: snapshot(mlp(xs[b])) for b in report}
    except Exception as exc:  # noqa: BLE001
        _skip_all(results, ctx, "capture", total_case, exc)
        return results

    names = list(ctx.cfg.contenders)
    if EAGER in names:
        results.append(
            Result(
                "capture",
                total_case,
                EAGER,
                "record_total_s",
                None,
                "s",
                note="eager records nothing",
                equal_to_eager=True,
            )
        )
    repeated = [c for c in names if c in (HANDWRITTEN, GRAPHTREE)]
    once = [c for c in names if c in COMPILED]
    per: dict[str, dict[int, list[float]]] = {c: {b: [] for b in xs} for c in repeated + once}
    totals: dict[str, list[float]] = {c: [] for c in repeated + once}
    checks: dict[str, dict[str, Any]] = {}
    compile_s: dict[str, float] = {}
    notes: dict[str, str] = {}
    dead: set[str] = set()

    def record(name: str, check: bool) -> None:
        times: dict[int, float] = {}
        call, setup, keep = _bucketed(name, mlp, xs, per_bucket=times.__setitem__)
        for b, secs in times.items():
            per[name][b].append(secs)
        totals[name].append(sum(times.values()))
        if "compile_s" in setup:
            compile_s[name] = setup["compile_s"]
        notes[name] = setup["note"]
        if check:
            checks[name] = _merge_checks([compare(call(xs[b]), refs[b], **TOL_MLP) for b in report])
        del call, keep
        reset_all()

    def record_repeated(name: str, check: bool) -> bool:
        record(name, check)
        return True

    rounds = max(cfg.capture_repeats, 1)
    for r in range(rounds):
        order = repeated[r % len(repeated) :] + repeated[: r % len(repeated)] if repeated else []
        for name in order:
            if name in dead:
                continue
            if r > 0 and ctx.budget.expired():
                continue  # keep the rounds done so far
            ok = _run_logged(ctx, results, "capture", total_case, name, partial(record_repeated, name, r == 0))
            if ok is None:
                dead.add(name)

    def record_once(name: str) -> bool:
        ctx.budget.check(f"{name} in capture")
        record(name, check=True)
        return True

    for name in once:
        ok = _run_logged(ctx, results, "capture", total_case, name, partial(record_once, name))
        if ok is None:
            dead.add(name)

    for name in repeated + once:
        if name in dead or not totals[name]:
            continue
        check = checks.get(name)
        eq = None if check is None else check["equal"]
        extra = _check_extra(check, TOL_MLP)
        note = notes.get(name, "")
        if name in COMPILED:
            note = note or (
                "calls until recorded (an eager run of the new shape, then the "
                "recording); size 1 may include a dynamo recompile"
            )
        for b in report:
            s = _summary(per[name][b])
            results.append(
                Result(
                    "capture",
                    f"bucket {b}",
                    name,
                    "record_s",
                    s["median"],
                    "s",
                    equal_to_eager=eq,
                    stats=s,
                    note=note,
                    extra=extra,
                )
            )
        s = _summary(totals[name])
        results.append(
            Result(
                "capture",
                total_case,
                name,
                "record_total_s",
                s["median"],
                "s",
                equal_to_eager=eq,
                stats=s,
                note=note,
                extra=extra,
            )
        )
        if name in compile_s:
            results.append(
                Result(
                    "capture",
                    total_case,
                    name,
                    "compile_s",
                    compile_s[name],
                    "s",
                    note="first call: trace + compile (not in record_s)",
                )
            )
        ctx.log(f"capture: {name}: {n} buckets in {format_value(s['median'], 's')}")
    reset_all()
    return results


def _summary(xs: list[float]) -> dict[str, float]:
    from graphtree.bench.harness import summarize

    return summarize(xs)


# --------------------------------------------------------------------------------------------
# 5. branching


def run_branching(ctx: _Ctx) -> list[Result]:
    """Memory of A->B, then also A->B', against the sum of separate graphs for A, B and B'.

    Each iteration is one step: ``begin(); h = A(x); y = B(h)`` (``B'`` on the second path);
    each path runs ``branch_iters`` iterations so it is warmed up, recorded and replayed. The
    reference sum: hand-written graphs of A, B and B' alone, each with its own pool (B and B'
    read A's static output in place), measured one after the other the same way as the
    contenders (reserved-bytes growth).

    Example::

        rows = run_branching(ctx)
    """
    cfg = ctx.cfg
    results: list[Result] = []
    case = f"A->B, A->B' (batch {cfg.branch_batch})"
    try:
        fa = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=11).to(DEVICE)
        fb = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=12).to(DEVICE)
        fbp = MLP(cfg.mlp_d, 2 * cfg.mlp_hidden, cfg.mlp_layers, seed=13).to(DEVICE)
        x = _randn(cfg.branch_batch, cfg.mlp_tokens, cfg.mlp_d, seed=400)
        h_ref = fa(x)
        ref_b = snapshot(fb(h_ref))
        ref_bp = snapshot(fbp(h_ref))
        del h_ref
        total_ref = _separate_sum(fa, fb, fbp, x)
    except Exception as exc:  # noqa: BLE001
        _skip_all(results, ctx, "branching", case, exc)
        return results
    ctx.log(f"branching: sum of separate graphs A+B+B' = {format_value(total_ref, 'bytes')}")

    for name in ctx.cfg.contenders:

        def one(name: str = name) -> list[Result]:
            if name in COMPILED:  # only compiling is slow enough to skip
                ctx.budget.check(f"{name} in branching")
            base = reserved_bytes()
            a, b, bp, begin, keep = _branch_contender(name, fa, fb, fbp, x)
            outs_b = outs_bp = None
            for _ in range(cfg.branch_iters):
                if begin is not None:
                    begin()
                outs_b = snapshot(b(a(x)))
            after_ab = reserved_bytes() - base
            for _ in range(cfg.branch_iters):
                if begin is not None:
                    begin()
                outs_bp = snapshot(bp(a(x)))
            after_both = reserved_bytes() - base
            check = _merge_checks([compare(outs_b, ref_b, **TOL_MLP), compare(outs_bp, ref_bp, **TOL_MLP)])
            eq = check["equal"]
            extra = _check_extra(check, TOL_MLP)
            extra["sum_separate_bytes"] = total_ref
            if name == GRAPHTREE:
                import graphtree

                st = graphtree.stats()
                extra.update(graphtree_pool_bytes=st.pool_bytes, trees=st.trees, recordings=st.recordings)
            note = graphtree_note() if name == GRAPHTREE else ""
            vs_sum_note = "bytes after both paths / sum of separate graphs A+B+B'"
            rows = [
                Result("branching", case, name, metric, value, unit, equal_to_eager=eq, extra=extra, note=row_note)
                for metric, value, unit, row_note in (
                    ("bytes_after_AB", after_ab, "bytes", note),
                    ("bytes_after_AB_ABp", after_both, "bytes", note),
                    ("vs_sum", after_both / total_ref if total_ref else 0.0, "x", vs_sum_note),
                )
            ]
            ctx.log(
                f"branching: {name}: A->B {format_value(after_ab, 'bytes')}, "
                f"+A->B' {format_value(after_both, 'bytes')} "
                f"({'equal' if eq else 'DIFFERS'})"
            )
            del a, b, bp, keep
            reset_all()
            return rows

        _run_logged(ctx, results, "branching", case, name, one)
    return results


def _separate_sum(fa: Callable[..., Any], fb: Callable[..., Any], fbp: Callable[..., Any], x: torch.Tensor) -> int:
    """Bytes of hand-written graphs A, B and B', each in its own pool, measured one by one."""
    reset_all()
    base = reserved_bytes()
    ga = HandGraph(fa, x)
    after_a = reserved_bytes()
    gb = HandGraph(fb, ga.output, clone_inputs=False)
    after_b = reserved_bytes()
    gbp = HandGraph(fbp, ga.output, clone_inputs=False)
    after_bp = reserved_bytes()
    total = (after_a - base) + (after_b - after_a) + (after_bp - after_b)
    del ga, gb, gbp
    reset_all()
    return total


def _branch_contender(
    name: str, fa: Callable[..., Any], fb: Callable[..., Any], fbp: Callable[..., Any], x: torch.Tensor
) -> tuple[Any, Any, Any, Any, list]:
    """``(a, b, b', begin, keep)`` of contender ``name`` for the branching scenario."""
    if name == EAGER:
        return fa, fb, fbp, None, []
    if name == HANDWRITTEN:
        ga = HandGraph(fa, x)
        gb = HandGraph(fb, ga.output, clone_inputs=False)
        gbp = HandGraph(fbp, ga.output, clone_inputs=False)
        return ga, gb, gbp, None, [ga, gb, gbp]
    if name in COMPILED:
        a, b, bp = (compile_fn(name, f) for f in (fa, fb, fbp))
        return a, b, bp, step_begin(name), [a, b, bp]
    if name == GRAPHTREE:
        import graphtree

        a, b, bp = (graphtree.graphed(f) for f in (fa, fb, fbp))
        return a, b, bp, graphtree.mark_step, [a, b, bp]
    raise ValueError(f"unknown contender {name!r}")


def _run_share(ctx: _Ctx) -> list[Result]:
    from graphtree.bench.share import run_share  # spawns consumer processes only when it runs

    return run_share(ctx)


def _run_generate(ctx: _Ctx) -> list[Result]:
    from graphtree.bench.generate import run_generate  # imports transformers only when it runs

    return run_generate(ctx)


# --------------------------------------------------------------------------------------------
# the run


RUNNERS: dict[str, Callable[[_Ctx], list[Result]]] = {
    "overhead": run_overhead,
    "decode": run_decode,
    "memory": run_memory,
    "capture": run_capture,
    "branching": run_branching,
    "generate": _run_generate,
    "share": _run_share,
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
    ctx = _Ctx(cfg, budget, log)
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
