"""Where a graphtree.share channel's per-step producer time goes: each piece timed alone.

Run on a GPU: ``python benchmarks/share_breakdown.py [--steps 2000]``. Prints one JSON object of
median microseconds per call: the CUDA calls the plain ``next()``/``commit()`` path makes (finding
the current stream, the ``cuStreamWriteValue64`` of a slot's ``ready`` cell), what the earlier
event-based protocol made (an inter-process event record, a stream's wait on one), the control
block's lock (which consumers take; the producer does not on x86-64), ``next()`` / ``commit()``
in a loop that writes each version and waits for its GPU, with no consumer and with a consumer
process reading every version, and a graphed writer's call against the same graphed function
writing into a buffer of its own (:meth:`graphtree.share.channel.Channel.graphed`).
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

import graphtree
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


def _synced_median_us(fn: Callable[[int], Any], n: int) -> float:
    """Median time of ``fn(i)``, the GPU waited for after each call (outside the time)."""
    stream = torch.cuda.current_stream()
    xs = []
    for i in range(n + 200):
        t = time.perf_counter()
        fn(i)
        xs.append(time.perf_counter() - t)
        stream.synchronize()
    return round(statistics.median(xs[200:]) * 1e6, 2)


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
    from graphtree import _native

    _native.wait(600)  # the channel's take and publish run in C++ once the helpers are built
    dev, n = torch.cuda.current_device(), args.steps
    stream = torch.cuda.current_stream()
    event = torch.cuda.Event(interprocess=True)
    event.record(stream)
    raw = _torch.raw_stream_getter()
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "native helpers": _native.status(),
    }
    out["torch.cuda.current_stream"] = _median_us(lambda: torch.cuda.current_stream(dev), n)
    if raw is not None:
        out["raw current stream handle"] = _median_us(lambda: raw(dev), n)
    out["interprocess event record (earlier protocol)"] = _median_us(lambda: event.record(stream), n)
    out["stream wait on an interprocess event (earlier protocol)"] = _median_us(lambda: stream.wait_event(event), n)
    pub = share.Publisher(f"breakdown-{uuid.uuid4().hex[:8]}")
    try:
        block = pub._block
        out["control block lock + unlock"] = _median_us(lambda: (block.acquire(), block.release()), n)
        ch = pub.channel("x", (1024,), torch.float32, slots=3)
        order, handle = ch._order, stream.cuda_stream
        out["cuStreamWriteValue64 of a ready cell"] = _median_us(lambda: order.mark(handle, 0, 0), n)
        out["next, no consumer"], out["commit, no consumer"] = _loop(ch, n)
        x = torch.ones(1024, device="cuda")

        def scale(v: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
            return torch.mul(v, 2.0, out=out)

        own = [graphtree.mark_static(torch.empty(1024, device="cuda")) for _ in range(3)]
        step, publish = graphtree.graphed(scale), ch.graphed(scale)
        out["graphed step writing into out=, no consumer"] = _synced_median_us(lambda i: step(x, out=own[i % 3]), n)
        out["graphed writer call, no consumer"] = _synced_median_us(lambda i: publish(x), n)
        ctx = mp.get_context("spawn")
        ready = ctx.Queue()
        child = ctx.Process(target=_reader, args=(pub.path, ready), daemon=True)
        child.start()
        ready.get(timeout=120)
        out["next, one consumer reading"], out["commit, one consumer reading"] = _loop(ch, n)
        out["graphed writer call, one consumer reading"] = _synced_median_us(lambda i: publish(x), n)
        child.kill()
        child.join(timeout=30)
    finally:
        pub.close()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
