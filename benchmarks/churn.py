"""What a graphed callable costs when its signatures keep changing (issue 27, item 5), against eager.

A 20-layer MLP fed a new batch size on each of 100 calls (with and without a host read inside), and
Hugging Face ``generate()`` with its default dynamic cache (a new sequence length every decode step)
with ``model.forward`` graphed. Prints median and mean ms per call (or per generate; the first left
out, warm-ups in the mean) and their ratios to eager, in one process; run on a GPU::

    python benchmarks/churn.py [--json out.json]
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


def _mlp(host_read: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(20)]).cuda().eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = net(x)
        if host_read and y.sum().item() > 1e9:
            y = y + 1
        return y

    return f


def _per_call(fn: Callable[[int], Any], calls: int) -> tuple[float, float]:
    """Median and mean seconds per call, the first call left out."""
    times = []
    for i in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(i)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]), statistics.fmean(times[1:])


def _row(eager: tuple[float, float], graphed: tuple[float, float]) -> dict[str, float]:
    return {
        "eager_ms": eager[0] * 1e3,
        "graphtree_ms": graphed[0] * 1e3,
        "ratio": graphed[0] / eager[0],
        "eager_mean_ms": eager[1] * 1e3,
        "graphtree_mean_ms": graphed[1] * 1e3,
        "mean_ratio": graphed[1] / eager[1],
    }


def churning_mlp(host_read: bool, calls: int = 100) -> dict[str, float]:
    f = _mlp(host_read)
    g = graphtree.graphed(f)
    # The same batch sizes for both (with a host read, each call waits for its GPU work, so larger
    # batches would cost graphtree GPU time, not overhead); graphtree has seen none of them. cuBLAS
    # has: each size is run once first, so that neither side pays its heuristics' first look-up.
    xs = [torch.randn(1 + i, 256, device="cuda") for i in range(calls + 1)]
    with torch.inference_mode():
        for x in xs:
            f(x)
        eager = _per_call(lambda i: f(xs[i]), calls)
        graphtree.reset()
        graphed = _per_call(lambda i: (graphtree.mark_step(), g(xs[i])), calls)
    return _row(eager, graphed)


def dynamic_cache_generate(runs: int = 5) -> dict[str, float]:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
    )
    model = transformers.LlamaForCausalLM(cfg).cuda().eval()
    model.generation_config.pad_token_id = 0
    ids = torch.randint(1, 1024, (1, 16), device="cuda")

    def gen(_: int) -> Any:
        with torch.inference_mode():
            return model.generate(ids, max_new_tokens=64, do_sample=False)

    eager_out = gen(0)
    eager = _per_call(gen, runs)
    model.forward = graphtree.graphed(model.forward)
    assert torch.equal(gen(0), eager_out), "tokens differ from eager"
    graphed = _per_call(gen, runs)
    return _row(eager, graphed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name, run in (
        ("mlp, new batch size each call", lambda: churning_mlp(False)),
        ("mlp, new batch size each call, .item() inside", lambda: churning_mlp(True)),
        ("generate(), default dynamic cache", dynamic_cache_generate),
    ):
        graphtree.reset()
        try:
            out[name] = r = run()
            print(
                f"{name}: median eager {r['eager_ms']:.3f} ms, graphtree {r['graphtree_ms']:.3f} ms, {r['ratio']:.2f}x;"
                f" mean {r['eager_mean_ms']:.3f} / {r['graphtree_mean_ms']:.3f} ms, {r['mean_ratio']:.2f}x"
            )
        except Exception as e:  # noqa: BLE001 - report and go on
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {type(e).__name__}: {e}")
        print("  ", graphtree.stats())
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
