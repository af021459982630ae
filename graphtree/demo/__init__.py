"""The ``graphtree demo``: a GPT-style decode loop, run eagerly and then graphed, compared.

:func:`run` is what ``graphtree demo`` calls (:mod:`graphtree.cli` only parses the arguments);
the model is :mod:`graphtree.demo.gpt`. Both are code like a user's: a profile of the demo
attributes its graph kernels to the lines of :mod:`graphtree.demo.gpt` that were captured.

Example::

    >>> from graphtree.demo import run
    >>> run(steps=8, layers=2, d_model=64, heads=4)  # doctest: +SKIP
    0
"""

from __future__ import annotations

import statistics
import sys

__all__ = ["DEFAULTS", "NO_GPU", "run"]

NO_GPU = "No CUDA GPU found: running eagerly on the CPU (graphs need a GPU; see `graphtree doctor`)"
_SKIP = 3  # first steps left out of the medians: warm-up and recording

# Defaults: (GPU, CPU). The CPU config is tiny so that the demo ends in seconds.
DEFAULTS = {
    "steps": (64, 8),
    "layers": (12, 2),
    "d_model": (768, 64),
    "heads": (12, 4),
    "max_seq": (256, 64),
}


def _median_ms(times: list[float], skip: int) -> float:
    kept = times[skip:] if len(times) > skip else times
    return statistics.median(kept) * 1e3 if kept else float("nan")


def _stats_summary(stats: object) -> list[str]:
    eager = getattr(stats, "eager", {}) or {}
    n_eager = sum(eager.values())
    reasons = ", ".join(f"{reason}: {count}" for reason, count in sorted(eager.items()))
    lines = [
        f"  recordings: {getattr(stats, 'recordings', '?')}",
        f"  replays:    {getattr(stats, 'replays', '?')}",
        f"  warm-ups:   {getattr(stats, 'warmups', '?')}",
        f"  eager runs: {n_eager}" + (f" ({reasons})" if reasons else ""),
    ]
    pool = getattr(stats, "pool_bytes", None)
    if pool:
        lines.append(f"  pool:       {pool / 2**20:.1f} MiB")
    note = getattr(stats, "note", "")
    if note:
        lines.append(f"  note:       {note}")
    return lines


def run(
    *,
    steps: int | None = None,
    layers: int | None = None,
    d_model: int | None = None,
    heads: int | None = None,
    batch: int = 1,
    vocab: int = 50304,
    dtype: str = "float32",
    seed: int = 0,
    describe: bool = False,
) -> int:
    """Decode greedily with a random :class:`~graphtree.demo.gpt.TinyGPT`, eagerly and then
    through :func:`graphtree.graphed`; print per-step medians and the speedup (on a GPU; on the CPU
    both runs are eager and it says so instead), whether the tokens match, and graphtree's statistics.

    ``None`` picks the default for this machine (:data:`DEFAULTS`: GPU, CPU). Returns 0 when the
    eager and graphed tokens match, 1 when they differ, and 2 (with a message on stderr) for
    invalid sizes.
    """
    import torch

    import graphtree
    from graphtree.demo.gpt import GPTConfig, TinyGPT, greedy_decode

    cuda = torch.cuda.is_available()
    pick = 0 if cuda else 1
    steps = steps if steps is not None else DEFAULTS["steps"][pick]
    layers = layers if layers is not None else DEFAULTS["layers"][pick]
    d_model = d_model if d_model is not None else DEFAULTS["d_model"][pick]
    heads = heads if heads is not None else DEFAULTS["heads"][pick]
    problems = [
        f"--{flag} must be at least 1 (got {value})"
        for flag, value in (
            ("steps", steps),
            ("layers", layers),
            ("d-model", d_model),
            ("heads", heads),
            ("batch", batch),
            ("vocab", vocab),
        )
        if value < 1
    ]
    if not problems and d_model % heads:
        problems.append(f"--d-model ({d_model}) must be divisible by --heads ({heads})")
    if problems:
        for msg in problems:
            print(f"graphtree demo: error: {msg}", file=sys.stderr)
        return 2

    if not cuda:
        print(NO_GPU)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    cfg = GPTConfig(
        n_layer=layers,
        n_head=heads,
        d_model=d_model,
        vocab=vocab,
        max_seq=max(steps, DEFAULTS["max_seq"][pick]),
    )
    model = TinyGPT(cfg, batch=batch, device=device, dtype=getattr(torch, dtype), seed=seed)
    first = (torch.arange(batch, dtype=torch.long, device=device) % cfg.vocab).view(-1, 1)

    dev_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device:  {device} ({dev_name})")
    print(f"torch:   {torch.__version__}")
    print(
        f"model:   TinyGPT, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocab "
        f"{cfg.vocab}, KV cache {cfg.max_seq} positions, batch {batch}, {dtype}, random weights"
    )
    print(f"decode:  {steps} greedy steps")

    with torch.inference_mode():
        eager_tokens, eager_times = greedy_decode(model.decode_step, model, first, steps)
        model.reset_cache()
        graphtree.reset()
        step = graphtree.graphed(model.decode_step)
        graphed_tokens, graphed_times = greedy_decode(step, model, first, steps, before_step=graphtree.mark_step)

    eager_ms = _median_ms(eager_times, _SKIP)
    graphed_ms = _median_ms(graphed_times, _SKIP)
    skipped = (
        f"medians leave out the first {_SKIP} steps (warm-up and recording)"
        if steps > _SKIP
        else f"only {steps} steps, so medians include the warm-up and recording steps"
    )
    print()
    if cuda:
        print(f"eager:   {eager_ms:.3f} ms/step (median)")
        print(f"graphed: {graphed_ms:.3f} ms/step (median)")
        print(f"         {skipped}")
        speedup = eager_ms / graphed_ms if graphed_ms > 0 else float("nan")
        print(f"speedup: {speedup:.2f}x")
    else:  # both runs were eager: a ratio of two eager timings would say nothing about graphs
        print("CPU: graphs not available, eager only (both runs were eager, so no timings are compared)")

    match = torch.equal(eager_tokens.cpu(), graphed_tokens.cpu())
    print(f"tokens match: {'yes' if match else 'no'}")
    if not match:
        differ = (eager_tokens.cpu() != graphed_tokens.cpu()).any(dim=0).nonzero()
        print(f"         first differing step: {int(differ[0])}")

    print()
    print("graphtree stats:")
    for line in _stats_summary(graphtree.stats()):
        print(line)
    if describe:
        print()
        print(graphtree.describe())
    return 0 if match else 1
