"""``graphtree bench``: graphtree against eager, hand-written CUDA graphs and torch.compile.

One process, one GPU, under 8 minutes: nine scenarios (per-call overhead, decode, memory,
capture time, branching, generate, share, breaks, train), each running every contender
interleaved, with warm-up and medians over repeats, and checking every contender's output against
eager's. Writes ``bench.json``
(schema in ``benchmarks/README.md``), ``table.txt`` and ``bench.png`` into a results folder and
prints the table. A contender that fails is reported with its error and the run goes on.

Options:

- ``--out DIR`` -- results folder (default ``results/bench-<date>-<gpu>``; printed).
- ``--quick`` -- small sizes and few repeats: a smoke run of about a minute or two.
- ``--scenarios overhead,decode,memory,capture,branching,generate,share,breaks,train`` -- run only these.
  ``ddp`` and ``tp`` (a data-parallel training step, a tensor-parallel decode) run on every GPU,
  alone and under torchrun: ``torchrun --nproc-per-node 4 -m graphtree bench --scenarios ddp,tp``;
  rank 0 writes the results.
- ``--contenders eager,handwritten,...`` -- run only these contenders.
- ``--budget SECONDS`` -- the time budget the scenarios share (default 420, quick 240).
- ``--from-json FILE`` -- no GPU needed: validate a results file, print its table, re-plot it.

Without CUDA (and without ``--from-json``) it prints why and returns 2.

Example::

    $ graphtree bench --quick --scenarios overhead --out /tmp/bench
    $ python -m graphtree.bench
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = ["main"]

_SCENARIOS = ("overhead", "decode", "memory", "capture", "branching", "generate", "share", "breaks", "train")
_RANK_SCENARIOS = ("ddp", "tp")  # every GPU of the machine, one rank each, under torchrun (not by default)
_CONTENDERS = ("eager", "handwritten", "compile-reduce-overhead", "compile-cudagraphs", "graphtree")

TORCHRUN_HINT = "ddp and tp run alone under torchrun: torchrun --nproc-per-node N -m graphtree bench --scenarios ddp,tp"

NO_GPU_MESSAGE = (
    "graphtree bench: the benchmarks need a CUDA GPU, and none is available here "
    "(torch.cuda.is_available() is False; torch {torch}). Nothing was run.\n"
    "To look at results from a GPU machine: graphtree bench --from-json results/.../bench.json"
)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphtree bench",
        description="Benchmark graphtree against eager PyTorch, hand-written CUDA graphs and "
        "torch.compile (reduce-overhead, cudagraphs backend) on one GPU; writes a JSON file, a "
        "text table and a PNG plot into a results folder.",
    )
    p.add_argument("--out", metavar="DIR", default=None, help="results folder (default: results/bench-<date>-<gpu>)")
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats, for a fast smoke run")
    p.add_argument(
        "--scenarios",
        default=",".join(_SCENARIOS),
        help="comma-separated subset of: " + ",".join(_SCENARIOS + _RANK_SCENARIOS) + f" ({TORCHRUN_HINT})",
    )
    p.add_argument(
        "--contenders", default=",".join(_CONTENDERS), help="comma-separated subset of: " + ",".join(_CONTENDERS)
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="time budget the scenarios share (default: 420; --quick: 240)",
    )
    p.add_argument(
        "--from-json",
        metavar="FILE",
        default=None,
        help="validate an existing bench.json, print its table and re-plot it (no GPU needed)",
    )
    return p


def _split(value: str, allowed: Sequence[str], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in items if v not in allowed]
    if unknown or not items:
        raise ValueError(f"unknown {what} {', '.join(unknown) or '(none given)'}; choose from {', '.join(allowed)}")
    return [a for a in allowed if a in items]  # canonical order


def _rank_scenarios(scenarios: Sequence[str]) -> bool:
    """Whether the run is one of several ranks (``ddp``, ``tp``): those scenarios run alone and
    under torchrun (whose environment names the world); raises ValueError naming the fix otherwise."""
    under_torchrun = "WORLD_SIZE" in os.environ and "RANK" in os.environ
    ranked = [s for s in scenarios if s in _RANK_SCENARIOS]
    if ranked and len(ranked) != len(scenarios):
        raise ValueError(f"{TORCHRUN_HINT}; run the other scenarios without torchrun")
    if ranked and not under_torchrun:
        raise ValueError(f"{', '.join(ranked)}: {TORCHRUN_HINT}")
    if not ranked and under_torchrun and int(os.environ["WORLD_SIZE"]) > 1:
        raise ValueError("under torchrun, graphtree bench runs the ddp and tp scenarios only: " + TORCHRUN_HINT)
    return bool(ranked)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "gpu"


def _command(argv: Sequence[str]) -> str:
    return shlex.join(["graphtree", "bench", *argv])


def _write_outputs(doc: dict[str, Any], out: Path, table: str) -> tuple[Path, Path | None]:
    from graphtree.bench.plot import plot_results

    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "bench.json"
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    (out / "table.txt").write_text(table + "\n")
    try:
        png = plot_results(doc, out / "bench.png")
    except Exception as exc:  # noqa: BLE001 - a plotting problem must not lose the results
        print(f"graphtree bench: could not plot: {type(exc).__name__}: {exc}", file=sys.stderr)
        png = None
    return json_path, png


def _from_json(path: str, out: str | None) -> int:
    from graphtree.bench.harness import (
        SchemaError,
        correctness_summary,
        render_table,
        results_from_json,
        validate_json,
    )
    from graphtree.bench.plot import plot_results

    try:
        doc = json.loads(Path(path).read_text())
        validate_json(doc)
    except (OSError, ValueError, SchemaError) as exc:
        print(f"graphtree bench: cannot use {path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    rows = results_from_json(doc)
    print(render_table(rows))
    print(correctness_summary(rows))
    folder = Path(out) if out else Path(path).parent
    png = plot_results(doc, folder / "bench.png")
    if png is not None:
        print(f"plot: {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmarks; returns the exit status.

    0: the run completed (failed contenders are results, not errors); 2: no GPU, or bad
    arguments; 130: stopped with Ctrl-C (what was measured is still written); 1: the results
    document broke its schema (a bug; it is written anyway, with ``meta.schema_error``).

    Example::

        from graphtree.bench import main
        main(["--quick", "--scenarios", "overhead", "--out", "/tmp/bench"])
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error already printed by argparse
        return exc.code if isinstance(exc.code, int) else 2
    try:
        scenarios = _split(args.scenarios, _SCENARIOS + _RANK_SCENARIOS, "scenario")
        contenders = _split(args.contenders, _CONTENDERS, "contender")
        ranks = _rank_scenarios(scenarios)
    except ValueError as exc:
        print(f"graphtree bench: {exc}", file=sys.stderr)
        return 2
    if args.from_json:
        return _from_json(args.from_json, args.out)

    import torch

    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE.format(torch=torch.__version__), file=sys.stderr)
        return 2

    import graphtree
    from graphtree import _native
    from graphtree.bench.harness import (
        Progress,
        SchemaError,
        correctness_summary,
        render_table,
        to_json,
        validate_json,
    )
    from graphtree.bench.scenarios import INTERRUPTED, BenchConfig, run_scenarios

    started = time.monotonic()
    now = datetime.now(timezone.utc)
    device = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else Path("results") / f"bench-{now.strftime('%Y%m%d-%H%M%S')}-{_slug(device)}"
    rank = int(os.environ["RANK"]) if ranks else 0  # (one rank speaks for the job, and writes it)
    if rank == 0:
        print(f"graphtree bench: {device}, torch {torch.__version__}; results folder: {out}", flush=True)
    _native.wait(600)  # time graphtree as it runs once its helpers are built, not while they build
    if rank == 0:
        print(f"graphtree bench: native helpers {_native.status()}", flush=True)
    cfg = BenchConfig.make(quick=args.quick, contenders=contenders, budget_s=args.budget)
    log = Progress(quiet=rank != 0)
    results = run_scenarios(scenarios, cfg, log)
    if ranks:
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.destroy_process_group()
        if rank != 0:  # rank 0 writes the job's results
            return 0
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    meta = {
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": now.isoformat(timespec="seconds"),
        "graphtree": graphtree.__version__,
        "graphtree_native": _native.status(),
        "command": _command(argv),
        "duration_s": round(time.monotonic() - started, 3),
        "quick": bool(args.quick),
        "scenarios": scenarios,
        "contenders": contenders,
        "gpu_memory_bytes": int(props.total_memory),
        "gpu_count": torch.cuda.device_count(),
        **({"ranks": world} if ranks else {}),
        "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
        "config": cfg.describe(),
    }
    interrupted = any(not r.ok and (r.error or "").startswith(INTERRUPTED) for r in results)
    if interrupted:
        meta["interrupted"] = True
    doc = to_json(results, meta)
    status = 130 if interrupted else 0
    try:
        validate_json(doc)
    except SchemaError as exc:  # a bug here: still write what was measured
        print(f"graphtree bench: the results document breaks its schema: {exc}", file=sys.stderr)
        doc["meta"]["schema_error"] = str(exc)
        status = 1
    table = render_table(results) + "\n\n" + correctness_summary(results)
    json_path, png = _write_outputs(doc, out, table)
    print()
    print(table)
    print()
    print(f"results folder: {out}")
    print(f"  json:  {json_path}")
    print(f"  table: {out / 'table.txt'}")
    print(f"  plot:  {png if png is not None else '(not written)'}")
    print(f"done in {meta['duration_s']:.0f}s" + (" (interrupted)" if interrupted else ""))
    return status
