"""A CPU-bound decode loop: graphtree against the graph a user writes by hand, per step (issue 47).

The demo GPT (``graphtree.demo.gpt.TinyGPT``) at batch 1, 4 layers of ``d_model`` 256, decoding
greedily. Each step is what a serving loop does: the model's step, ``argmax`` of the logits, the
position advanced in place. Three ways, taken in turn within each round (clocks drift alike):

- ``hand``: ``torch.cuda.graph`` captured once around ``model.decode_step`` on static buffers
  (``graphtree.bench``'s ``HandGraph``); per step, the tokens and the position copied in,
  ``graph.replay()``, the static logits read;
- ``graphtree``: ``graphtree.graphed(model.decode_step)`` called with the step's tokens;
- ``eager``: ``model.decode_step`` itself.

Two timings per way, each the median over rounds of (time of ``--steps`` steps) / steps:

- ``synced``: the host waits for each step's token before the next, as ``generate()`` does to
  check its stopping criteria; the step's CPU cost adds to its GPU time.
- ``queued``: no wait until the last step: the CPU runs ahead, as far as the GPU lets it.

Issue 47's acceptance: graphtree within 1.05x of ``hand`` per step. Every way's tokens are
compared with eager's (``equal``). Run on a GPU::

    python benchmarks/decode_loop.py [--steps 200] [--rounds 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

import graphtree
from graphtree import _native
from graphtree.bench.contenders import HandGraph
from graphtree.demo.gpt import GPTConfig, TinyGPT

Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def hand_graph(model: TinyGPT) -> Step:
    """The hand-written graph of ``model.decode_step`` (``graphtree.bench``'s ``HandGraph``: static
    tokens and position, three warm-ups on a side stream, one capture; a call copies both in)."""
    dev = model.device
    tokens = torch.zeros(model.batch, 1, dtype=torch.long, device=dev)
    return HandGraph(model.decode_step, tokens, torch.zeros((), dtype=torch.long, device=dev), warmup=3)


def decode(step: Step, model: TinyGPT, steps: int, synced: bool) -> tuple[torch.Tensor, float]:
    """``steps`` greedy steps from token 0 on a zeroed cache; the tokens and seconds per step."""
    model.reset_cache()
    dev = model.device
    tokens = torch.zeros(model.batch, 1, dtype=torch.long, device=dev)
    pos = torch.zeros((), dtype=torch.long, device=dev)
    out = []
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = step(tokens, pos).argmax(-1, keepdim=True)
        pos += 1
        out.append(tokens)
        if synced:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return torch.cat(out, dim=1), (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200, help="decode steps per timed loop (at most 256, the cache)")
    p.add_argument("--rounds", type=int, default=9, help="timed loops per way and mode; the median is reported")
    p.add_argument("--json", default=None, help="write the results here as well")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_loop.py measures CUDA graphs: run it on a machine with a GPU")
    cfg = GPTConfig(n_layer=4, n_head=4, d_model=256)
    if not 1 <= a.steps <= cfg.max_seq:
        sys.exit(f"--steps must be in [1, {cfg.max_seq}] (the demo GPT's cache), got {a.steps}")
    native = _native.wait(600)  # graphtree's C++ helpers, as a long-running process has them
    torch.manual_seed(0)
    model = TinyGPT(cfg, batch=1, device="cuda")
    ways: dict[str, Step] = {
        "eager": model.decode_step,
        "hand": hand_graph(model),
        "graphtree": graphtree.graphed(model.decode_step, name="decode_step"),
    }
    want, _ = decode(ways["eager"], model, a.steps, synced=True)
    times: dict[str, dict[str, list[float]]] = {w: {"synced": [], "queued": []} for w in ways}
    equal = dict.fromkeys(ways, True)
    with torch.inference_mode():
        for name in ways:  # warm-up loop of each way (graphtree records here)
            decode(ways[name], model, a.steps, synced=True)
        names = list(ways)
        for r in range(a.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # rotated each round
                for mode in ("synced", "queued"):
                    got, per_step = decode(ways[name], model, a.steps, synced=mode == "synced")
                    times[name][mode].append(per_step)
                    equal[name] = equal[name] and torch.equal(got, want)
    s = graphtree.stats()
    median = {w: {m: statistics.median(v) * 1e6 for m, v in modes.items()} for w, modes in times.items()}
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "graphtree_native": native is not None,
        "config": {"n_layer": cfg.n_layer, "d_model": cfg.d_model, "n_head": cfg.n_head, "vocab": cfg.vocab},
        "steps": a.steps,
        "rounds": a.rounds,
        "us_per_step": median,
        "graphtree_over_hand": {m: median["graphtree"][m] / median["hand"][m] for m in ("synced", "queued")},
        "eager_over_hand": {m: median["eager"][m] / median["hand"][m] for m in ("synced", "queued")},
        "equal_to_eager": equal,
        "graphtree_stats": {"replays": s.replays, "recordings": s.recordings, "eager": dict(s.eager)},
    }
    print(f"{result['device']}, torch {result['torch']}, native helpers: {result['graphtree_native']}")
    print(f"{'way':<10} {'synced us/step':>15} {'queued us/step':>15}   tokens equal to eager")
    for w in ways:
        print(f"{w:<10} {median[w]['synced']:>15.2f} {median[w]['queued']:>15.2f}   {equal[w]}")
    ratio = result["graphtree_over_hand"]
    print(f"graphtree / hand: synced {ratio['synced']:.3f}x, queued {ratio['queued']:.3f}x (issue 47: <= 1.05x)")
    print(f"graphtree: {s.replays} replays, {s.recordings} recordings, eager {dict(s.eager)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
