"""Where a graphtree.share channel's per-step producer time goes: each piece timed alone.

Run on a GPU: ``python benchmarks/share_breakdown.py [--steps 2000]``. Prints one JSON object of
median microseconds per call: the CUDA calls a step makes (finding the current stream, recording
an inter-process event, a stream's wait on one), the control block's lock, and ``next()`` /
``commit()`` in a loop that writes each version and waits for its GPU (as a decode loop does),
with no consumer and with a consumer process reading every version. ``read_done_wait`` is the
producer's stream waiting on the consumer's own ``read_done`` event, the wait ``next()`` makes
when it reuses a slot that consumer read.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from graphtree import _torch


def _median_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(200):
        fn()
    xs = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t)
    return round(statistics.median(xs) * 1e6, 2)


def _loop(ch: Any, steps: int) -> tuple[float, float]:
    """Medians of ``next()`` and ``commit()`` over ``steps`` versions, the GPU waited for each step."""
    stream = torch.cuda.current_stream()
    nexts, commits = [], []
    for v in range(steps):
        t0 = time.perf_counter()
        buf = ch.next(timeout=30)
        t1 = time.perf_counter()
        buf.fill_(float(v))
        t2 = time.perf_counter()
        ch.commit()
        commits.append(time.perf_counter() - t2)
        nexts.append(t1 - t0)
        stream.synchronize()
    return round(statistics.median(nexts) * 1e6, 2), round(statistics.median(commits) * 1e6, 2)


def _reader(name: str, ready: Any) -> None:
    import graphtree.share as share

    sub = share.attach(name, timeout=30).channel("x")
    ready.put(True)
    while True:
        try:
            with sub.read(timeout=5) as frame:
                frame.tensor.sum()
        except TimeoutError:
            return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2000)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    import graphtree.share as share

    dev, n = torch.cuda.current_device(), args.steps
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    raw = _torch.raw_stream_getter()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["torch.cuda.current_stream"] = _median_us(lambda: torch.cuda.current_stream(dev), n)
    if raw is not None:
        out["raw current stream handle"] = _median_us(lambda: raw(dev), n)
    out["interprocess event record"] = _median_us(lambda: event.record(stream), n)
    out["stream wait on own interprocess event"] = _median_us(lambda: stream.wait_event(event), n)
    pub = share.Publisher(f"breakdown-{uuid.uuid4().hex[:8]}")
    try:
        block = pub._block
        out["control block lock + unlock"] = _median_us(lambda: (block.acquire(), block.release()), n)
        ch = pub.channel("x", (1024,), torch.float32, slots=3)
        out["next, no consumer"], out["commit, no consumer"] = _loop(ch, n)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        child = ctx.Process(target=_reader, args=(pub.path, ready), daemon=True)
        child.start()
        ready.get(timeout=120)
        out["next, one consumer reading"], out["commit, one consumer reading"] = _loop(ch, n)
        events = next(iter(pub._consumer_events.values()))["x"]
        out["read_done_wait"] = _median_us(lambda: stream.wait_event(events[0]), n)
        child.kill()
        child.join(timeout=30)
    finally:
        pub.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
