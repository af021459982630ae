"""The ``graphtree`` command line (also ``python -m graphtree``).

Subcommands:

- ``graphtree doctor [--json]``: can CUDA graphs run here, and if not, why (see
  :func:`graphtree.debug.doctor`).
- ``graphtree demo [--steps N] [--layers L] [--d-model D] [--heads H] [--batch B]``: a GPT-style
  decode loop, run eagerly and then graphed, with timings, a token-for-token comparison and
  graphtree's statistics.
- ``graphtree bench ...``: the benchmarks (:mod:`graphtree.bench`); arguments pass through.
- ``graphtree profile -o trace.json -- python script.py args...``: profile a script
  (:mod:`graphtree.profile.cli`); arguments pass through.

Example::

    $ graphtree doctor
    $ graphtree demo --steps 128
    $ python -m graphtree profile -o trace.json -- python train.py --epochs 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import types
from typing import Optional, Sequence

__all__ = ["main"]

_NO_GPU = "No CUDA GPU found: running eagerly on the CPU (graphs need a GPU; see `graphtree doctor`)"
_SKIP = 3  # first steps left out of the medians: warm-up and recording

# Defaults of `demo`: (GPU, CPU). The CPU config is tiny so that the demo ends in seconds.
_DEMO_DEFAULTS = {
    "steps": (64, 8),
    "layers": (12, 2),
    "d_model": (768, 64),
    "heads": (12, 4),
    "max_seq": (256, 64),
}

# Subcommands whose arguments are handed on untouched: name -> (module, extra to install).
_PASSTHROUGH = {
    "bench": ("graphtree.bench", "pip install 'graphtree[bench]'"),
    "profile": ("graphtree.profile.cli", "pip install 'graphtree[profile]'"),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphtree",
        description="Safe, fast and observable CUDA graphs for ordinary PyTorch code.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{doctor,demo,bench,profile}")

    p = sub.add_parser("doctor", help="say whether CUDA graphs can run here, and why not")
    p.add_argument("--json", action="store_true", help="print the report as JSON")

    p = sub.add_parser(
        "demo",
        help="decode with a GPT-style model, eagerly and graphed, and compare",
        description="Greedy decoding with a randomly initialised GPT-style model and a static KV "
        "cache, first eagerly, then through graphtree.graphed; prints per-step medians, the "
        "speedup, whether the tokens match, and graphtree's statistics. Without a GPU a tiny model "
        "runs on the CPU and the 'graphed' run is eager too.",
    )
    p.add_argument("--steps", type=int, default=None, help="decode steps (default: 64 on GPU, 8 on CPU)")
    p.add_argument("--layers", type=int, default=None, help="transformer layers (default: 12 on GPU, 2 on CPU)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default: 768 on GPU, 64 on CPU)")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default: 12 on GPU, 4 on CPU)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default: 1)")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary size (default: 50304)")
    p.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="default: float32"
    )
    p.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default: 0)")
    p.add_argument("--describe", action="store_true", help="also print graphtree.describe()")

    for name, (module, _) in _PASSTHROUGH.items():
        p = sub.add_parser(name, help=f"run {module} (arguments are passed through)", add_help=False)
        p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


def _passthrough(name: str, rest: list[str]) -> int:
    """Hand ``rest`` untouched to ``<module>.main`` of a lazily imported subcommand."""
    module, extra = _PASSTHROUGH[name]
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        print(
            f"graphtree {name} is not available: cannot import {module} ({type(e).__name__}: {e}).\n"
            f"If a dependency is missing: {extra}",
            file=sys.stderr,
        )
        return 2
    entry = getattr(mod, "main", None)
    if isinstance(entry, types.ModuleType):  # a ``main`` submodule rather than a function
        entry = getattr(entry, "main", None)
    if not callable(entry):
        print(f"graphtree {name} is not available: {module} has no main() function.", file=sys.stderr)
        return 2
    try:
        rc = entry(rest)
    except SystemExit as e:  # an argparse error or --help inside the subcommand
        rc = e.code
    return exit_status(rc)


def exit_status(code: object) -> int:
    """A process exit status from what ``sys.exit`` was given (None: 0; an int as is; any other
    value is printed to stderr, as Python does, and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _cmd_doctor(args: argparse.Namespace) -> int:
    try:
        from graphtree.debug import doctor
    except Exception as e:  # noqa: BLE001
        print(f"graphtree doctor could not start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report = doctor()
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        print(report.render())
    return 0


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


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch

    import graphtree
    from graphtree._gpt import GPTConfig, TinyGPT, greedy_decode

    cuda = torch.cuda.is_available()
    pick = 0 if cuda else 1
    steps = args.steps if args.steps is not None else _DEMO_DEFAULTS["steps"][pick]
    layers = args.layers if args.layers is not None else _DEMO_DEFAULTS["layers"][pick]
    d_model = args.d_model if args.d_model is not None else _DEMO_DEFAULTS["d_model"][pick]
    heads = args.heads if args.heads is not None else _DEMO_DEFAULTS["heads"][pick]
    problems = [
        f"--{flag} must be at least 1 (got {value})"
        for flag, value in (("steps", steps), ("layers", layers), ("d-model", d_model), ("heads", heads),
                            ("batch", args.batch), ("vocab", args.vocab))
        if value < 1
    ]
    if not problems and d_model % heads:
        problems.append(f"--d-model ({d_model}) must be divisible by --heads ({heads})")
    if problems:
        for msg in problems:
            print(f"graphtree demo: error: {msg}", file=sys.stderr)
        return 2

    if not cuda:
        print(_NO_GPU)
    device = torch.device("cuda") if cuda else torch.device("cpu")
    dtype = getattr(torch, args.dtype)
    cfg = GPTConfig(
        n_layer=layers, n_head=heads, d_model=d_model, vocab=args.vocab,
        max_seq=max(steps, _DEMO_DEFAULTS["max_seq"][pick]),
    )
    model = TinyGPT(cfg, batch=args.batch, device=device, dtype=dtype, seed=args.seed)
    first = (torch.arange(args.batch, dtype=torch.long, device=device) % cfg.vocab).view(-1, 1)

    dev_name = torch.cuda.get_device_name(device) if cuda else "CPU"
    print(f"device:  {device} ({dev_name})")
    print(f"torch:   {torch.__version__}")
    print(
        f"model:   TinyGPT, {cfg.n_layer} layers, d_model {cfg.d_model}, {cfg.n_head} heads, vocab "
        f"{cfg.vocab}, KV cache {cfg.max_seq} positions, batch {args.batch}, {args.dtype}, random weights"
    )
    print(f"decode:  {steps} greedy steps")

    with torch.inference_mode():
        eager_tokens, eager_times = greedy_decode(model.decode_step, model, first, steps)
        model.reset_cache()
        graphtree.reset()
        step = graphtree.graphed(model.decode_step)
        graphed_tokens, graphed_times = greedy_decode(
            step, model, first, steps, before_step=graphtree.mark_step
        )

    eager_ms = _median_ms(eager_times, _SKIP)
    graphed_ms = _median_ms(graphed_times, _SKIP)
    skipped = (
        f"medians leave out the first {_SKIP} steps (warm-up and recording)"
        if steps > _SKIP
        else f"only {steps} steps, so medians include the warm-up and recording steps"
    )
    graphed_note = "" if cuda else "; no CUDA, so this run was eager too"
    print()
    print(f"eager:   {eager_ms:.3f} ms/step (median)")
    print(f"graphed: {graphed_ms:.3f} ms/step (median{graphed_note})")
    print(f"         {skipped}")
    speedup = eager_ms / graphed_ms if graphed_ms > 0 else float("nan")
    note = "" if cuda else " (without CUDA both runs are eager, so expect about 1x)"
    print(f"speedup: {speedup:.2f}x{note}")

    match = torch.equal(eager_tokens.cpu(), graphed_tokens.cpu())
    print(f"tokens match: {'yes' if match else 'no'}")
    if not match:
        differ = (eager_tokens.cpu() != graphed_tokens.cpu()).any(dim=0).nonzero()
        print(f"         first differing step: {int(differ[0])}")

    print()
    print("graphtree stats:")
    for line in _stats_summary(graphtree.stats()):
        print(line)
    if args.describe:
        print()
        print(graphtree.describe())
    return 0 if match else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``graphtree`` command line and return its exit status.

    ``bench`` and ``profile`` hand every argument after their name, untouched, to
    ``graphtree.bench.main`` and ``graphtree.profile.cli.main`` (imported only then; if they
    cannot be imported the status is 2). ``doctor`` returns 0 whenever it could report; ``demo``
    returns 0 when the eager and graphed tokens match and 1 otherwise.

    Example::

        >>> from graphtree.cli import main
        >>> main(["doctor", "--json"])  # doctest: +SKIP
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _PASSTHROUGH:
        return _passthrough(argv[0], argv[1:])

    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help or a usage error
        return e.code if isinstance(e.code, int) else 2
    if args.command == "doctor":
        return _cmd_doctor(args)
    if args.command == "demo":
        return _cmd_demo(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
