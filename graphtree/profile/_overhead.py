"""What profiling costs a graphed decode loop: wall time with and without it (run on a GPU).

Usage::

    python -m graphtree.profile._overhead                  # both loops, JSON on stdout
    python -m graphtree.profile._overhead --mode torch --steps 400 --rounds 9

A decode-like step (``layers`` x [matmul, GELU, residual add, layer norm], then an argmax "token")
is captured once, before profiling, as a CUDA graph. A loop replays it ``steps`` times and waits
for each step (a decode loop reads every token). Rounds alternate "plain" and "profiled" (order
flipped every round, so drift hits both); the overhead is the median profiled time over the median
plain time, minus one. The profiled time covers the loop only; starting and stopping are reported
apart as ``start_ms``/``stop_ms`` (``stop_ms`` includes aggregating the records the session stashed
while the loop ran, see ``ProfileOptions.defer_records``).

What is printed (JSON on stdout, one summary line per mode on stderr):

* ``plain_step_us`` / ``profiled_step_us``: wall time of one decode step (replay + synchronize);
* ``overhead_step_us``: what profiling adds to one step (median profiled - median plain, per step);
* ``overhead_pct``: the same in percent of a plain step (the ≤ 5% target);
* ``overhead_incl_stop_pct``: the same with ``stop_ms`` (flush + aggregation) spread over the loop;
* ``kernels_per_step``: kernel records per step (the per-record cost scales with it).

``mode="torch"`` replays a ``torch.cuda.CUDAGraph``; ``mode="graphtree"`` calls a
``graphtree.graphed`` function (recorded during warm-up). The exit status is 0 when every overhead is
within ``--threshold`` (default 0.05).

Example::

    >>> from graphtree.profile._overhead import measure_overhead
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
from typing import Any, Callable, Dict, List, Optional

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

    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step(static_x)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_x)
    torch.cuda.synchronize()

    def loop() -> None:
        sync = torch.cuda.synchronize
        for _ in range(steps):
            graph.replay()
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


def measure_overhead(
    *,
    mode: str = "torch",
    layers: int = 16,
    width: int = 2048,
    batch: int = 4,
    steps: int = 300,
    rounds: int = 7,
    keep_records: bool = True,
    defer_records: Optional[int] = None,
) -> Dict[str, Any]:
    """Time the replay loop plain and profiled, interleaved; returns medians and the overhead.

    Example::

        r = measure_overhead(mode="graphtree", steps=200)
        print(f"{100 * r['overhead']:.1f}% ({r['plain_ms']:.1f} ms -> {r['profiled_ms']:.1f} ms)")
    """
    import torch

    import graphtree

    step, x = _decode_step(layers, width, batch)
    loop = _loop_torch(step, x, steps) if mode == "torch" else _loop_graphtree(step, x, steps)

    def plain() -> float:
        t0 = time.perf_counter()
        loop()
        return time.perf_counter() - t0

    last: Dict[str, Any] = {}

    def profiled() -> float:
        opts: Dict[str, Any] = {"keep_records": keep_records}
        if defer_records is not None:
            opts["defer_records"] = defer_records
        prof = graphtree.profile(**opts)
        t0 = time.perf_counter()
        prof.start()
        t1 = time.perf_counter()
        loop()
        t2 = time.perf_counter()
        prof.stop()
        t3 = time.perf_counter()
        last.update(start=t1 - t0, stop=t3 - t2, summary=prof.summary(), notes=list(prof.data.notes))
        return t2 - t1

    plain()
    profiled()  # warm-up: first CUPTI initialisation is not what a loop pays
    plain_t: List[float] = []
    prof_t: List[float] = []
    starts: List[float] = []
    stops: List[float] = []
    for r in range(rounds):
        for which in (("plain", "profiled") if r % 2 == 0 else ("profiled", "plain")):
            if which == "plain":
                plain_t.append(plain())
            else:
                prof_t.append(profiled())
                starts.append(last["start"])
                stops.append(last["stop"])
    torch.cuda.synchronize()
    mp, mq = statistics.median(plain_t), statistics.median(prof_t)
    s = last["summary"]
    stop_s = statistics.median(stops)
    return {
        "mode": mode,
        "steps": steps,
        "rounds": rounds,
        "layers": layers,
        "width": width,
        "batch": batch,
        "keep_records": keep_records,
        "plain_ms": 1e3 * mp,
        "profiled_ms": 1e3 * mq,
        "plain_step_us": 1e6 * mp / steps,
        "profiled_step_us": 1e6 * mq / steps,
        "overhead": mq / mp - 1.0,
        "overhead_step_us": 1e6 * (mq - mp) / steps,
        "overhead_pct": 100.0 * (mq / mp - 1.0),
        "overhead_incl_stop_pct": 100.0 * ((mq + stop_s) / mp - 1.0),
        "defer_records": defer_records,
        "paired_overhead_median": statistics.median(q / p - 1.0 for p, q in zip(plain_t, prof_t)),
        "start_ms": 1e3 * statistics.median(starts),
        "stop_ms": 1e3 * stop_s,
        "kernels_per_step": s["kernels"] / steps,
        "graph_launches": s["graph_launches"],
        "dropped_records": s["dropped_records"],
        "max_buffers_in_flight": s["max_buffers_in_flight"],
        "notes": last["notes"],
        "plain_all_ms": [round(1e3 * t, 3) for t in plain_t],
        "profiled_all_ms": [round(1e3 * t, 3) for t in prof_t],
    }


def main(argv: Optional[List[str]] = None) -> int:
    """Measure and print JSON; exit status 0 when every overhead is within the threshold."""
    p = argparse.ArgumentParser(prog="python -m graphtree.profile._overhead", description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("torch", "graphtree", "both"), default="both")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--aggregate-only", action="store_true", help="profile with keep_records=False")
    p.add_argument("--defer-records", type=int, default=None,
                   help="ProfileOptions.defer_records (0: aggregate every buffer as it completes)")
    p.add_argument("--threshold", type=float, default=0.05)
    a = p.parse_args(argv)
    modes = ("torch", "graphtree") if a.mode == "both" else (a.mode,)
    results = []
    for mode in modes:
        try:
            results.append(
                measure_overhead(mode=mode, layers=a.layers, width=a.width, batch=a.batch, steps=a.steps,
                                 rounds=a.rounds, keep_records=not a.aggregate_only,
                                 defer_records=a.defer_records)
            )
            r = results[-1]
            print(
                f"[{mode}] plain {r['plain_step_us']:.1f} us/step, profiled {r['profiled_step_us']:.1f} us/step: "
                f"+{r['overhead_step_us']:.1f} us/step = {r['overhead_pct']:.2f}% "
                f"({r['overhead_incl_stop_pct']:.2f}% counting stop: {r['stop_ms']:.1f} ms); "
                f"{r['kernels_per_step']:.0f} kernels/step, dropped {r['dropped_records']}",
                file=sys.stderr,
            )
        except Exception as e:  # report, do not hide the other mode
            results.append({"mode": mode, "error": f"{type(e).__name__}: {e}"})
    ok = all("overhead" in r and r["overhead"] <= a.threshold for r in results)
    print(json.dumps({"threshold": a.threshold, "ok": ok, "results": results}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
