"""Where graphtree's CPU time goes in one graphed decode step of Hugging Face ``generate()`` (issue 27).

The model of ``generate_breakdown.py`` (8-layer d=512 Llama, a kept ``StaticCache``, 64 new tokens):
cProfile over whole ``generate()`` calls with ``model.forward`` graphed, the functions that take
the most time of their own; then the pieces of one replay timed alone: reading the call
(``read_call``), the graph launch by itself (``CUDAGraph.replay`` of the decode step's recording,
no inputs copied), and the whole graphed forward. Run on a GPU::

    python benchmarks/forward_cpu.py
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch

import graphtree
from graphtree.bench.generate import tiny_llama
from graphtree.tree import manager
from graphtree.tree.inputs import read_call

TOKENS = 64


def _us(fn: Callable[[], Any], before: Callable[[], Any], n: int = 32) -> float:
    """Best of five rounds of ``n`` calls, ``before()`` ahead of each round (the decode step writes
    the next position of the cache: at most ``n`` in a row after a reset, within its length)."""
    best = float("inf")
    for _ in range(5):
        before()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    import transformers

    from graphtree import _native

    _native.start()  # the C++ helpers (the object walk among them), as a process running a while has them
    print("native helpers:", "loaded" if _native.wait(300) is not None else _native.status())
    model = tiny_llama(hidden=512, layers=8, vocab=32000, max_positions=256)
    ids = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + TOKENS)
    graphed = graphtree.graphed(model.forward, name="LlamaForCausalLM.forward")
    seen: dict[str, Any] = {}

    def forward(*args: Any, **kwargs: Any) -> Any:
        seen["kwargs"] = kwargs  # the last call's: a decode step's
        return graphed(*args, **kwargs)

    model.forward = forward
    kw = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS, "do_sample": False, "past_key_values": cache}
    with torch.inference_mode():
        for _ in range(3):
            cache.reset()
            model.generate(ids, **kw)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            cache.reset()
            model.generate(ids, **kw)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats("graphtree", 25)
        print(out.getvalue())

        decode_kwargs = dict(seen["kwargs"])
        nodes = [n for m in manager.managers() for n in m.nodes()]
        node = max(nodes, key=lambda n: n.replays)
        print(f"{len(nodes)} recordings; the decode step's: {node.replays} replays")
        nothing = lambda: None  # noqa: E731
        read = _us(lambda: read_call((), decode_kwargs, None), nothing)
        print(f"read_call (the decode step's kwargs): {read:.1f} us")
        print(f"CUDAGraph.replay of the decode step alone: {_us(node.graph.replay, cache.reset):.1f} us")
        print(f"graphed forward, whole: {_us(lambda: graphed(**decode_kwargs), cache.reset):.1f} us")
        print(f"eager forward, whole: {_us(lambda: graphed.fn(**decode_kwargs), cache.reset):.1f} us")
    print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)
    print("transformers", transformers.__version__)
    print(graphtree.stats())


if __name__ == "__main__":
    main()
