"""What a graphed callable costs when its signatures keep changing (issue 27, item 5), against eager.

A 20-layer MLP fed a new batch size on each of 100 calls (with and without a host read inside), and
Hugging Face ``generate()`` with its default dynamic cache (a new sequence length every decode step)
with ``model.forward`` graphed. Eager and graphtree calls are taken in turn, which goes first
alternating (clocks drift alike for both). Prints median and mean ms per call (or per generate; the
first left out, warm-ups in the mean), their ratios to eager and the median of each call's own
ratio, in one process; then what a churning call costs the host, graphtree
against eager with no synchronisation, and where graphtree's share goes (cProfile). Run on a GPU::

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
from graphtree import _native


def _mlp(host_read: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(20)]).cuda().eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        y = net(x)
        if host_read and y.sum().item() > 1e9:
            y = y + 1
        return y

    return f


def _timed(fn: Callable[[], Any]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _interleaved(eager: Callable[[int], Any], graphed: Callable[[int], Any], calls: int) -> tuple[list, list]:
    """Seconds of each call of ``eager(i)`` and ``graphed(i)``, taken in turn so that clocks and the
    host's load drift alike for both, the first of the pair alternating (eager first on even
    calls); the first call of each left out."""
    e, g = [], []
    for i in range(calls):
        pair = [(e, eager), (g, graphed)]
        for times, fn in pair if i % 2 == 0 else pair[::-1]:
            times.append(_timed(lambda: fn(i)))  # noqa: B023 - called at once
    return e[1:], g[1:]


def _row(eager: list[float], graphed: list[float]) -> dict[str, float]:
    """Medians, means and their ratios, and the median of the calls' own ratios (each call's shape
    and moment the same on both sides): host noise moves a median of one side alone by several
    per cent on the H200 (twenty-fourth session: 0.93x to 1.21x across runs of the same code)."""
    e, g = (statistics.median(eager), statistics.fmean(eager)), (statistics.median(graphed), statistics.fmean(graphed))
    return {
        "eager_ms": e[0] * 1e3,
        "graphtree_ms": g[0] * 1e3,
        "ratio": g[0] / e[0],
        "paired_ratio": statistics.median(b / a for a, b in zip(eager, graphed)),
        "eager_mean_ms": e[1] * 1e3,
        "graphtree_mean_ms": g[1] * 1e3,
        "mean_ratio": g[1] / e[1],
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
        graphtree.reset()

        def graphed_call(i: int) -> Any:
            graphtree.mark_step()
            return g(xs[i])

        eager, graphed = _interleaved(lambda i: f(xs[i]), graphed_call, calls)
    return _row(eager, graphed)


def churn_cost(per_rep: int = 200, reps: int = 5, top: int = 12) -> dict[str, Any]:
    """What graphtree's decision costs once a callable churns (item 6: "costs less"): the CPU
    microseconds of a churning call of the same 20-layer MLP, graphtree against eager, with no
    synchronisation (the host's cost alone), and the functions graphtree's calls spent their own
    time in (cProfile, ``top`` of graphtree's functions): the bookkeeping to cut. Every graphed call meets a shape
    it never met (a signature met before is warmed up and recorded: that is not churn)."""
    import cProfile
    import io
    import pstats

    f = _mlp(False)
    g = graphtree.graphed(f)
    base = torch.randn(40, 40, 256, device="cuda")
    views = [base[:a, :b] for a in range(1, 41) for b in range(1, 41)]  # 1,600 shapes, no new memory
    need = 40 + per_rep * (reps + 1)
    if need > len(views):
        raise ValueError(f"per_rep * (reps + 1) + 40 must be at most {len(views)}, got {need}")
    chunks = [views[40 + k * per_rep : 40 + (k + 1) * per_rep] for k in range(reps + 1)]

    def cpu_us(fn: Callable[[torch.Tensor], Any], xs: list[torch.Tensor]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in xs:
            graphtree.mark_step()
            fn(x)
        t = time.perf_counter() - t0
        torch.cuda.synchronize()
        return t / len(xs) * 1e6

    with torch.inference_mode():
        for x in views[:need]:
            f(x)  # (cuBLAS has met every size)
        graphtree.reset()
        cpu_us(g, views[:40])  # past the warm-ups: churning
        eager, graphed = [], []
        for xs in chunks[:reps]:
            eager.append(cpu_us(f, xs))
            graphed.append(cpu_us(g, xs))
        prof = cProfile.Profile()
        prof.enable()
        cpu_us(g, chunks[reps])
        prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats("graphtree", top)
    e, gr = statistics.median(eager), statistics.median(graphed)
    return {"eager_cpu_us": e, "graphtree_cpu_us": gr, "extra_us": gr - e, "profile": text.getvalue()}


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

    graphed_forward: Any = graphtree.graphed(model.forward)

    def with_graphtree(i: int) -> Any:
        model.forward = graphed_forward
        try:
            return gen(i)
        finally:
            del model.forward  # (the class's forward again: eager)

    eager_out = gen(0)
    assert torch.equal(with_graphtree(0), eager_out), "tokens differ from eager"
    eager, graphed = _interleaved(gen, with_graphtree, runs + 1)
    return _row(eager, graphed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    _native.wait(600)  # (they load in the background; a long-running process has them)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    out["native"] = _native.status()
    for name, run in (
        ("mlp, new batch size each call", lambda: churning_mlp(False)),
        ("mlp, new batch size each call, .item() inside", lambda: churning_mlp(True)),
        ("generate(), default dynamic cache", dynamic_cache_generate),
    ):
        graphtree.reset()
        try:
            out[name] = r = run()
            print(
                f"{name}: median eager {r['eager_ms']:.3f} ms, graphtree {r['graphtree_ms']:.3f} ms, {r['ratio']:.2f}x"
                f" (calls' own ratios: median {r['paired_ratio']:.2f}x);"
                f" mean {r['eager_mean_ms']:.3f} / {r['graphtree_mean_ms']:.3f} ms, {r['mean_ratio']:.2f}x"
            )
        except Exception as e:  # noqa: BLE001 - report and go on
            out[name] = {"error": f"{type(e).__name__}: {e}"}
            print(f"{name}: {type(e).__name__}: {e}")
        print("  ", graphtree.stats())
    graphtree.reset()
    cost = out["churning call's cost on the host"] = churn_cost()
    print(
        f"a churning call's CPU cost (no sync): eager {cost['eager_cpu_us']:.1f} us, graphtree "
        f"{cost['graphtree_cpu_us']:.1f} us, +{cost['extra_us']:.1f} us; graphtree's own time:\n{cost['profile']}"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
