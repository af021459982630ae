"""Lock-step agreements among ranks (graphtree.tree.lockstep), on the CPU: ranks played by threads
sharing one in-memory store, and a one-rank gloo group for the collectives' process groups."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import pytest
import torch
from gt_ranks import run_ranks

import graphtree
from graphtree.tree import lockstep
from graphtree.tree.lockstep import Lockstep, LockstepMismatch, LockstepTimeout, Vote

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)


def _ranks(n: int, body: Any, timeout: float = 5.0, names: list[str] | None = None) -> list[Any]:
    """Run ``body(lockstep, rank)`` on ``n`` threads, each a rank with its own Lockstep on one store;
    returns each rank's result or exception."""
    store = dist.HashStore()
    results: list[Any] = [None] * n

    def run(rank: int) -> None:
        ls = Lockstep((names or ["f"] * n)[rank], tuple(range(n)), rank, store, timeout)
        try:
            results[rank] = body(ls, rank)
        except Exception as e:  # noqa: BLE001 - the test reads it
            results[rank] = e

    # each thread is named alike on every "rank", as the same program names them in a real job
    threads = [threading.Thread(target=run, args=(r,), name="worker") for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_ranks_that_all_go_on_agree_to_go_on() -> None:
    out = _ranks(3, lambda ls, r: [ls.agree("warm-up", None), ls.agree("record", None)])
    assert out == [[(None, False), (None, False)]] * 3


def test_one_ranks_reason_to_fall_back_reaches_every_rank_with_its_rank() -> None:
    out = _ranks(3, lambda ls, r: ls.agree("warm-up", "synchronizes with the host" if r == 1 else None))
    assert out[1] == ("synchronizes with the host", False)  # its own reason, as it was
    assert out[0] == out[2] == ("rank 1: synchronizes with the host", False)


def test_the_first_reason_in_rank_order_wins_and_again_is_anyones() -> None:
    out = _ranks(3, lambda ls, r: ls.agree("warm-up", f"reason {r}" if r else None, again=(r == 2)))
    assert out[0] == ("rank 1: reason 1", True)
    assert out[2] == ("rank 1: reason 1", True)


def test_a_rank_that_never_comes_makes_the_others_raise_within_the_timeout_naming_it() -> None:
    def body(ls: Lockstep, r: int) -> Any:
        if r == 2:
            return "skipped"  # this rank calls something else
        return ls.agree("record", None)

    t0 = time.monotonic()
    out = _ranks(3, body, timeout=1.0)
    assert time.monotonic() - t0 < 20
    for r in (0, 1):
        assert isinstance(out[r], LockstepTimeout), out[r]
        assert "rank(s) [2]" in str(out[r]) and "lockstep_timeout" in str(out[r]) and "`f`" in str(out[r])


def test_a_rank_that_comes_after_another_stopped_waiting_raises_too() -> None:
    """Without the mark, the late rank found every vote in the store and went on alone (a review found it)."""

    def body(ls: Lockstep, r: int) -> Any:
        if r == 1:
            time.sleep(2.0)  # comes after rank 0's timeout
        return ls.agree("start", None)

    out = _ranks(2, body, timeout=0.5)
    assert isinstance(out[0], LockstepTimeout) and "rank(s) [1]" in str(out[0]), out[0]
    assert isinstance(out[1], LockstepTimeout) and "rank 0 stopped waiting" in str(out[1]), out[1]


def test_ranks_at_different_functions_raise_a_mismatch_naming_both() -> None:
    out = _ranks(2, lambda ls, r: ls.agree("warm-up", None), names=["attn", "mlp"])
    for e in out:
        assert isinstance(e, LockstepMismatch), e
        assert "`attn`" in str(e) and "`mlp`" in str(e)


def test_agreements_are_numbered_per_thread_so_two_threads_do_not_mix_their_votes() -> None:
    # every rank runs two threads, "a" and "b", each agreeing in its own order
    store = dist.HashStore()
    results: dict[tuple[int, str], Any] = {}

    def run(rank: int, name: str) -> None:
        ls = Lockstep(name, (0, 1), rank, store, 5.0)
        results[(rank, name)] = [ls.agree("warm-up", None if name == "a" else f"{name} {rank}") for _ in range(3)]

    threads = [threading.Thread(target=run, args=(r, n), name=n) for r in (0, 1) for n in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results[(0, "a")] == results[(1, "a")] == [(None, False)] * 3
    assert results[(0, "b")] == [("b 0", False)] * 3
    assert results[(1, "b")] == [("rank 0: b 0", False)] * 3


def test_a_vote_is_cast_once_and_returns_the_first_reason() -> None:
    def body(ls: Lockstep, r: int) -> Any:
        vote = Vote(ls, "capture")
        assert not vote.cast
        got = vote("capture failed" if r == 0 else None)
        return got, vote.cast

    out = _ranks(2, body)
    assert out == [("capture failed", True), ("rank 0: capture failed", True)]


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="rank 3 is not one of"):
        Lockstep("f", (0, 1), 3, dist.HashStore(), 1.0)


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"TORCH_NCCL_BLOCKING_WAIT": "1"}, "TORCH_NCCL_BLOCKING_WAIT"),
        ({"NCCL_GRAPH_MIXING_SUPPORT": "0"}, "NCCL_GRAPH_MIXING_SUPPORT=0"),
        ({}, None),
    ],
)
def test_the_environment_check_names_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], needle: str | None
) -> None:
    for var in ("TORCH_NCCL_BLOCKING_WAIT", "NCCL_GRAPH_MIXING_SUPPORT"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    problem = lockstep.environment_problem()
    if needle is None:
        assert problem is None
    else:
        assert problem is not None and needle in problem and "unset it" in problem


@pytest.mark.parametrize("bad", [0, -1.0, "60", True, None])
def test_lockstep_timeout_must_be_a_positive_number(bad: Any) -> None:
    with pytest.raises(ValueError, match="lockstep_timeout must be a positive number"):
        graphtree.graphed(lambda x: x, lockstep_timeout=bad)


def test_without_a_process_group_a_collective_function_is_told_to_init_one() -> None:
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        lockstep.for_groups("f", {"0": (0,)}, 1.0)


_GLOO = textwrap.dedent(
    """
    import json, os, sys, torch, torch.distributed as dist
    import torch.distributed._functional_collectives as fc
    from graphtree.tree.lockstep import CollectiveWatch, for_groups
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    sub = dist.new_group([0])
    t = torch.ones(4)
    plain = CollectiveWatch()
    with plain:
        torch.add(t, 1)
    watch = CollectiveWatch()
    with watch:
        dist.all_reduce(t)
        dist.broadcast(t, 0, group=sub)
        out = [torch.empty(4)]
        dist.all_gather(out, t)
        y = fc.all_reduce(t, "sum", dist.group.WORLD)
        z = y + 1
    ls = for_groups("f", watch.groups, 5.0)
    from graphtree.tree.lockstep import UnagreedCollective
    before = t.clone()
    try:
        with CollectiveWatch(known={}):  # a capture no warm-up agreed on: stopped before it runs
            dist.all_reduce(t)
        refused = ""
    except UnagreedCollective as e:
        refused = str(e)
    with CollectiveWatch(known=ls.groups):  # the groups agreed on pass
        dist.all_reduce(t, group=sub)
    print(json.dumps({"groups": {k: list(v) for k, v in watch.groups.items()}, "ops": watch.ops,
                      "plain": plain.groups, "ranks": list(ls.ranks), "rank": ls.rank,
                      "agree": ls.agree("warm-up", None), "sum": float(z.sum()), "refused": refused,
                      "untouched": bool(torch.equal(before, t))}))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _one_gloo_rank(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run in a process of its own (graphtree importable), with a free port as its argument;
    asserts that it succeeded, showing the end of its stderr otherwise."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run(
        [sys.executable, "-c", script, str(_free_port())],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_the_watch_finds_the_groups_of_c10d_and_functional_collectives_on_a_gloo_group() -> None:
    import json

    p = _one_gloo_rank(_GLOO)
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["plain"] == {}  # no collective: no group
    assert len(got["groups"]) == 2 and all(v == [0] for v in got["groups"].values())  # WORLD and the subgroup
    assert any("allreduce_" in op for op in got["ops"]) and any("broadcast_" in op for op in got["ops"])
    assert any("allgather_" in op for op in got["ops"])
    assert any("_c10d_functional.all_reduce" in op for op in got["ops"])
    assert got["ranks"] == [0] and got["rank"] == 0 and got["agree"] == [None, False]
    assert got["sum"] == 4 * (1 + 1)  # all-reduce over one rank leaves ones; +1
    assert "c10d.allreduce_" in got["refused"] and "warmup=1" in got["refused"] and got["untouched"]


_TEARDOWN = textwrap.dedent(
    """
    import sys, torch.distributed as dist
    from torch.distributed import distributed_c10d
    from graphtree.tree.lockstep import release_before_teardown
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
    calls = []
    def release():
        calls.append(dist.is_initialized())  # run before the group goes
        print("released", dist.is_initialized(), flush=True)
    release_before_teardown(release)
    release_before_teardown(release)  # once is enough
    assert dist.destroy_process_group is distributed_c10d.destroy_process_group
    assert dist.destroy_process_group.__name__ == "destroy_process_group"
    dist.destroy_process_group()
    print("destroyed", dist.is_initialized(), calls, flush=True)
    """
)


def test_recordings_are_released_before_destroy_process_group_and_at_exit() -> None:
    """NCCL cannot destroy a communicator while a graph that captured one of its collectives lives
    (pytorch#115388: the bench hung at its last line on two H200s): the release runs first."""
    p = _one_gloo_rank(_TEARDOWN)
    # once before destroy_process_group (the group still there), once at exit (none left)
    assert p.stdout.splitlines() == ["released True", "destroyed False [True]", "released False"], p.stdout


class _Wrapper(torch.Tensor):
    """A wrapper subclass (no storage of its own), as the functional collectives' handles are."""

    @staticmethod
    def __new__(cls, size: tuple[int, ...]) -> _Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, size, dtype=torch.float32)  # type: ignore[attr-defined,no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return NotImplemented


def test_a_storage_python_cannot_read_has_address_zero_for_the_dispatch_modes() -> None:
    from graphtree import _torch

    w = _Wrapper((3,))
    with pytest.raises(RuntimeError, match="invalid python storage"):
        w.untyped_storage().data_ptr()  # what broke the watches of warm-ups and captures (H100, torch 2.11)
    assert _torch.storage_ptr(w.untyped_storage()) == 0
    t = torch.ones(3)
    assert _torch.storage_ptr(t.untyped_storage()) == t.data_ptr() != 0


_TWO_RANKS = textwrap.dedent(
    """
    import json, os, sys, time, torch.distributed as dist
    from graphtree.tree.lockstep import LockstepTimeout, for_groups
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ls = for_groups("step", {"world": (0, 1)}, 3.0)
    out = {"ok": ls.agree("warm-up", None), "reason": ls.agree("warm-up", "host sync" if rank == 1 else None)}
    # a 2-D mesh's row and column: each rank's union differs, so the world agrees
    mesh = for_groups("mesh", {f"row{rank}": (rank,), "column": (0, 1)}, 3.0)
    out["mesh"] = [list(mesh.ranks), mesh.agree("start", None)]
    if rank == 0:  # rank 1 skips this one
        t0 = time.monotonic()
        try:
            ls.agree("record", None)
            out["follow"] = "no error"
        except LockstepTimeout as e:
            out["follow"] = str(e)
        out["waited"] = time.monotonic() - t0
    with open(f"{sys.argv[1]}/rank{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # (torch 2.13's CPU build may abort in gloo's threads at interpreter exit: test_demo_tp.py)
    """
)


def test_two_processes_agree_through_the_jobs_store_and_a_rank_that_does_not_come_times_out(tmp_path: Any) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(_TWO_RANKS)
    (r0, r1), _log = run_ranks([str(script), str(tmp_path)], nproc=2, out=tmp_path, timeout=120)
    assert r0["ok"] == r1["ok"] == [None, False]
    assert r1["reason"] == ["host sync", False] and r0["reason"] == ["rank 1: host sync", False]
    assert r0["mesh"] == r1["mesh"] == [[0, 1], [None, False]]
    assert "rank(s) [1] did not come to agreement 4 (record of `step`) within 3 s" in r0["follow"]
    assert 3.0 <= r0["waited"] < 10, r0


def test_every_rank_takes_the_same_decision_for_any_votes() -> None:
    """Random votes over many agreements: each rank's outcome is the same decision (the reason's text
    differs only by its rank prefix), as the tree's lock-step needs."""
    import random

    rng = random.Random(7)
    n, rounds = 4, 40
    plan = [
        [(rng.choice([None, None, None, f"reason {r}"]), rng.random() < 0.3) for r in range(n)] for _ in range(rounds)
    ]

    def body(ls: Lockstep, r: int) -> Any:
        return [ls.agree("warm-up", *votes[r]) for votes in plan]

    out = _ranks(n, body, timeout=20.0)
    for k, votes in enumerate(plan):
        first = next(((r, why) for r, (why, _) in enumerate(votes) if why is not None), None)
        again = any(a for _, a in votes)
        for r in range(n):
            reason, got_again = out[r][k]
            assert got_again == again
            if first is None:
                assert reason is None
            else:
                assert reason == (first[1] if first[0] == r else f"rank {first[0]}: {first[1]}")


def test_the_teardown_drop_keeps_the_counters_and_does_not_wait_for_a_busy_tree(caplog: Any, monkeypatch: Any) -> None:
    """Before destroy_process_group (tree/teardown.py): every recording goes, stats() still tells
    the run, and a tree another thread holds (a call waiting on a peer) cannot hang the exit."""
    from graphtree.tree import manager, teardown
    from graphtree.tree.manager import TreeManager

    m = TreeManager(0)
    m.counters.replays = 5
    assert m.drop("torch.distributed's process groups were torn down", wait=0.1)
    assert m.counters.replays == 5
    held, done = threading.Event(), threading.Event()

    def busy() -> None:
        with m.lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=busy, name="busy")
    t.start()
    assert held.wait(10)
    monkeypatch.setattr(teardown, "WAIT", 0.2)
    monkeypatch.setattr(manager, "managers", lambda: [m])
    try:
        t0 = time.monotonic()
        teardown.drop_all()
        assert time.monotonic() - t0 < 5
        assert any("kept its recordings through the teardown" in r.getMessage() for r in caplog.records)
    finally:
        done.set()
        t.join(10)
