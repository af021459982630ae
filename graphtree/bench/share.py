"""The ``share`` measurement: a graphed decode loop hands each step's logits to another process.

The producer (this process) runs the demo model's decode step through :func:`graphtree.graphed`
for ``steps`` steps; a consumer process (a ``spawn`` child) reads every step's logits and takes
their argmax. Ways to hand the logits over:

- ``none``: no consumer, the baseline producer loop (the step's logits stay in the graph's pool);
- ``graphtree.share``: a channel's graphed writer (:meth:`~graphtree.share.channel.Channel.graphed`)
  of the decode step: each call writes the logits straight into the next slot (``out=``, so no
  copy) and its recording writes the slot's ``ready`` cell; the consumer's stream waits for that
  cell (:mod:`graphtree.share.channel`);
- ``mp-queue``: ``torch.multiprocessing`` queue of CUDA tensors: ``q.put(logits.clone())`` (a
  clone, since the next replay overwrites the graph's output; torch sends a legacy IPC handle);
- ``pinned-copy``: the logits are copied into pinned shared host memory (``cudaHostRegister`` on
  both sides), the producer waits for the copy, the consumer copies them back to its GPU.

Reported per way: the producer's CPU time per step (median) and what it adds to the ``none``
way's (``producer_cpu_over_none_us``), its time per step with the GPU
(steps / wall time), the consumer's latency from the producer's call of the step to the moment
the consumer's argmax of that step is done (median, p90; CLOCK_MONOTONIC is shared by the two
processes), the bytes each step copies, and whether the consumer's tokens equal the producer's.
The producer waits for its GPU at the end of each step (outside the CPU time), as a decode loop
that checks for its end does, so latencies are not inflated by a growing GPU queue.
For ``graphtree.share`` also the attach time (first in the consumer, then cached: the median of
20 more), the writer's call alone, how many steps found no slot free at once and waited for the
consumer (``producer_waits``), and the publishing overhead measured apart from the loop's noise
(:func:`publish_overhead`).

Example::

    rows = measure(steps=200)                 # a dict per way
    python -m graphtree.bench.share --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from typing import Any

import torch

WAYS = ("none", "graphtree.share", "mp-queue", "pinned-copy")
_SLOTS = 3


def _model(layers: int, d_model: int, vocab: int, batch: int) -> Any:
    from graphtree.demo.gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(n_layer=layers, n_head=max(1, d_model // 64), d_model=d_model, vocab=vocab, max_seq=256)
    return TinyGPT(cfg, batch=batch).to("cuda").eval()


def _summary_us(xs: list[float]) -> dict[str, float]:
    """The bench's :func:`~graphtree.bench.harness.summarize` of ``xs`` (seconds), in microseconds
    (``n`` stays a count)."""
    from graphtree.bench.harness import summarize

    return {k: v if k == "n" else v * 1e6 for k, v in summarize(xs).items()}


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def _consumer(way: str, name: str, steps: int, first: int, q: Any, out: Any, pinned: list[torch.Tensor]) -> None:
    """The consumer process: read versions ``first..first+steps-1``, report read times and tokens."""
    torch.cuda.init()
    times: dict[int, float] = {}
    tokens: dict[int, list[int]] = {}
    report: dict[str, Any] = {}
    if way == "graphtree.share":
        import graphtree.share as share

        t = time.perf_counter()
        shared = share.attach(name, timeout=30)
        report["attach_first_s"] = time.perf_counter() - t
        again = []
        for _ in range(20):
            t = time.perf_counter()
            share.attach(name, timeout=30).close()
            again.append(time.perf_counter() - t)
        report["attach_cached_s"] = statistics.median(again)
        sub = shared.channel("logits")
        q.put("ready")
        while sub.last < first + steps - 1:
            with sub.read(timeout=60) as frame:
                tok = frame.tensor.argmax(-1)
            torch.cuda.current_stream().synchronize()
            times[frame.version] = time.perf_counter()
            tokens[frame.version] = tok.tolist()
        shared.close()
    elif way == "mp-queue":
        q.put("ready")
        while True:
            v, logits = q.get(timeout=60)
            tok = logits.argmax(-1)
            torch.cuda.current_stream().synchronize()
            times[v] = time.perf_counter()
            tokens[v] = tok.tolist()
            del logits
            if v >= first + steps - 1:
                break
    else:
        cudart = torch.cuda.cudart()
        for p in pinned:
            cudart.cudaHostRegister(p.data_ptr(), p.numel() * p.element_size(), 0)
        dev = torch.empty(pinned[0].shape, dtype=pinned[0].dtype, device="cuda")
        q.put("ready")
        while True:
            v, slot = q.get(timeout=60)
            dev.copy_(pinned[slot], non_blocking=True)
            tok = dev.argmax(-1)
            torch.cuda.current_stream().synchronize()
            times[v] = time.perf_counter()
            tokens[v] = tok.tolist()
            out.put(("done", v))
            if v >= first + steps - 1:
                break
    report["times"] = times
    report["tokens"] = tokens
    out.put(("report", report))


def _one_way(way: str, model: Any, steps: int, warmup: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    import graphtree

    graphtree.reset()
    model.reset_cache()
    b, vocab = model.batch, model.cfg.vocab
    step = graphtree.graphed(model.decode_step)
    tokens = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    ctx = mp.get_context("spawn")
    q, out = ctx.Queue(), ctx.Queue()
    name = f"bench-{uuid.uuid4().hex[:8]}"
    pub = child = None
    pinned: list[torch.Tensor] = []
    ev, stream = torch.cuda.Event(), torch.cuda.current_stream()
    publish = channel = None
    if way == "graphtree.share":
        import graphtree.share as share

        pub = share.Publisher(name)
        channel = pub.channel("logits", (b, vocab), model.wte.weight.dtype, slots=_SLOTS)
        publish = channel.graphed(model.decode_step, timeout=60)
    if way == "pinned-copy":
        pinned = [torch.empty(b, vocab, dtype=model.wte.weight.dtype).share_memory_() for _ in range(2)]
        for p in pinned:
            torch.cuda.cudart().cudaHostRegister(p.data_ptr(), p.numel() * p.element_size(), 0)
    if publish is None:
        # recorded before the loop, so that no capture runs inside the timed loop: once on the H100
        # a capture there failed ("previous error during capture") and the step ran eagerly. Taken
        # then for torch.multiprocessing's feeder thread; the same error was later shown to come
        # from a garbage collection inside the capture (graphtree now pauses it during captures)
        for _ in range(step.warmup + 2):
            graphtree.mark_step()
            step(tokens, pos)
        model.reset_cache()
    if way != "none":
        child = ctx.Process(target=_consumer, args=(way, name, steps, warmup + 1, q, out, pinned), daemon=True)
        child.start()
        assert q.get(timeout=120) == "ready"
    started: dict[int, float] = {}
    produced: dict[int, torch.Tensor] = {}
    cpu: list[float] = []
    publishes: list[float] = []
    acked = 0
    total = warmup + steps
    torch.cuda.synchronize()
    wall = 0.0
    waits = 0
    for v in range(1, total + 1):
        if v == warmup + 1:
            torch.cuda.synchronize()
            wall = time.perf_counter()
            waits = channel.waits if channel is not None else 0
        if v % model.cfg.max_seq == 0:
            pos.zero_()
        t0 = time.perf_counter()
        graphtree.mark_step()
        if publish is not None:
            t1 = time.perf_counter()
            logits = publish(tokens, pos)  # next slot, the graphed step writing into it, published
            publishes.append(time.perf_counter() - t1)
        else:
            logits = step(tokens, pos)
            if way == "mp-queue":
                q.put((v, logits.clone()))
            elif way == "pinned-copy":
                while acked < v - 2:  # the slot's previous version was read
                    acked = out.get(timeout=60)[1]
                pinned[v % 2].copy_(logits, non_blocking=True)
                ev.record()
                ev.synchronize()
                q.put((v, v % 2))
        tokens = logits.argmax(-1, keepdim=True)
        pos += 1
        cpu.append(time.perf_counter() - t0)
        started[v] = t0
        produced[v] = tokens
        stream.synchronize()  # as a decode loop that checks for its end each step: the GPU queue stays short
    torch.cuda.synchronize()
    wall = time.perf_counter() - wall
    result: dict[str, Any] = {
        "way": way,
        "eager_steps": sum(graphtree.stats().eager.values()),  # 0: every step was a replay
        "producer_cpu_per_step_us": _median_us(cpu[warmup:]),
        "producer_wall_per_step_us": wall / steps * 1e6,
        "copied_bytes_per_step": 0 if way in ("none", "graphtree.share") else logits.numel() * logits.element_size(),
    }
    if channel is not None:
        result["publish_us"] = _median_us(publishes[warmup:])
        result["producer_waits"] = channel.waits - waits  # steps that found no slot free at once
    if child is not None:
        report: dict[str, Any] = {}
        while not report:
            kind, value = out.get(timeout=120)
            if kind == "report":
                report = value
        child.join(timeout=60)
        lat = [report["times"][v] - started[v] for v in report["times"] if v > warmup]
        result["consumer_latency_us"] = _summary_us(lat)
        result["versions_read"] = len(lat)
        result["tokens_equal"] = all(report["tokens"][v] == produced[v].flatten().tolist() for v in report["tokens"])
        for k in ("attach_first_s", "attach_cached_s"):
            if k in report:
                result[k.replace("_s", "_ms")] = report[k] * 1e3
    if pub is not None:
        pub.close()
    for p in pinned:
        torch.cuda.cudart().cudaHostUnregister(p.data_ptr())
    return result


def measure(
    steps: int = 200, warmup: int = 8, layers: int = 2, d_model: int = 256, vocab: int = 32000, batch: int = 1
) -> list[dict[str, Any]]:
    """Run every way in :data:`WAYS` on one model; a dict of figures per way (see the module)."""
    from graphtree import _native

    _native.wait(600)  # time the replay path graphtree runs once its helpers are built
    model = _model(layers, d_model, vocab, batch)
    with torch.no_grad():
        rows = [_one_way(w, model, steps, warmup) for w in WAYS]
        rows[1].update(publish_overhead(model))
    base = rows[0]["producer_cpu_per_step_us"]
    for r in rows[1:]:  # what handing the logits over adds to the producer's step
        r["producer_cpu_over_none_us"] = r["producer_cpu_per_step_us"] - base
    return rows


def publish_overhead(model: Any, rounds: int = 10, calls: int = 300) -> dict[str, float | list[float]]:
    """What publishing costs the producer's CPU per step, measured apart from the noise of a live
    loop: the graphed decode step writing its logits into a buffer of its own (``out=``, three
    buffers in turn, as a channel's slots) against a channel's :meth:`~graphtree.share.channel.
    Channel.graphed` writer of the same step (no consumer), as ``rounds`` rounds of ``calls``
    pairs of calls, each call timed alone and followed by a wait for the GPU, the pair's order
    alternating. A pair's two calls are made within microseconds of each other, so the host's
    drifts (clock speed, other processes: several µs on the GPU machines) hit both alike; a
    difference of medians taken apart does not cancel them. In microseconds: ``step_out_us`` and
    ``publish_call_us`` (medians of the calls), ``publish_overhead_us`` (median of the pairs'
    differences) and ``publish_overhead_rounds_us`` (the lowest and highest of the rounds'
    medians of differences)."""
    import graphtree
    import graphtree.share as share

    graphtree.reset()
    model.reset_cache()
    b, vocab, dtype = model.batch, model.cfg.vocab, model.wte.weight.dtype
    tokens = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    step = graphtree.graphed(model.decode_step)
    own = [graphtree.mark_static(torch.empty(b, vocab, dtype=dtype, device="cuda")) for _ in range(_SLOTS)]
    pub = share.Publisher(f"bench-{uuid.uuid4().hex[:8]}")
    publish = pub.channel("logits", (b, vocab), dtype, slots=_SLOTS).graphed(model.decode_step, timeout=60)
    stream = torch.cuda.current_stream()
    clock = time.perf_counter

    def timed(i: int, writer: bool) -> float:
        t = clock()
        if writer:
            publish(tokens, pos)
        else:
            step(tokens, pos, out=own[i % _SLOTS])
        t = clock() - t
        stream.synchronize()
        return t

    steps: list[float] = []
    writes: list[float] = []
    rounds_us: list[float] = []
    for _ in range(rounds):
        diffs = []
        for i in range(calls):
            if i % 2:  # the writer first in every other pair
                write_t = timed(i, True)
                step_t = timed(i, False)
            else:
                step_t = timed(i, False)
                write_t = timed(i, True)
            if i >= calls // 10:  # each round's first calls warm up
                steps.append(step_t)
                writes.append(write_t)
                diffs.append(write_t - step_t)
        rounds_us.append(statistics.median(diffs) * 1e6)
    pub.close()
    graphtree.reset()
    every = [w - s for w, s in zip(writes, steps, strict=True)]
    return {
        "step_out_us": _median_us(steps),
        "publish_call_us": _median_us(writes),
        "publish_overhead_us": _median_us(every),
        "publish_overhead_rounds_us": [min(rounds_us), max(rounds_us)],
    }


SCENARIO = "share"
_METRICS = (  # (key in a way's figures, metric, unit, scale to base units)
    ("producer_cpu_per_step_us", "producer_cpu_per_step", "s", 1e-6),
    ("producer_wall_per_step_us", "producer_time_per_step", "s", 1e-6),
    ("producer_cpu_over_none_us", "producer_cpu_over_none", "s", 1e-6),
    ("publish_us", "publish_cpu", "s", 1e-6),
    ("publish_overhead_us", "publish_overhead", "s", 1e-6),
    ("attach_first_ms", "attach_first", "s", 1e-3),
    ("attach_cached_ms", "attach_cached", "s", 1e-3),
    ("copied_bytes_per_step", "copied_per_step", "bytes", 1),
)


def run_share(ctx: Any) -> list[Any]:
    """The ``share`` scenario of ``graphtree bench``: :func:`measure` on the bench's decode model,
    one row per figure; the ways are its contenders (``graphtree`` is ``graphtree.share``)."""
    from graphtree.bench.harness import Result

    cfg = ctx.cfg
    gpt = cfg.gpt
    steps = 50 if cfg.quick else 200
    ctx.log(f"{SCENARIO}: a graphed decode loop hands {steps} steps of logits to a consumer process, 4 ways")
    rows = measure(steps, layers=gpt.n_layer, d_model=gpt.d_model, vocab=gpt.vocab)
    results = []
    case = f"decode loop, vocab {gpt.vocab}"
    for c in cfg.contenders:
        if c != "graphtree":
            results.append(Result(SCENARIO, case, c, "producer_time_per_step", None, "s", note="not a way to share"))
    for r in rows:
        name = "graphtree" if r["way"] == "graphtree.share" else r["way"]
        for key, metric, unit, scale in _METRICS:
            if key in r:
                note = ""
                if key == "producer_cpu_per_step_us" and "producer_waits" in r:
                    note = f"{r['producer_waits']} of {steps} steps waited for a slot (readers)"
                results.append(Result(SCENARIO, case, name, metric, r[key] * scale, unit, note=note))
        if "consumer_latency_us" in r:
            lat = r["consumer_latency_us"]
            stats = {k: v if k == "n" else v * 1e-6 for k, v in lat.items()}
            results.append(
                Result(
                    SCENARIO,
                    case,
                    name,
                    "consumer_latency",
                    lat["median"] * 1e-6,
                    "s",
                    stats=stats,
                    equal_to_eager=r["tokens_equal"],
                    note=f"{r['versions_read']} versions read",
                )
            )
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphtree.bench.share", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("graphtree.bench.share needs a CUDA GPU; torch sees none")
        return 2
    rows = measure(args.steps, layers=args.layers, d_model=args.d_model, vocab=args.vocab, batch=args.batch)
    from graphtree import _native

    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, native helpers {_native.status()}")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
