"""A data-parallel training step graphed under torchrun (issue 48): ``benchmarks/ddp_step.py`` with
DistributedDataParallel (built on a side stream, as PyTorch's CUDA-graph notes ask) and with FSDP2,
on one GPU and on every GPU of the machine up to four. Eager's losses against graphtree's, bit for
bit where eager reproduces its own; no job may hang (each is killed whole past its time)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from gt_ranks import run_ranks

pytestmark = pytest.mark.own_process  # every check runs in torchrun's processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 40  # 11 warm-ups (DDP's), the recording, then replays
WORLDS = sorted({1, min(torch.cuda.device_count(), 4)} - {0})


def _rows(tmp_path: Path, world: int, *args: str) -> dict[str, dict[str, Any]]:
    script = [os.path.join(ROOT, "benchmarks", "ddp_step.py"), "--steps", str(STEPS)]
    script += ["--json", str(tmp_path / "rows.json")]
    (rows,), _log = run_ranks([*script, *args], world, tmp_path, timeout=240, results=["rows.json"])
    return {r["contender"]: r for r in rows}


@pytest.mark.parametrize("world", WORLDS)
def test_a_ddp_step_is_recorded_and_its_losses_are_eagers(tmp_path: Path, world: int) -> None:
    rows = _rows(tmp_path, world, "--model", "mlp", "--contenders", "eager,graphtree,eager_again")
    eager_again, graphed = rows["eager_again"], rows["graphtree"]
    print(f"\nDDP MLP, {world} rank(s): {graphed}")
    assert "error" not in graphed, graphed
    assert eager_again["losses_equal_to_eager"], ("eager does not reproduce its own losses", eager_again)
    assert graphed["losses_equal_to_eager"], graphed
    assert not graphed["eager_reasons"] and graphed["replayed_fraction"] >= (STEPS - 12) / STEPS, graphed


def test_an_fsdp2_step_runs_eagerly_naming_fsdp2_with_eagers_losses(tmp_path: Path) -> None:
    world = WORLDS[-1]
    rows = _rows(tmp_path, world, "--model", "mlp", "--wrap", "fsdp2", "--contenders", "eager,graphtree")
    graphed = rows["graphtree"]
    print(f"\nFSDP2 MLP, {world} rank(s): {graphed}")
    assert graphed["losses_equal_to_eager"], graphed
    if graphed["replayed_fraction"] == 0:  # (recorded, it would have to be equal: asserted above)
        # FSDP2's all-gathers run in its module hooks (FSDPState._pre_forward): named by the hooks'
        # reason since the nineteenth session, by the warm-up's (FSDP2 keeps memory) before
        assert any("FSDP2" in reason for reason in graphed["eager_reasons"]), graphed
