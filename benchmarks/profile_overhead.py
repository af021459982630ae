"""What profiling costs a graphed decode loop: wall time with and without it (run on a GPU).

Usage::

    python benchmarks/profile_overhead.py                  # synthetic step, torch + graphtree loops
    python benchmarks/profile_overhead.py --mode torch --steps 400 --rounds 9
    python benchmarks/profile_overhead.py --workload gpt   # the decode benchmark's TinyGPT, batch 1 and 32

``--workload decode``: a decode-like step (``layers`` x [matmul, GELU, residual add, layer norm],
then an argmax "token") captured once, before profiling; the loop replays it ``steps`` times and
waits for each step. ``--workload gpt``: ``TinyGPT`` (12 layers, d=768, GPT-2 small shapes)
``decode_step`` graphed with ``graphtree.graphed``, ``mark_step()`` before every call, ``steps``
calls then one synchronize (as the decode benchmark times it), at each batch of ``--batches``.

Variants, interleaved (order rotated and flipped every round, so drift hits all): ``plain``;
``activity_floor``: CUPTI kernel/memcpy/memset activity through raw libcupti buffers with a no-op
consumer - what CUPTI's tracing costs by itself; ``callback_floor``: cupti-python's launch and
graph-node callbacks to a no-op Python function; ``profiled``: graphtree.profile. Medians per
variant; the overhead is the median profiled time over the median plain time, minus one. The
profiled time covers the loop only; start and stop are reported apart (``start_ms``/``stop_ms``,
and ``stop_timings_ms`` per teardown step).

What is printed (JSON on stdout, one summary line per case on stderr):

* ``plain_step_us`` / ``profiled_step_us``: wall time of one step;
* ``overhead_step_us`` / ``overhead_pct``: what profiling adds (the <= 5% target);
* ``activity_floor_pct`` / ``callback_floor_pct``: the floors, in percent of plain;
  ``above_activity_floor_pct``: profiled over the activity floor (graphtree's own share);
* ``overhead_incl_stop_pct``: the overhead with ``stop_ms`` (flush + aggregation) spread over the loop;
* ``kernels_per_step``, ``buffer_path`` (``libcupti (...)`` or ``cupti-python``).

``mode="torch"`` replays a ``torch.cuda.CUDAGraph``; ``mode="graphtree"`` calls a
``graphtree.graphed`` function (recorded during warm-up). The exit status is 0 when every overhead is
within ``--threshold`` (default 0.05).

Example::

    >>> from benchmarks/profile_overhead.py import measure_overhead
    >>> r = measure_overhead(mode="torch")                       # doctest: +SKIP
    >>> r["overhead"] <= 0.05                                     # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

__graphtree_profile_internal__ = True  # its frames are machinery to graphtree.profile, never a call site

__all__ = ["main", "measure_overhead"]


def _decode_step(layers: int, width: int, batch: int) -> Any:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(width, width, device="cuda", generator=g) / width**0.5 for _ in range(layers)]
    x = torch.randn(batch, width, device="cuda", generator=g)

    def step(h: torch.Tensor) -> torch.Tensor:
        for w in ws:
            h = torch.nn.functional.gelu(h @ w) + h
            h = torch.nn.functional.layer_norm(h, (width,))
        return h.argmax(-1)

    return step, x


def _loop_torch(step: Callable[..., Any], x: Any, steps: int) -> Callable[[], None]:
    import torch

    from graphtree.bench.contenders import HandGraph

    hand = HandGraph(step, x, warmup=3)  # the loop holds it: the graph reads its static input
    torch.cuda.synchronize()

    def loop() -> None:
        sync = torch.cuda.synchronize
        for _ in range(steps):
            hand.graph.replay()
            sync()

    return loop


def _loop_graphtree(step: Callable[..., Any], x: Any, steps: int) -> Callable[[], None]:
    import torch

    import graphtree

    fn = graphtree.graphed(step)
    for _ in range(5):
        graphtree.mark_step()
        fn(x)
    torch.cuda.synchronize()

    def loop() -> None:
        sync = torch.cuda.synchronize
        mark = graphtree.mark_step
        for _ in range(steps):
            mark()
            fn(x)
            sync()

    return loop


def _loop_gpt(batch: int, steps: int) -> Callable[..., None]:
    """The decode benchmark's replay loop: TinyGPT (12 layers, d=768) ``decode_step`` graphed
    with ``graphtree.graphed``, ``mark_step()`` before every call, synchronized at the end."""
    import torch

    import graphtree
    from graphtree.demo.gpt import GPTConfig, TinyGPT

    cfg = GPTConfig()
    model = TinyGPT(cfg, batch, device="cuda", seed=0)
    model.requires_grad_(False)
    gen = torch.Generator().manual_seed(batch)
    toks = torch.randint(cfg.vocab, (cfg.max_seq, batch, 1), generator=gen).to("cuda")
    positions = torch.arange(cfg.max_seq, device="cuda")
    fn = graphtree.graphed(model.decode_step)
    for i in range(4):  # warm-up, then the recording
        graphtree.mark_step()
        fn(toks[i], positions[i])
    torch.cuda.synchronize()
    n = cfg.max_seq

    def loop(on_step: Callable[[], None] | None = None) -> None:
        mark = graphtree.mark_step
        if on_step is None:
            for i in range(steps):
                mark()
                fn(toks[i % n], positions[i % n])
        else:  # sampled profiling: prof.step() once per step
            for i in range(steps):
                mark()
                fn(toks[i % n], positions[i % n])
                on_step()
        torch.cuda.synchronize()

    return loop


class _ActivityFloor:
    """What CUPTI's activity tracing costs by itself: the same activity kinds, flush period and
    buffer size as graphtree.profile, raw libcupti buffers (ctypes), a consumer that only counts
    bytes and hands the buffer back."""

    def __init__(self, buffer_size: int = 8 << 20, flush_period_ms: int = 1000, memcpy: bool = True) -> None:
        from graphtree.profile import _rawbuf
        from graphtree.profile._session import load_cupti

        cupti = load_cupti()
        self.backend = _rawbuf.open_backend(cupti)
        self.pool = _rawbuf.BufferPool(buffer_size)
        ak = cupti.ActivityKind
        self.kinds = [int(ak.CONCURRENT_KERNEL)] + ([int(ak.MEMCPY), int(ak.MEMSET)] if memcpy else [])
        self.flush_period_ms = flush_period_ms
        self.bytes = 0

    def _done(self, addr: int, size: int, valid: int) -> None:
        self.bytes += valid
        self.pool.give(addr)

    def start(self) -> None:
        b = self.backend
        b.register(self.pool.take, self._done)
        if self.flush_period_ms > 0 and b.has_flush_period:
            b.flush_period(self.flush_period_ms)
        for k in self.kinds:
            b.enable(k)

    def stop(self) -> None:
        b = self.backend
        b.flush_all(1)
        for k in self.kinds:
            b.disable(k)
        b.flush_all(1)
        if self.flush_period_ms > 0 and b.has_flush_period:
            b.flush_period(0)
        b.release()


class _CallbackFloor:
    """What cupti-python's callback dispatch costs by itself: the launch and graph-node callbacks
    graphtree.profile subscribes to, delivered to a Python function that does nothing."""

    def __init__(self) -> None:
        from graphtree.profile._model import ProfileData, ProfileOptions
        from graphtree.profile._session import Session, load_cupti

        self.cupti = load_cupti()
        domains, _, launch_ids, resource_ids = Session(ProfileData(), ProfileOptions())._resolve_ids(self.cupti)
        self.ids = launch_ids + [(domains["resource"], c) for c in resource_ids.values()]
        self.sub: Any = None
        self.calls = 0

    def _cb(self, userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
        self.calls += 1

    def start(self) -> None:
        self.sub = self.cupti.subscribe(self._cb, 0)
        for d, c in self.ids:
            self.cupti.enable_callback(1, self.sub, d, c)

    def stop(self) -> None:
        for d, c in self.ids:
            self.cupti.enable_callback(0, self.sub, d, c)
        self.cupti.unsubscribe(self.sub)
        self.sub = None


def measure_overhead(
    *,
    mode: str = "torch",
    layers: int = 16,
    width: int = 2048,
    batch: int = 4,
    steps: int = 300,
    rounds: int = 7,
    keep_records: bool = True,
    defer_records: int | None = None,
    workload: str = "decode",
    floor: bool = True,
    raw_buffers: bool = True,
    flush_period_ms: int | None = None,
    sample: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """Time the replay loop plain, under CUPTI alone (the floors) and profiled, interleaved.

    Variants of one round, in an order that rotates every round: ``plain``; ``activity_floor``
    (raw libcupti activity, no-op consumer: what CUPTI's kernel tracing costs by itself);
    ``callback_floor`` (cupti-python launch callbacks to a no-op Python function); ``profiled``
    (graphtree.profile). ``workload="gpt"`` runs the decode benchmark's TinyGPT loop (``batch``).

    Example::

        r = measure_overhead(mode="graphtree", steps=200)
        print(f"{100 * r['overhead']:.1f}% ({r['plain_ms']:.1f} ms -> {r['profiled_ms']:.1f} ms)")
    """
    import torch

    import graphtree

    if workload == "gpt":
        loop = _loop_gpt(batch, steps)
        mode = "graphtree"
    else:
        step, x = _decode_step(layers, width, batch)
        loop = _loop_torch(step, x, steps) if mode == "torch" else _loop_graphtree(step, x, steps)

    def plain() -> float:
        t0 = time.perf_counter()
        loop()
        return time.perf_counter() - t0

    last: dict[str, Any] = {}

    def profiled() -> float:
        opts: dict[str, Any] = {"keep_records": keep_records, "raw_buffers": raw_buffers}
        if defer_records is not None:
            opts["defer_records"] = defer_records
        if flush_period_ms is not None:
            opts["flush_period_ms"] = flush_period_ms
        if sample is not None:  # sampled mode: (window steps, every steps)
            opts["sample"] = graphtree.profile.Sampling(window_steps=sample[0], every_steps=sample[1])
        prof = graphtree.profile.profile(**opts)  # the function behind graphtree.profile(), typed
        t0 = time.perf_counter()
        prof.start()
        t1 = time.perf_counter()
        if sample is not None:
            loop(prof.step)
        else:
            loop()
        t2 = time.perf_counter()
        prof.stop()
        if sample is not None:  # what opening and closing the windows cost (GPU syncs included)
            last.update(windows=len(prof.windows), window_edges_ms=sum(w.edge_ms for w in prof.windows))
        t3 = time.perf_counter()
        last.update(
            start=t1 - t0,
            stop=t3 - t2,
            summary=prof.summary(),
            notes=list(prof.data.notes),
            stop_timings=dict(prof.data.stop_timings),
            buffer_path=prof.data.buffer_path,
            buffer_path_reason=prof.data.buffer_path_reason,
        )
        return t2 - t1

    def floored(make: Callable[[], Any], key: str) -> Callable[[], float]:
        def run() -> float:
            f = make()
            f.start()
            t0 = time.perf_counter()
            loop()
            t1 = time.perf_counter()
            t2 = time.perf_counter()
            f.stop()
            last[key + "_stop"] = time.perf_counter() - t2
            return t1 - t0

        return run

    fp = 1000 if flush_period_ms is None else flush_period_ms
    variants: dict[str, Callable[[], float]] = {"plain": plain, "profiled": profiled}
    floor_errors: dict[str, str] = {}
    if floor:
        for key, make in (
            ("activity_floor", lambda: _ActivityFloor(flush_period_ms=fp)),
            ("callback_floor", _CallbackFloor),
        ):
            fn = floored(make, key)
            try:
                fn()  # warm-up, and does it work here at all
                variants[key] = fn
            except Exception as e:  # noqa: BLE001 - report, keep measuring the rest
                floor_errors[key] = f"{type(e).__name__}: {e}"
    plain()
    profiled()  # warm-up: first CUPTI initialisation is not what a loop pays
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    starts: list[float] = []
    stops: list[float] = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        if r % 2:
            order.reverse()
        for which in order:
            times[which].append(variants[which]())
            if which == "profiled":
                starts.append(last["start"])
                stops.append(last["stop"])
    torch.cuda.synchronize()
    med = {n: statistics.median(t) for n, t in times.items()}
    mp, mq = med["plain"], med["profiled"]
    s = last["summary"]
    stop_s = statistics.median(stops)
    out: dict[str, Any] = {
        "workload": workload,
        "mode": mode,
        "steps": steps,
        "rounds": rounds,
        "layers": layers if workload == "decode" else 12,
        "width": width if workload == "decode" else 768,
        "batch": batch,
        "keep_records": keep_records,
        "buffer_path": last.get("buffer_path"),
        "buffer_path_reason": last.get("buffer_path_reason"),
        "plain_ms": 1e3 * mp,
        "profiled_ms": 1e3 * mq,
        "plain_step_us": 1e6 * mp / steps,
        "profiled_step_us": 1e6 * mq / steps,
        "overhead": mq / mp - 1.0,
        "overhead_step_us": 1e6 * (mq - mp) / steps,
        "overhead_pct": 100.0 * (mq / mp - 1.0),
        "overhead_incl_stop_pct": 100.0 * ((mq + stop_s) / mp - 1.0),
        "defer_records": defer_records,
        "paired_overhead_median": statistics.median(q / p - 1.0 for p, q in zip(times["plain"], times["profiled"])),
        "start_ms": 1e3 * statistics.median(starts),
        "stop_ms": 1e3 * stop_s,
        "stop_timings_ms": {k: round(v, 3) for k, v in last.get("stop_timings", {}).items()},
        "sample": list(sample) if sample else None,
        "windows": last.get("windows"),
        "window_edges_ms": last.get("window_edges_ms"),
        "kernels_per_step": s["kernels"] / steps,
        "records_per_run": s["records"],
        "graph_launches": s["graph_launches"],
        "dropped_records": s["dropped_records"],
        "max_buffers_in_flight": s["max_buffers_in_flight"],
        "notes": last["notes"],
        "floor_errors": floor_errors,
        "plain_all_ms": [round(1e3 * t, 3) for t in times["plain"]],
        "profiled_all_ms": [round(1e3 * t, 3) for t in times["profiled"]],
    }
    for key in ("activity_floor", "callback_floor"):
        if key in med:
            out[f"{key}_step_us"] = 1e6 * med[key] / steps
            out[f"{key}_pct"] = 100.0 * (med[key] / mp - 1.0)
            out[f"{key}_stop_ms"] = 1e3 * last.get(key + "_stop", 0.0)
            out[f"{key}_all_ms"] = [round(1e3 * t, 3) for t in times[key]]
    if "activity_floor" in med:
        # what graphtree adds on top of CUPTI's own kernel tracing
        out["above_activity_floor_pct"] = 100.0 * (mq / med["activity_floor"] - 1.0)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure and print JSON; exit status 0 when every overhead is within the threshold."""
    p = argparse.ArgumentParser(prog="python benchmarks/profile_overhead.py", description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload",
        choices=("decode", "gpt"),
        default="decode",
        help="decode: the synthetic graphed step (--mode, --layers, --width, --batch); "
        "gpt: TinyGPT decode_step (12 layers, d=768) graphed with graphtree.graphed, "
        "at each of --batches",
    )
    p.add_argument("--mode", choices=("torch", "graphtree", "both"), default="both")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--batches", default="1,32", help="batch sizes of --workload gpt (comma separated)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--aggregate-only", action="store_true", help="profile with keep_records=False")
    p.add_argument(
        "--defer-records",
        type=int,
        default=None,
        help="ProfileOptions.defer_records (0: aggregate every buffer as it completes)",
    )
    p.add_argument("--no-floor", action="store_true", help="skip the CUPTI floor variants")
    p.add_argument(
        "--cupti-python-buffers",
        action="store_true",
        help="profile with raw_buffers=False (cupti-python's buffer callbacks)",
    )
    p.add_argument("--flush-period-ms", type=int, default=None, help="ProfileOptions.flush_period_ms")
    p.add_argument(
        "--sample",
        default=None,
        metavar="WINDOW_STEPS:EVERY_STEPS",
        help="profile in sampled mode (graphtree.profile.Sampling), e.g. 20:2000",
    )
    p.add_argument("--threshold", type=float, default=0.05)
    a = p.parse_args(argv)
    if a.sample and a.workload != "gpt":
        p.error("--sample needs --workload gpt (its loop calls prof.step())")
    if a.workload == "gpt":
        cases = [("graphtree", int(b)) for b in a.batches.split(",") if b.strip()]
    else:
        cases = [(m, a.batch) for m in (("torch", "graphtree") if a.mode == "both" else (a.mode,))]
    results = []
    for mode, batch in cases:
        label = f"gpt b={batch}" if a.workload == "gpt" else mode
        try:
            results.append(
                measure_overhead(
                    mode=mode,
                    layers=a.layers,
                    width=a.width,
                    batch=batch,
                    steps=a.steps,
                    rounds=a.rounds,
                    keep_records=not a.aggregate_only,
                    defer_records=a.defer_records,
                    workload=a.workload,
                    floor=not a.no_floor,
                    raw_buffers=not a.cupti_python_buffers,
                    flush_period_ms=a.flush_period_ms,
                    sample=tuple(int(v) for v in a.sample.split(":")) if a.sample else None,  # type: ignore[arg-type]
                )
            )
            r = results[-1]
            floors = "".join(
                f", {k}: {r[k + '_step_us']:.1f} us/step ({r[k + '_pct']:+.2f}%)"
                for k in ("activity_floor", "callback_floor")
                if k + "_step_us" in r
            )
            print(
                f"[{label}] plain {r['plain_step_us']:.1f} us/step{floors}, profiled {r['profiled_step_us']:.1f} "
                f"us/step: +{r['overhead_step_us']:.1f} us/step = {r['overhead_pct']:.2f}% "
                f"({r['overhead_incl_stop_pct']:.2f}% counting stop: {r['stop_ms']:.1f} ms {r['stop_timings_ms']}); "
                + (
                    f"{r['windows']} windows, {r['window_edges_ms']:.1f} ms opening and closing them; "
                    if r.get("windows") is not None
                    else ""
                )
                + f"{r['kernels_per_step']:.0f} kernels/step, dropped {r['dropped_records']}, "
                f"buffers via {r['buffer_path']}",
                file=sys.stderr,
            )
        except Exception as e:  # noqa: BLE001 - report, do not hide the other cases
            results.append({"workload": a.workload, "mode": mode, "batch": batch, "error": f"{type(e).__name__}: {e}"})
    ok = all("overhead" in r and r["overhead"] <= a.threshold for r in results)
    print(json.dumps({"threshold": a.threshold, "ok": ok, "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
