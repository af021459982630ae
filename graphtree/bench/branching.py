"""The ``branching`` scenario: memory of A->B and then A->B' in one tree, against separate graphs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphtree.bench import contenders, kit
from graphtree.bench.contenders import (
    COMPILED,
    EAGER,
    GRAPHTREE,
    HANDWRITTEN,
    compare,
    graphtree_note,
    reserved_bytes,
    reset_all,
    snapshot,
    step_begin,
)
from graphtree.bench.harness import Result, format_value
from graphtree.bench.kit import TOL_MLP, Ctx, check_extra, merge_checks, randn, run_logged, skip_all
from graphtree.bench.workloads import MLP


def run_branching(ctx: Ctx) -> list[Result]:
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
        fa = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=11).to(kit.DEVICE)
        fb = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=12).to(kit.DEVICE)
        fbp = MLP(cfg.mlp_d, 2 * cfg.mlp_hidden, cfg.mlp_layers, seed=13).to(kit.DEVICE)
        x = randn(cfg.branch_batch, cfg.mlp_tokens, cfg.mlp_d, seed=400)
        h_ref = fa(x)
        ref_b = snapshot(fb(h_ref))
        ref_bp = snapshot(fbp(h_ref))
        del h_ref
        total_ref = _separate_sum(fa, fb, fbp, x)
    except Exception as exc:  # noqa: BLE001
        skip_all(results, ctx, "branching", case, exc)
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
            check = merge_checks([compare(outs_b, ref_b, **TOL_MLP), compare(outs_bp, ref_bp, **TOL_MLP)])
            eq = check["equal"]
            extra = check_extra(check, TOL_MLP)
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

        run_logged(ctx, results, "branching", case, name, one)
    return results


def _separate_sum(fa: Callable[..., Any], fb: Callable[..., Any], fbp: Callable[..., Any], x: torch.Tensor) -> int:
    """Bytes of hand-written graphs A, B and B', each in its own pool, measured one by one."""
    reset_all()
    base = reserved_bytes()
    ga = contenders.HandGraph(fa, x)
    after_a = reserved_bytes()
    gb = contenders.HandGraph(fb, ga.output, clone_inputs=False)
    after_b = reserved_bytes()
    gbp = contenders.HandGraph(fbp, ga.output, clone_inputs=False)
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
        ga = contenders.HandGraph(fa, x)
        gb = contenders.HandGraph(fb, ga.output, clone_inputs=False)
        gbp = contenders.HandGraph(fbp, ga.output, clone_inputs=False)
        return ga, gb, gbp, None, [ga, gb, gbp]
    if name in COMPILED:
        a, b, bp = (contenders.compile_fn(name, f) for f in (fa, fb, fbp))
        return a, b, bp, step_begin(name), [a, b, bp]
    if name == GRAPHTREE:
        import graphtree

        a, b, bp = (graphtree.graphed(f) for f in (fa, fb, fbp))
        return a, b, bp, graphtree.mark_step, [a, b, bp]
    raise ValueError(f"unknown contender {name!r}")
