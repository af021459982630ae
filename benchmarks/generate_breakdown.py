"""Where the time of a generated token goes (issue 27, item 3): Hugging Face ``generate()`` with the
decode step graphed, against eager and HF's own compiled default, in one process.

The model of ``graphtree bench --scenarios generate`` (a random-weight 8-layer, d=512 Llama, vocab
32000, an 8-token prompt, 64 new tokens, greedy, batch 1). Per token (a whole ``generate()`` over
its tokens, medians of ``--repeats``):

- ``total``: what a user waits for;
- ``forward, CPU``: wall time inside ``model.forward`` per call, without a sync (graphtree's or
  eager's Python and its launches; not for HF's default, whose compiled code a timer would break);
- ``forward, GPU``: CUDA-event time around each forward (the GPU is idle when a step begins:
  ``generate()`` reads the stopping criteria on the host every token);
- with HF's default dynamic cache (no ``cache_implementation``), eager and graphed: a new
  signature every step, which graphtree stops warming up after 16 (``tree/churn.py``);
- ``HF around it``: ``generate()`` with a forward that does nothing (returns a fixed logits
  tensor): Hugging Face's own Python per token (inputs, logits processing, stopping criteria,
  cache positions), which every contender pays.

Run on a GPU::

    python benchmarks/generate_breakdown.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import graphtree
from graphtree.bench.generate import tiny_llama

TOKENS = 64


class _Timed:
    """Wraps a forward: wall time per call and, with ``events``, CUDA-event time per call."""

    def __init__(self, fn: Callable[..., Any], events: bool) -> None:
        self.fn, self.events = fn, events
        self.cpu: list[float] = []
        self.pairs: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.events:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.cpu.append(time.perf_counter() - t0)
        if self.events:
            b.record()
            self.pairs.append((a, b))
        return out

    def gpu(self) -> list[float]:
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in self.pairs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers
    from transformers.modeling_outputs import CausalLMOutputWithPast

    model = tiny_llama(hidden=512, layers=8, vocab=32000, max_positions=256)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    original = model.forward
    hf_disable = model.generation_config.disable_compile
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + TOKENS)
    logits = torch.zeros(1, 1, 32000, device="cuda")

    def nothing(input_ids: torch.Tensor, past_key_values: Any = None, **_: Any) -> Any:
        return CausalLMOutputWithPast(logits=logits, past_key_values=past_key_values)

    graphed = graphtree.graphed(original, name="LlamaForCausalLM.forward")
    ways: dict[str, tuple[Callable[..., Any], dict[str, Any]]] = {
        "eager, one cache": (original, {"past_key_values": cache, "disable_compile": True}),
        "graphtree, one cache": (graphed, {"past_key_values": cache, "disable_compile": True}),
        "graphtree, fresh cache": (graphed, {"cache_implementation": "static", "disable_compile": True}),
        "HF default, fresh cache": (original, {"cache_implementation": "static", "disable_compile": hf_disable}),
        # HF's default without a static cache: a DynamicCache, one length more every step (issue 27, item 5)
        "eager, dynamic cache": (original, {"disable_compile": True}),
        "graphtree, dynamic cache": (graphed, {"disable_compile": True}),
        "forward does nothing": (nothing, {"past_key_values": cache, "disable_compile": True}),
    }
    rows: dict[str, dict[str, float]] = {}
    want = None
    with torch.inference_mode():
        for name, (fwd, kw) in ways.items():
            timed = _Timed(fwd, events=fwd is not nothing)
            # HF's compile traces model.forward: a timer there would break its graph, so not timed
            model.forward = original if name.startswith("HF default") else timed
            totals, first = [], 0.0
            try:
                for r in range(args.repeats + 1):
                    timed.cpu.clear()
                    timed.pairs.clear()
                    cache.reset()
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    out = model.generate(ids, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, **kw)
                    torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    if r == 0:
                        first = dt
                        if fwd is not nothing:
                            want = out if want is None else want
                            assert torch.equal(out, want), f"{name}: tokens differ from eager's"
                    else:
                        totals.append(dt / TOKENS)
                gpu = timed.gpu()
            finally:
                model.forward = original
            decode_cpu = timed.cpu[1:]  # the prefill left out
            rows[name] = {
                "total_ms": statistics.median(totals) * 1e3,
                "first_generate_s": first,
                "forward_cpu_us": statistics.median(decode_cpu) * 1e6 if decode_cpu else 0.0,
                "forward_gpu_us": statistics.median(gpu[1:]) * 1e6 if len(gpu) > 1 else 0.0,
            }
            print(
                f"{name:26s} {rows[name]['total_ms']:7.3f} ms/token  first {first:6.2f} s  forward: CPU "
                f"{rows[name]['forward_cpu_us']:7.1f} us, GPU {rows[name]['forward_gpu_us']:7.1f} us",
                flush=True,
            )
    hf = rows["forward does nothing"]["total_ms"]
    base = rows["HF default, fresh cache"]["total_ms"]
    for name, r in rows.items():
        print(f"{name:26s} {r['total_ms'] / base:5.2f}x HF default; HF's own Python {hf / r['total_ms']:4.0%} of it")
    s = graphtree.stats()
    print(s)
    print(
        "device:",
        torch.cuda.get_device_name(),
        "| torch",
        torch.__version__,
        "| transformers",
        transformers.__version__,
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "stats": s.as_dict(), "device": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
