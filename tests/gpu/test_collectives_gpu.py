"""NCCL collectives inside recordings (issue 31), under torchrun: one GPU (a world of one) and, where
the machine has them, two. benchmarks/tp_step.py --check does the work; each rank prints its results."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from gt_ranks import run_ranks

pytestmark = pytest.mark.own_process  # every check runs in torchrun's processes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "functional_all_reduce"]


def _torchrun(nproc: int, out: Path, timeout: float = 150) -> tuple[list[dict[str, Any]], float, str]:
    """The checks under torchrun; the job must also end (destroy_process_group returns: it hung while
    graphs that captured collectives lived, pytorch#115388). A rank stuck 60 s writes its stacks."""
    t0 = time.monotonic()
    script = [os.path.join(ROOT, "benchmarks", "tp_step.py"), "--check", "--out", str(out), "--stuck-after", "60"]
    ranks, log = run_ranks(script, nproc, out, timeout)
    wall = time.monotonic() - t0
    assert [r["rank"] for r in ranks] == list(range(nproc)), log[-20000:]
    return ranks, wall, log


def _graphed_and_equal(case: dict[str, Any], calls: int) -> None:
    assert case["equal"] == [True] * calls, case
    assert case["recordings"] == 1 and case["replays"] == calls - 2 and case["eager"] == {}, case
    # after the first warm-up (which finds the collectives), before the capture and after it
    assert case["agreements"] == 3, case


def _check_rank(r: dict[str, Any]) -> None:
    assert [c["name"] for c in r["collectives"]] == COLLECTIVES
    for case in r["collectives"]:
        _graphed_and_equal(case, 6)
    _graphed_and_equal(r["mlp"], 6)
    decode = r["decode"]
    assert decode["equal"] == [True] * 24, decode
    assert decode["recordings"] == 1 and decode["replays"] == 22 and decode["eager"] == {}, decode
    assert decode["max_diff_to_whole_model"] < 1e-3, decode  # the split model computes the whole one's logits
    # recorded with no warm-up: its collective stops the capture before it runs, and it runs eagerly
    unagreed = r["no_warm_up"]
    assert unagreed["equal"] == [True] * 3 and unagreed["recordings"] == 0, unagreed
    (reason,) = unagreed["eager"]
    assert "no warm-up saw" in reason and unagreed["eager"][reason] == 3, unagreed


def test_each_collective_the_parallel_mlp_and_decode_step_replay_equal_to_eager_in_a_world_of_one(
    tmp_path: Path,
) -> None:
    (rank,), _wall, _log = _torchrun(1, tmp_path)
    print(f"\nworld of one on {rank['device']}: {rank['stats']}")
    _check_rank(rank)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host")
def test_two_ranks_replay_together_fall_back_together_and_a_rank_that_cannot_follow_raises(tmp_path: Path) -> None:
    ranks, wall, _log = _torchrun(2, tmp_path)
    for r in ranks:
        print(f"\nrank {r['rank']} of 2 on {r['device']}: {r['stats']}")
        _check_rank(r)
        # rank 1 alone copied a result to the host: every rank ran it eagerly, rank 1's reason given
        forced = r["forced_fallback"]
        assert forced["equal"] == [True] * 4 and forced["recordings"] == 0, forced
        assert forced["agreements"] == 1, forced  # after its warm-up; then eager, with no vote
        (reason,) = forced["eager"]
        assert "synchronizes with the host" in reason and forced["eager"][reason] == 3, forced
        assert reason.startswith("rank 1: ") == (r["rank"] == 0), reason
    follow0, follow1 = ranks[0]["cannot_follow"], ranks[1]["cannot_follow"]
    assert follow1["outcome"] == "skipped"
    assert follow0["outcome"] == "LockstepTimeout", follow0
    assert "rank(s) [1]" in follow0["message"] and "lockstep_timeout" in follow0["message"]
    assert follow0["timeout"] <= follow0["waited_s"] < follow0["timeout"] + 10, follow0
    print(f"torchrun of two ranks: {wall:.1f} s; rank 0 waited {follow0['waited_s']} s for rank 1")
