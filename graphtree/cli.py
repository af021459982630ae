"""The ``graphtree`` command line (also ``python -m graphtree``).

Subcommands:

- ``graphtree doctor [--json] [--speed]``: can CUDA graphs run here, and if not, why (see
  :func:`graphtree.debug.doctor`); ``--speed`` also times the GPU against its nominal peaks
  (:mod:`graphtree.debug.speed`; exits 2 without a GPU).
- ``graphtree demo [--steps N] [--layers L] [--d-model D] [--heads H] [--batch B]``: a GPT-style
  decode loop, run eagerly and then graphed, with timings, a token-for-token comparison and
  graphtree's statistics (:func:`graphtree.demo.run`).
- ``graphtree bench ...``: the benchmarks (:mod:`graphtree.bench`); arguments pass through.
- ``graphtree profile -o trace.json -- python script.py args...``: profile a script
  (:mod:`graphtree.profile.cli`); arguments pass through.
- ``graphtree debug rerun DUMP``: run a dumped failing call again in a fresh process
  (:mod:`graphtree.debug.rerun`); arguments pass through.

``graphtree --version`` prints graphtree's, torch's and Python's versions.

Example::

    $ graphtree --version
    $ graphtree doctor
    $ graphtree demo --steps 128
    $ python -m graphtree profile -o trace.json -- python train.py --epochs 1
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import types
from collections.abc import Sequence

__all__ = ["main"]

# Subcommands whose arguments are handed on untouched: name -> (module, extra to install).
_PASSTHROUGH = {
    "bench": ("graphtree.bench", "pip install 'graphtree[bench]'"),
    "profile": ("graphtree.profile.cli", "pip install 'graphtree[profile]'"),
    "debug": ("graphtree.debug.rerun", "pip install -e ."),
}


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphtree",
        description="Safe, fast and observable CUDA graphs for ordinary PyTorch code.",
    )
    parser.add_argument("--version", action="store_true", help="print graphtree's and torch's versions and exit")
    sub = parser.add_subparsers(dest="command", metavar="{doctor,demo,bench,profile,debug}")

    p = sub.add_parser("doctor", help="say whether CUDA graphs can run here, and why not")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--speed",
        action="store_true",
        help="also measure matmul, copies, launches and graph replays against the GPU's peaks (under a minute)",
    )

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
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32", help="default: float32")
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


def version_line() -> str:
    """``graphtree X.Y.Z (torch A.B.C, Python D.E.F)``: the installed distribution's version
    (``graphtree.__version__`` when graphtree runs from a source tree without being installed)."""
    from importlib import metadata

    try:
        version = metadata.version("graphtree")
    except metadata.PackageNotFoundError:
        import graphtree

        version = graphtree.__version__
    try:
        import torch

        torch_version = f"torch {torch.__version__}"
    except Exception as e:  # noqa: BLE001 - a broken torch must not hide graphtree's version
        torch_version = f"torch not importable: {type(e).__name__}"
    return f"graphtree {version} ({torch_version}, Python {sys.version.split()[0]})"


def _cmd_doctor(args: argparse.Namespace) -> int:
    try:
        from graphtree.debug import doctor
    except Exception as e:  # noqa: BLE001
        print(f"graphtree doctor could not start: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    report = doctor()
    if not args.speed:
        if args.json:
            print(json.dumps(report.as_dict(), indent=2))
        else:
            print(report.render())
        return 0
    from graphtree.debug.speed import speed_test

    if not args.json:
        print(report.render())
        print()
    try:
        speed = speed_test(progress=not args.json)
    except RuntimeError as e:
        print(f"graphtree doctor --speed: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**report.as_dict(), "speed": speed.as_dict()}, indent=2))
    else:
        print(speed.render())
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from graphtree.demo import run

    return run(
        steps=args.steps,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        batch=args.batch,
        vocab=args.vocab,
        dtype=args.dtype,
        seed=args.seed,
        describe=args.describe,
    )


def main(argv: Sequence[str] | None = None) -> int:
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
    if args.version:
        print(version_line())
        return 0
    if args.command == "doctor":
        return _cmd_doctor(args)
    if args.command == "demo":
        return _cmd_demo(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
