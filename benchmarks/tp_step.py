"""Collectives inside recordings (issue 31): checks and timings under ``torchrun``.

    torchrun --nproc-per-node 2 benchmarks/tp_step.py --check --out DIR   # DIR/rankN.json
    torchrun --nproc-per-node 2 benchmarks/tp_step.py --bench --json out.json

``--check``: each collective (all-reduce, all-gather, reduce-scatter, broadcast, a functional
all-reduce) in a graphed function, the tensor-parallel MLP and decode step of
:mod:`graphtree.demo.tp`, all equal to the same code run eagerly on every call; with two or more
ranks also a fallback forced on rank 1 (a host copy there only: every rank falls back, with rank 1's
reason) and a rank that cannot follow (rank 1 skips a call: rank 0 raises ``LockstepTimeout`` within
its ``lockstep_timeout``). With ``--out DIR`` each rank writes its results to ``DIR/rankN.json``,
which tests/gpu/test_collectives_gpu.py reads.

``--bench``: time per step of the tensor-parallel decode step and MLP: eager, graphtree,
``torch.compile(mode="reduce-overhead")`` and a hand-written ``torch.cuda.graph`` capture (inputs
copied in), medians of ``--repeats`` rounds of ``--steps`` steps, each round started together.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import graphtree
from graphtree import _torch
from graphtree.demo.gpt import GPTConfig, TinyGPT, _Block
from graphtree.demo.tp import ParallelGPT, ParallelMLP
from graphtree.tree.lockstep import LockstepTimeout


def _setup(eager_init: bool) -> tuple[int, int, torch.device]:
    """The NCCL group, its communicator made at the first collective as most programs leave it (or at
    once, ``eager_init``: ``device_id=``)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device if eager_init else None)
    return dist.get_rank(), dist.get_world_size(), device


def _phase(rank: int, what: str) -> None:
    """Where this rank is, on stderr: a rank that stops is found by its last phase."""
    print(f"TP_PHASE rank {rank} {time.monotonic():.1f}: {what}", file=sys.stderr, flush=True)


def _inputs(call: int, rank: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=gen).to(device)


def _delta(before: graphtree.Stats, after: graphtree.Stats) -> dict[str, Any]:
    eager = {k: v - before.eager.get(k, 0) for k, v in after.eager.items() if v != before.eager.get(k, 0)}
    return {k: getattr(after, k) - getattr(before, k) for k in ("recordings", "replays", "warmups", "agreements")} | {
        "eager": eager
    }


def _compare(
    name: str, fn: Callable[..., torch.Tensor], make: Callable[[int], tuple[Any, ...]], calls: int = 6, **options: Any
) -> dict[str, Any]:
    """``fn`` graphed (with ``options``) against ``fn`` eager on ``calls`` calls: equal each time, and
    what the tree did."""
    g = graphtree.graphed(fn, name=name, **options)
    before = graphtree.stats()
    equal = []
    for call in range(calls):
        args = make(call)
        want = fn(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
        got = g(*args)
        equal.append(bool(torch.equal(want, got)))
    torch.cuda.synchronize()
    return {"name": name, "equal": equal} | _delta(before, graphtree.stats())


def check(rank: int, world: int, device: torch.device) -> dict[str, Any]:
    shape = (8, 1024)
    group = cast(dist.ProcessGroup, dist.group.WORLD)

    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    def all_gather(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((world * x.shape[0], *x.shape[1:]), device=x.device, dtype=x.dtype)
        dist.all_gather_into_tensor(out, x * 2)
        return out

    def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), device=x.device, dtype=x.dtype)
        dist.reduce_scatter_tensor(out, x * 2)
        return out

    def broadcast(x: torch.Tensor) -> torch.Tensor:
        y = x * 2 + rank
        dist.broadcast(y, src=0)
        return y

    def functional_all_reduce(x: torch.Tensor) -> torch.Tensor:
        return fc.all_reduce(x * 2, "sum", group) + 1

    results: dict[str, Any] = {"rank": rank, "world": world, "device": torch.cuda.get_device_name(device)}
    ops = [all_reduce, all_gather, reduce_scatter, broadcast, functional_all_reduce]
    results["collectives"] = []
    for f in ops:
        _phase(rank, f.__name__)
        results["collectives"].append(_compare(f.__name__, f, lambda c: (_inputs(c, rank, shape, device),)))
    _phase(rank, "mlp")

    full = TinyGPT(GPTConfig(n_layer=4, d_model=512, n_head=8, vocab=4096, max_seq=64), batch=2, device=device)
    full.requires_grad_(False)  # inference weights
    blk = cast(_Block, full.blocks[0])
    mlp = ParallelMLP(blk.fc, blk.fc_out, group)
    results["mlp"] = _compare("tp_mlp", mlp, lambda c: (_inputs(c, 7, (16, 512), device),))

    _phase(rank, "decode")
    eager_tp, graphed_tp = ParallelGPT(full, group), ParallelGPT(full, group)
    step = graphtree.graphed(graphed_tp.decode_step, name="tp_decode_step")
    before = graphtree.stats()
    equal, close = [], []
    for p in range(24):
        tokens = _inputs(p, 99, (2, 1), device).abs().mul(1000).long() % full.cfg.vocab
        pos = torch.tensor(p, device=device)
        want, got, whole = eager_tp.decode_step(tokens, pos), step(tokens, pos), full.decode_step(tokens, pos)
        equal.append(bool(torch.equal(want, got)))
        close.append(float((got - whole).abs().max()))
    torch.cuda.synchronize()
    results["decode"] = {"equal": equal, "max_diff_to_whole_model": max(close)} | _delta(before, graphtree.stats())

    # a capture no warm-up agreed on: eager
    _phase(rank, "no_warm_up")
    results["no_warm_up"] = _compare(
        "no_warm_up", all_reduce, lambda c: (_inputs(c, rank, shape, device),), calls=3, warmup=0
    )

    if world > 1:
        _phase(rank, "forced_fallback")
        results["forced_fallback"] = forced_fallback(rank, device)
        _phase(rank, "cannot_follow")
        results["cannot_follow"] = cannot_follow(rank, device)
    _phase(rank, "checks done")
    results["stats"] = str(graphtree.stats())
    return results


def forced_fallback(rank: int, device: torch.device) -> dict[str, Any]:
    """Rank 1 alone copies a result to the host: every rank runs the function eagerly, with its reason."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        dist.all_reduce(y)
        if rank == 1:
            step.host = y.cpu()  # type: ignore[attr-defined]
        return y - 1

    return _compare("forced_fallback", step, lambda c: (_inputs(c, rank, (8, 1024), device),), calls=4)


def cannot_follow(rank: int, device: torch.device, timeout: float = 5.0) -> dict[str, Any]:
    """Rank 1 skips the second call: rank 0, which records it, raises within ``timeout`` seconds."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x + 1
        dist.all_reduce(y)
        return y

    g = graphtree.graphed(step, name="cannot_follow", lockstep_timeout=timeout)
    g(_inputs(0, rank, (8, 1024), device))  # the warm-up, on every rank
    out: dict[str, Any] = {"timeout": timeout, "outcome": "skipped"}
    if rank == 0:
        t0 = time.monotonic()
        try:
            g(_inputs(1, rank, (8, 1024), device))
            out["outcome"] = "no error"
        except LockstepTimeout as e:
            out |= {"outcome": "LockstepTimeout", "message": str(e)}
        out["waited_s"] = round(time.monotonic() - t0, 2)
    return out


def _time(fn: Callable[[], Any], steps: int, repeats: int) -> list[float]:
    """Milliseconds per step in each of ``repeats`` rounds, every rank starting each round together."""
    per_step = []
    for _ in range(repeats):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        per_step.append((time.perf_counter() - t0) * 1e3 / steps)
    return per_step


def _hand_graph(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...]) -> Callable[..., torch.Tensor]:
    """A ``torch.cuda.graph`` capture of ``fn`` on static copies of ``args`` (three eager runs first)."""
    static = [a.clone() for a in args]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn(*static)

    def replay(*new: torch.Tensor) -> torch.Tensor:
        for s, a in zip(static, new):
            s.copy_(a)
        graph.replay()
        return out

    return replay


def bench(rank: int, world: int, device: torch.device, steps: int, repeats: int) -> dict[str, Any]:
    full = TinyGPT(GPTConfig(n_layer=8, d_model=512, n_head=8, vocab=8192, max_seq=128), batch=1, device=device)
    full.requires_grad_(False)
    tokens = torch.zeros(1, 1, dtype=torch.long, device=device)
    pos = torch.tensor(5, device=device)
    blk = cast(_Block, full.blocks[0])
    mlp = ParallelMLP(blk.fc, blk.fc_out, dist.group.WORLD)
    x = _inputs(0, 0, (8, 512), device)
    cases: dict[str, tuple[Callable[[], Callable[..., Any]], tuple[torch.Tensor, ...]]] = {
        "decode_step": (lambda: ParallelGPT(full, dist.group.WORLD).decode_step, (tokens, pos)),
        "mlp": (lambda: mlp, (x,)),
    }
    rows: list[dict[str, Any]] = []
    for case, (make, args) in cases.items():
        ways: dict[str, Callable[..., Any]] = {}
        first: dict[str, list[float]] = {}  # seconds: making it (a hand capture captures), then each first call
        for way in ("eager", "graphtree", "reduce-overhead", "torch.cuda.graph"):
            fn = make()
            dist.barrier()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                if way == "graphtree":
                    fn = graphtree.graphed(fn, name=f"{case}")
                elif way == "reduce-overhead":
                    fn = torch.compile(fn, mode="reduce-overhead")
                elif way == "torch.cuda.graph":
                    fn = _hand_graph(fn, args)
                marks = [time.perf_counter()]
                for _ in range(3):
                    fn(*args)
                    torch.cuda.synchronize()
                    marks.append(time.perf_counter())
            except Exception as e:  # noqa: BLE001 - a contender that cannot run here is reported, not fatal
                rows.append({"case": case, "way": way, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                continue
            first[way] = [b - a for a, b in zip([t0, *marks], marks)]
            ways[way] = fn
        # the graphtree way's agreements: how much of its first calls waited on the other ranks
        lockstep = getattr(ways.get("graphtree"), "graphed_callable", ways.get("graphtree"))
        agree_s = getattr(getattr(lockstep, "lockstep", lambda: None)(), "seconds", None)
        times: dict[str, list[float]] = {w: [] for w in ways}
        for r in range(repeats):  # interleaved: each round times every way, in a rotated order
            order = list(ways)[r % len(ways) :] + list(ways)[: r % len(ways)]
            for way in order:
                times[way] += _time(functools.partial(ways[way], *args), steps, 1)
        eager = statistics.median(times["eager"])
        for way, ts in times.items():
            med = statistics.median(ts)
            rows.append(
                {
                    "case": case,
                    "way": way,
                    "ms_per_step": round(med, 4),
                    "vs_eager": round(med / eager, 3),
                    "first_three_calls_s": round(sum(first[way]), 3),
                    "making_then_each_first_call_s": [round(t, 4) for t in first[way]],
                    **({"agreements_s": round(agree_s, 4)} if way == "graphtree" and agree_s is not None else {}),
                    "rounds_ms": [round(t, 4) for t in ts],
                }
            )
    return {
        "rank": rank,
        "world": world,
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "steps": steps,
        "repeats": repeats,
        "rows": rows,
        "stats": str(graphtree.stats()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="rank 0 writes the bench's rows here")
    ap.add_argument("--stuck-after", type=float, default=150.0, help="seconds before a rank counts as stuck")
    ap.add_argument("--out", default=None, help="--check: each rank writes rank{N}.json into this folder")
    a = ap.parse_args()
    rank, world, device = _setup(eager_init=not a.check)
    # A rank stuck past --stuck-after writes every thread's stack (to OUT/rankN.stuck with --out,
    # else stderr) and again every --stuck-after seconds: a failure that says where.
    stuck = open(os.path.join(a.out, f"rank{rank}.stuck"), "w") if a.out else sys.stderr  # noqa: SIM115
    faulthandler.dump_traceback_later(a.stuck_after, repeat=True, file=stuck)
    try:
        if a.check:
            result = check(rank, world, device)
            if a.out:  # one file per rank: the ranks' prints interleave
                with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
                    json.dump(result, f)
            print(f"TP_CHECK rank {rank}: {result['stats']}", flush=True)
        if a.bench:
            out = bench(rank, world, device, a.steps, a.repeats)
            if rank == 0:
                for row in out["rows"]:
                    print(json.dumps({k: v for k, v in row.items() if k != "rounds_ms"}), flush=True)
                if a.json:
                    with open(a.json, "w") as f:
                        json.dump(out, f, indent=1)
        _phase(rank, "barrier")
        dist.barrier()
        # NCCL cannot destroy a communicator while a CUDA graph that captured its collectives lives
        # (pytorch/pytorch#115388): graphtree drops its own recordings in destroy_process_group;
        # reduce-overhead's graphs go with torch.compile's caches.
        _torch.reset_compiled()
        _phase(rank, "destroy_process_group")
        dist.destroy_process_group()
        _phase(rank, "done")
        faulthandler.cancel_dump_traceback_later()
    except BaseException:  # noqa: BLE001 - Ctrl-C too: any rank that stops must not hang the others
        # A rank that fails leaves collectives in flight, and tearing its group down then waits for
        # peers that wait for it: torchrun would not end. Say why, and leave at once.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
