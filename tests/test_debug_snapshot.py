"""Inputs copied before each call (graphtree.debug.snapshot), on the CPU: what the dumps hold."""

import pytest
import torch

from graphtree.debug import dump_on_error, load_dump
from graphtree.debug.snapshot import ORIGIN_BEFORE, ORIGIN_RAISED, InputSnapshots


def halve_in_place_then_fail(x, *, fail):
    """A module-level function that changes its input before it raises."""
    x.mul_(0.5)
    if fail:
        raise ValueError("failed after changing its input")
    return x


def fault_late(x, *, fail):
    """Raises what CUDA raises when an earlier kernel faulted (reported at a later call)."""
    if fail:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return x + 1


def test_a_snapshot_dump_holds_the_inputs_as_they_were_before_the_call(tmp_path):
    snapped = dump_on_error(halve_in_place_then_fail, dir=tmp_path / "snap", snapshot=True)
    plain = dump_on_error(halve_in_place_then_fail, dir=tmp_path / "plain")
    for f in (snapped, plain):
        with pytest.raises(ValueError, match="failed after changing"):
            f(torch.full((3,), 8.0), fail=True)
    (snap_dump,) = (tmp_path / "snap").glob("*.gtdump")
    (plain_dump,) = (tmp_path / "plain").glob("*.gtdump")
    assert torch.equal(load_dump(snap_dump).args[0], torch.full((3,), 8.0))  # before the call
    assert torch.equal(load_dump(plain_dump).args[0], torch.full((3,), 4.0))  # as the call left it
    assert load_dump(snap_dump).origin == ORIGIN_RAISED


def test_a_python_error_dumps_only_its_own_call(tmp_path):
    f = dump_on_error(halve_in_place_then_fail, dir=tmp_path, snapshot=True)
    f(torch.ones(2), fail=False)
    with pytest.raises(ValueError, match="failed after changing"):
        f(torch.ones(2), fail=True)
    assert [p.name.endswith("-before.gtdump") for p in tmp_path.glob("*.gtdump")] == [False]


def test_a_cuda_error_dumps_the_call_before_it_too(tmp_path):
    f = dump_on_error(fault_late, dir=tmp_path, snapshot=True)
    torch.manual_seed(7)
    f(torch.tensor([1.0, 2.0]), fail=False)
    rng_before = torch.get_rng_state()
    torch.rand(3)  # the random state moves between the calls
    with pytest.raises(RuntimeError) as info:
        f(torch.tensor([3.0]), fail=True)
    dumps = {load_dump(p).origin: (p, load_dump(p)) for p in tmp_path.glob("*.gtdump")}
    assert set(dumps) == {ORIGIN_RAISED, ORIGIN_BEFORE}
    before_path, before = dumps[ORIGIN_BEFORE]
    assert before_path.name.endswith("-before.gtdump")
    assert torch.equal(before.args[0], torch.tensor([1.0, 2.0])) and before.kwargs == {"fail": False}
    assert torch.equal(before.rng["cpu"], rng_before)
    assert torch.equal(dumps[ORIGIN_RAISED][1].args[0], torch.tensor([3.0]))
    notes = "\n".join(info.value.__notes__)
    assert str(before_path) in notes and "re-run the -before one" in notes


def test_snapshots_are_copies_the_next_calls_do_not_change():
    snaps = InputSnapshots()
    x = torch.zeros(4)
    snaps.take((x,), {})
    first = snaps.completed()
    x.fill_(5.0)
    snaps.take((x,), {"k": 1})
    snaps.take((x + 1,), {"k": 2})  # reuses the first call's buffers
    assert torch.equal(first[0].args[0], torch.zeros(4))
    newest, older = snaps.completed()
    assert (newest.origin, older.origin) == (ORIGIN_RAISED, ORIGIN_BEFORE)
    assert newest.kwargs == {"k": 2} and torch.equal(newest.args[0], torch.full((4,), 6.0))
    assert older.kwargs == {"k": 1} and torch.equal(older.args[0], torch.full((4,), 5.0))
    assert newest.tensors == [{"dtype": "torch.float32", "shape": [4], "stride": [1], "device": "cpu"}]


def test_a_call_over_the_limit_is_not_snapshotted_and_says_so(tmp_path):
    snaps = InputSnapshots(limit_bytes=64)
    snaps.take((torch.zeros(100),), {})
    assert snaps.completed() == [] and "over the dump limit" in snaps.lost()
    f = dump_on_error(fault_late, dir=tmp_path, snapshot=True, limit_bytes=64)
    with pytest.raises(RuntimeError) as info:
        f(torch.zeros(100), fail=True)
    assert list(tmp_path.glob("*.gtdump")) == []
    assert any("over the dump limit" in n and "no dump" in n for n in info.value.__notes__), info.value.__notes__


def test_no_call_yet_is_said():
    assert InputSnapshots().lost() == "no call was snapshotted" and InputSnapshots().completed() == []
