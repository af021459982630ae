"""The ``overhead`` scenario: CPU, wall and GPU time per call of 1-, 16- and 64-kernel functions, per contender."""

from __future__ import annotations

from functools import partial

import torch

from graphtree.bench import kit, timing
from graphtree.bench.contenders import compare, reset_all, snapshot
from graphtree.bench.harness import Result, interleaved
from graphtree.bench.kit import MIN_REPEATS, TOL_MM, Ctx, Rounds, build_all, line, randn, skip_all, timing_rows
from graphtree.bench.workloads import MMChain


def run_overhead(ctx: Ctx) -> list[Result]:
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
            model = MMChain(k, cfg.mm_dim, seed=k).to(kit.DEVICE)
            x = randn(cfg.mm_rows, cfg.mm_dim, seed=100 + k)
            ref = snapshot(model(x))
        except Exception as exc:  # noqa: BLE001
            skip_all(results, ctx, "overhead", case, exc)
            continue
        calls, checks = build_all(
            ctx,
            "overhead",
            case,
            model,
            (x,),
            lambda call: compare(call(x), ref, **TOL_MM),  # noqa: B023 - used in this iteration only
            results,
        )
        fns = {n: partial(c, x) for n, c in calls.items()}
        common = Rounds(
            repeats=cfg.overhead_repeats, warmup=cfg.overhead_warmup, stop=ctx.budget.expired, min_repeats=MIN_REPEATS
        )
        cpu = interleaved(fns, timer=partial(timing.cpu_per_call, calls=cfg.overhead_calls, sync=sync), **common)
        med = timing_rows(
            results,
            "overhead",
            case,
            "cpu_per_call",
            cpu,
            checks,
            TOL_MM,
            note=f"CPU time per call, no sync; {cfg.overhead_calls} calls/sample",
        )
        ctx.log(line(f"overhead: {case}: cpu/call", med))
        wall = interleaved(fns, timer=partial(timing.wall_per_call, calls=cfg.overhead_calls, sync=sync), **common)
        med = timing_rows(
            results,
            "overhead",
            case,
            "wall_per_call",
            wall,
            checks,
            TOL_MM,
            note=f"synced wall time per call; {cfg.overhead_calls} calls/sample",
        )
        ctx.log(line(f"overhead: {case}: wall/call", med))
        # keep the GPU busy for a few times the slowest CPU issue time, so the events see
        # only GPU execution
        cpu_medians = [s for n in fns if (s := cpu.summary(n)) is not None]
        issue = max([s["median"] for s in cpu_medians] or [1e-4])
        spin = timing.spin_cycles_for(max(1e-3, 4 * issue), hz)
        gpu = interleaved(fns, timer=partial(timing.gpu_time, spin_cycles=spin), **common)
        med = timing_rows(
            results,
            "overhead",
            case,
            "gpu_time",
            gpu,
            checks,
            TOL_MM,
            note="GPU-only time of one call (CUDA events after a GPU spin)",
        )
        ctx.log(line(f"overhead: {case}: gpu time", med))
        del fns, calls  # release the recordings before resetting
        reset_all()
    return results
