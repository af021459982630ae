"""What the benchmarks of several ranks share (the ``ddp`` and ``tp`` scenarios, ``benchmarks/ddp_step.py``,
``benchmarks/tp_dtensor.py``), each rank one process under torchrun: a process group per rank (NCCL
on GPUs, gloo for a CPU dry run), the contenders run in turn (one that fails is a row saying why),
each compared with eager's results, and rank 0's JSON rows.

Example::

    rank, world, device = start("cuda")
    rows = run_contenders(["eager", "graphtree", "hand"], lambda name: run(name, device), device)
    compare_to_eager(rows, "losses", "ms_per_step")
    report(rows, {"model": "gpt"}, device, world, rank, "out.json")
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import graphtree
from graphtree.bench.harness import Result


def start(device: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun set up (once: a second call finds it joined): (rank, world
    size, this rank's device)."""
    cuda = device == "cuda"
    local = int(os.environ.get("LOCAL_RANK", "0"))
    here = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", device_id=here if cuda else None)
    return dist.get_rank(), dist.get_world_size(), here


def run_contenders(
    names: list[str], run: Callable[[str], dict[str, Any]], device: torch.device
) -> list[dict[str, Any]]:
    """``run(name)`` for each contender, every rank together (``hand`` needs a GPU)."""
    rows = []
    for name in names:
        if name == "hand" and device.type != "cuda":
            continue
        try:
            rows.append(run(name))
        except Exception as e:  # noqa: BLE001 - a contender that fails is a row that says why
            rows.append({"contender": name, "error": f"{type(e).__name__}: {str(e)[:400]}"})
        dist.barrier()
    return rows


def with_graphtree_stats(row: dict[str, Any], name: str, calls: int) -> dict[str, Any]:
    """``row``, and for the ``graphtree`` contender its replayed fraction of ``calls`` and its eager
    reasons; its trees are reset for the next contender."""
    if name == "graphtree":
        s = graphtree.stats()
        row.update(replayed_fraction=s.replays / calls, eager_reasons=dict(s.eager))
        graphtree.reset()
    return row


def compare_to_eager(rows: list[dict[str, Any]], values: str, time: str) -> None:
    """Each row's ``values`` (dropped from it) against eager's, bit for bit, and its ``time`` against
    eager's, as ``<values>_equal_to_eager``, ``<values>_max_abs_diff_to_eager`` (how far apart, where
    they are floats) and ``ratio_to_eager``. A row ``eager_again`` (eager run a second time) says
    whether eager reproduces its own bits: where it does not, unequal bits say nothing."""
    eager = next((dict(r) for r in rows if r["contender"] == "eager" and values in r), None)
    for r in rows:
        if values in r and eager is not None:
            r[f"{values}_equal_to_eager"] = r[values] == eager[values]
            pairs = list(zip(r[values], eager[values]))
            if pairs and all(isinstance(a, float) and isinstance(b, float) for a, b in pairs):
                r[f"{values}_max_abs_diff_to_eager"] = max(abs(a - b) for a, b in pairs)
            r["ratio_to_eager"] = r[time] / eager[time] if r[time] and eager[time] else None
        r.pop(values, None)


def report(
    rows: list[dict[str, Any]], head: dict[str, Any], device: torch.device, world: int, rank: int, path: str | None
) -> None:
    """Rank 0 prints the rows, each with the device, torch, world size and ``head``, and writes them to ``path``."""
    if rank != 0:
        return
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = [{"device": name, "torch": torch.__version__, "world": world, **head, **r} for r in rows]
    print(json.dumps(out, indent=1))
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


def not_applicable(scenario: str, name: str, metric: str) -> Result:
    """A contender the scenario has no way to run (torch.compile's, in the ``ddp`` scenario)."""
    return Result(scenario, "all", name, metric, None, "s", note=f"not applicable to {scenario}")


def results_of(
    rows: list[dict[str, Any]], scenario: str, case: str, metric: str, time_key: str, values: str
) -> list[Result]:
    """The bench's rows from :func:`compare_to_eager`'s: per contender its time (``time_key``, ms,
    reported in seconds), whether its ``values`` equal eager's, and the rest as ``extra``; the row
    of ``eager_again`` goes into eager's (``eager_reproduces_itself``), and ``hand`` is
    ``handwritten``, as the bench names the capture by hand."""
    from graphtree.bench.contenders import HANDWRITTEN

    again = next((r for r in rows if r["contender"] == "eager_again"), None)
    out = []
    for r in rows:
        name = HANDWRITTEN if r["contender"] == "hand" else r["contender"]
        if name == "eager_again":
            continue
        if "error" in r:
            out.append(Result(scenario, case, name, metric, None, "s", ok=False, error=r["error"]))
            continue
        extra = {k: v for k, v in r.items() if k not in ("contender", time_key)}
        if name == "eager" and again is not None:
            extra["eager_reproduces_itself"] = again.get(f"{values}_equal_to_eager")
        value = r[time_key] / 1e3 if r[time_key] is not None else None
        equal = r.get(f"{values}_equal_to_eager")
        out.append(Result(scenario, case, name, metric, value, "s", equal_to_eager=equal, extra=extra))
    return out
