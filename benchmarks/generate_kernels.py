"""GPU kernels per generated token (issue 27, item 3): how many, and how long they run, for Hugging Face
``generate()`` eager, graphed by graphtree, and compiled by HF's own default, in one process.

The model of ``generate_breakdown.py`` (a random-weight 8-layer, d=512 Llama, an 8-token prompt,
greedy, batch 1, a kept ``StaticCache``). Each way is called three times, then once more under
``torch.profiler`` (CUDA activity: CUPTI sees the kernels a graph replay launches too). Per token:
the number of kernels (memcopies and memsets counted with them), the sum of their durations, and
the wall time of that ``generate()``.
``generate()`` reads its stopping criteria on the host every token, so the GPU sits idle while
Hugging Face's Python runs: a token costs about that Python plus the step's kernel time, and the
kernel time is what a graph of unfused kernels (graphtree) and inductor's fused ones (HF's
default) differ in. Run on a GPU::

    python benchmarks/generate_kernels.py [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

import graphtree
from graphtree.bench.generate import tiny_llama


def kernel_totals(prof: Any) -> tuple[int, float]:
    """(kernels, their summed duration in seconds) among a finished profiler's events."""
    count, total_us = 0, 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            count += 1
            total_us += e.device_time_total
    return count, total_us * 1e-6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("generate_kernels.py counts CUDA kernels: it needs a GPU")
    import transformers

    tokens = args.tokens
    model = tiny_llama(hidden=512, layers=8, vocab=32000, max_positions=256)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    original = model.forward
    hf_disable = model.generation_config.disable_compile
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + tokens)
    graphed = graphtree.graphed(original, name="LlamaForCausalLM.forward")
    ways = {
        "eager": (original, True),
        "graphtree": (graphed, True),
        "HF default (compiled)": (original, hf_disable),
    }
    rows: dict[str, dict[str, float]] = {}
    want = None
    with torch.inference_mode():
        for name, (forward, disable) in ways.items():
            model.forward = forward
            kw = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
            kw.update(past_key_values=cache, disable_compile=disable)
            try:
                for _ in range(3):
                    cache.reset()
                    out = model.generate(ids, **kw)
                torch.cuda.synchronize()
                cache.reset()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    t0 = time.perf_counter()
                    out = model.generate(ids, **kw)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - t0
            finally:
                model.forward = original
            want = out if want is None else want
            count, busy = kernel_totals(prof)
            rows[name] = {
                "kernels_per_token": count / tokens,
                "kernel_us_per_token": busy / tokens * 1e6,
                "wall_ms_per_token": wall / tokens * 1e3,
                "equal": bool(torch.equal(out, want)),
            }
            r = rows[name]
            print(
                f"{name:22s} {r['kernels_per_token']:6.1f} kernels/token  {r['kernel_us_per_token']:8.1f} us of "
                f"kernels/token  wall {r['wall_ms_per_token']:6.3f} ms/token (profiled)  tokens "
                f"{'equal' if r['equal'] else 'DIFFER'}",
                flush=True,
            )
    print(graphtree.stats())
    where = torch.cuda.get_device_name()
    print("device:", where, "| torch", torch.__version__, "| transformers", transformers.__version__)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "device": where, "torch": torch.__version__, "tokens": tokens}, f, indent=1)


if __name__ == "__main__":
    main()
