"""The ``memory`` scenario: bytes each contender's recordings of several batch buckets keep reserved."""

from __future__ import annotations

from graphtree.bench import kit
from graphtree.bench.contenders import (
    COMPILED,
    EAGER,
    GRAPHTREE,
    HANDWRITTEN,
    compare,
    private_pool_bytes,
    reserved_bytes,
    reset_all,
    snapshot,
)
from graphtree.bench.harness import Result, format_value
from graphtree.bench.kit import TOL_MLP, Ctx, bucketed, check_extra, merge_checks, randn, run_logged, skip_all
from graphtree.bench.workloads import MLP


def run_memory(ctx: Ctx) -> list[Result]:
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
        mlp = MLP(cfg.mlp_d, cfg.mlp_hidden, cfg.mlp_layers, seed=1).to(kit.DEVICE)
        xs = {b: randn(b, cfg.mlp_tokens, cfg.mlp_d, seed=200 + b) for b in cfg.mem_buckets}
        refs = {b: snapshot(mlp(x)) for b, x in xs.items()}
    except Exception as exc:  # noqa: BLE001
        skip_all(results, ctx, "memory", case, exc)
        return results
    for name in ctx.cfg.contenders:

        def one(name: str = name) -> list[Result]:
            if name in COMPILED:  # only compiling is slow enough to skip
                ctx.budget.check(f"{name} in memory")
            base = reserved_bytes()
            base_private = private_pool_bytes()
            call, setup, keep = bucketed(name, mlp, xs)
            check = merge_checks([compare(call(xs[b]), refs[b], **TOL_MLP) for b in xs])
            held = reserved_bytes() - base
            private = private_pool_bytes()
            extra = check_extra(check, TOL_MLP)
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

        run_logged(ctx, results, "memory", case, name, one)
    return results


_MEMORY_NOTES = {
    EAGER: "eager keeps no recordings (its cached blocks are released before reading)",
    HANDWRITTEN: "one CUDAGraph with its own private pool per bucket, plus static inputs",
    GRAPHTREE: "one tree, one shared pool; buckets recorded largest first",
}
for _c in COMPILED:
    _MEMORY_NOTES[_c] = "dynamic batch (mark_dynamic dim 0); cudagraph trees record each size"
