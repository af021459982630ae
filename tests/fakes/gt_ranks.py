"""Several ranks of one job for tests: a script run under torchrun, each rank writing its results to
``OUT/rank{N}.json`` (their prints would interleave).

Example::

    ranks, log = run_ranks([str(script), str(tmp_path)], nproc=2, out=tmp_path, timeout=120)
    assert ranks[1]["reason"] == ...
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository: graphtree importable from every rank


def run_ranks(script: list[str], nproc: int, out: Path, timeout: float) -> tuple[list[dict[str, Any]], str]:
    """Run ``script`` (its path and arguments) as ``nproc`` ranks (``torchrun --standalone``) and
    return each rank's results, in rank order, and the job's output; assert that the job succeeded,
    showing the end of its output otherwise."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *script]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-20000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)], log
