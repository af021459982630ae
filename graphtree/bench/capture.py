"""The ``capture`` scenario: seconds to record each bucket and all of them, per contender."""

from __future__ import annotations

from functools import partial
from typing import Any

from graphtree.bench import kit
from graphtree.bench.contenders import COMPILED, EAGER, GRAPHTREE, HANDWRITTEN, compare, reset_all, snapshot
from graphtree.bench.harness import Result, format_value
from graphtree.bench.kit import TOL_MLP, Ctx, bucketed, check_extra, merge_checks, randn, run_logged, skip_all, summary
from graphtree.bench.workloads import MLP


def run_capture(ctx: Ctx) -> list[Result]:
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
        mlp = MLP(cfg.capture_d, cfg.capture_hidden, cfg.capture_layers, seed=2).to(kit.DEVICE)
        xs = {b: randn(b, cfg.capture_tokens, cfg.capture_d, seed=300 + b) for b in range(1, n + 1)}
        refs = {b: snapshot(mlp(xs[b])) for b in report}
    except Exception as exc:  # noqa: BLE001
        skip_all(results, ctx, "capture", total_case, exc)
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
        call, setup, keep = bucketed(name, mlp, xs, per_bucket=times.__setitem__)
        for b, secs in times.items():
            per[name][b].append(secs)
        totals[name].append(sum(times.values()))
        if "compile_s" in setup:
            compile_s[name] = setup["compile_s"]
        notes[name] = setup["note"]
        if check:
            checks[name] = merge_checks([compare(call(xs[b]), refs[b], **TOL_MLP) for b in report])
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
            ok = run_logged(ctx, results, "capture", total_case, name, partial(record_repeated, name, r == 0))
            if ok is None:
                dead.add(name)

    def record_once(name: str) -> bool:
        ctx.budget.check(f"{name} in capture")
        record(name, check=True)
        return True

    for name in once:
        ok = run_logged(ctx, results, "capture", total_case, name, partial(record_once, name))
        if ok is None:
            dead.add(name)

    for name in repeated + once:
        if name in dead or not totals[name]:
            continue
        check = checks.get(name)
        eq = None if check is None else check["equal"]
        extra = check_extra(check, TOL_MLP)
        note = notes.get(name, "")
        if name in COMPILED:
            note = note or (
                "calls until recorded (an eager run of the new shape, then the "
                "recording); size 1 may include a dynamo recompile"
            )
        for b in report:
            s = summary(per[name][b])
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
        s = summary(totals[name])
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
