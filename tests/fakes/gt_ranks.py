"""Several ranks of one job for tests: a script run under torchrun, each rank writing its results to
``OUT/rank{N}.json`` (their prints would interleave).

Example::

    ranks, log = run_ranks([str(script), str(tmp_path)], nproc=2, out=tmp_path, timeout=120)
    assert ranks[1]["reason"] == ...
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository: graphtree importable from every rank


def run_ranks(
    script: list[str], nproc: int, out: Path, timeout: float, results: list[str] | None = None
) -> tuple[list[Any], str]:
    """Run ``script`` (its path and arguments) as ``nproc`` ranks (``torchrun --standalone``) and
    return each rank's results, in rank order, and the job's output; assert that the job succeeded
    in ``timeout`` seconds, showing the end of its output otherwise, and each rank's stacks where it
    wrote them (``OUT/rankN.stuck``). A job past its time is killed whole: torchrun and its ranks.
    ``results``: the JSON files under ``out`` to read instead of each rank's ``rank{N}.json`` (a
    benchmark whose rank 0 writes the job's rows)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    p = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True
    )
    try:
        log, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # the ranks too: a rank left behind keeps its GPU
        log, _ = p.communicate()
        log += f"\n[killed after {timeout:g} s]"
    if p.returncode != 0:
        stacks = "".join(f"\n--- {f.name}\n{f.read_text()[-6000:]}" for f in sorted(out.glob("rank*.stuck")))
        raise AssertionError(log[-20000:] + stacks)
    names = results if results is not None else [f"rank{r}.json" for r in range(nproc)]
    return [json.loads((out / name).read_text()) for name in names], log
