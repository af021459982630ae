"""The ``decode`` scenario: time per token of a TinyGPT decode loop at each batch size, per contender."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from graphtree.bench import kit, timing
from graphtree.bench.contenders import EAGER, compare, reset_all, snapshot
from graphtree.bench.harness import Result, interleaved
from graphtree.bench.kit import MIN_REPEATS, TOL_LOGITS, Ctx, build_all, gen, line, merge_checks, skip_all, timing_rows


def run_decode(ctx: Ctx) -> list[Result]:
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
            model = TinyGPT(cfg.gpt, b, device=kit.DEVICE, seed=0)
            model.requires_grad_(False)
            toks = torch.randint(cfg.gpt.vocab, (steps, b, 1), generator=gen(b)).to(kit.DEVICE)
            positions = torch.arange(cfg.gpt.max_seq, device=kit.DEVICE)
            model.reset_cache()
            ref = [snapshot(model.decode_step(toks[i], positions[i])) for i in range(n_check)]
        except Exception as exc:  # noqa: BLE001
            skip_all(results, ctx, "decode", case, exc)
            continue

        # verify and run are called within this iteration only: the loop variables they read are current
        def verify(call: Callable[..., Any]) -> dict[str, Any]:
            model.reset_cache()  # noqa: B023
            return merge_checks(
                [
                    compare(call(toks[i], positions[i]), ref[i], **TOL_LOGITS)  # noqa: B023
                    for i in range(n_check)
                ]
            )

        calls, checks = build_all(
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
        med = timing_rows(
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
        ctx.log(line(f"decode: {case}: per token", med))
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
