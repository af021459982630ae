"""Input snapshots on the GPU: a leaf that moves between devices gets a fresh host buffer."""

import torch

from graphtree.debug.snapshot import _SLOTS, InputSnapshots


def test_a_leaf_that_moves_from_cpu_to_cuda_is_recorded_on_its_new_device():
    snaps = InputSnapshots()
    for _ in range(_SLOTS):  # calls 1 to _SLOTS: each slot gets an unpinned buffer for a CPU leaf
        snaps.take((torch.zeros(4),), {})
    x = torch.arange(4.0, device="cuda")
    snaps.take((x,), {})  # the first slot again, same shape/stride/dtype, now a CUDA leaf
    newest = snaps.completed()[0]
    assert newest.tensors[0]["device"] == str(x.device)
    assert torch.equal(newest.args[0], x.cpu())
    assert snaps._slots[(_SLOTS + 1) % _SLOTS].buffers[0].is_pinned(), "a CUDA leaf is copied into pinned memory"


def test_a_leaf_that_moves_from_cuda_to_cpu_is_recorded_on_the_cpu():
    snaps = InputSnapshots()
    snaps.take((torch.ones(3, device="cuda"),), {})
    snaps.take((torch.ones(3, device="cuda"),), {})
    snaps.take((torch.full((3,), 7.0),), {})
    newest = snaps.completed()[0]
    assert newest.tensors[0]["device"] == "cpu"
    assert torch.equal(newest.args[0], torch.full((3,), 7.0))
