"""Tensor parallelism with DTensor parameters (``torch.distributed.tensor.parallel``) under graphtree,
under torchrun: the decode step of ``benchmarks/tp_dtensor.py`` (up-projections ``ColwiseParallel``,
down-projections ``RowwiseParallel``) replays with eager's tokens.

The parallel styles register forward hooks on the projections, which turn inputs and outputs into
DTensors and back. They only write the call's own values and run inside the recording, so they do
not make the step run eagerly (``tree/hooks.py``: hooks of ``torch.distributed.tensor`` do not
count). A hook that counted would show as an eager reason that names it, and as fewer replays.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gt_ranks import run_ranks

pytestmark = pytest.mark.own_process  # the checks run in torchrun's processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = 16


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_tensor_parallel_decode_step_replays_with_eagers_tokens(nproc: int, tmp_path: Path) -> None:
    if torch.cuda.device_count() < nproc:
        pytest.skip(f"needs {nproc} GPUs of one host")
    out = tmp_path / "tp.json"
    script = [os.path.join(ROOT, "benchmarks", "tp_dtensor.py"), "--layers", "2", "--d-model", "256"]
    script += ["--vocab", "1024", "--tokens", str(TOKENS), "--contenders", "eager,graphtree", "--json", str(out)]
    (rows,), _log = run_ranks(script, nproc, tmp_path, timeout=240, results=[out.name])
    graphed = next(r for r in rows if r["contender"] == "graphtree")
    print(f"\ntensor parallel decode on {nproc} GPU(s): {graphed}")
    assert graphed["world"] == nproc, graphed
    assert graphed["tokens_equal_to_eager"] is True, graphed
    assert graphed["eager_reasons"] == {}, graphed
    assert graphed["replayed_fraction"] >= (TOKENS - 3) / TOKENS, graphed  # a warm-up or two and the recording
