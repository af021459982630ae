"""The control block channels keep their bookkeeping in: shared between processes, cells apart,
locked across processes (CPU)."""

import os
import subprocess
import sys
import time

import pytest

from graphtree.share._control import MAX_CHANNELS, MAX_CONSUMERS, MAX_SLOTS, ControlBlock


def test_cells_do_not_overlap():
    cells = [ControlBlock.pid_cell(c) for c in range(MAX_CONSUMERS)]
    for j in range(MAX_CHANNELS):
        cells.append(ControlBlock.latest_cell(j))
        for s in range(MAX_SLOTS):
            cells += [ControlBlock.version_cell(j, s), ControlBlock.reading_cell(j, s)]
            cells += [ControlBlock.pending_cell(j, s), ControlBlock.ready_cell(j, s)]
    assert len(set(cells)) == len(cells)
    block = ControlBlock.create()
    block.set(max(cells), -1)  # the last cell fits in the block
    assert block.get(max(cells)) == -1
    block.close()
    block.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        block.acquire()  # a late user (a consumer's release thread) is told, not crashed


CHILD = """
import os, sys, time
from graphtree.share._control import ControlBlock
block = ControlBlock(int(sys.argv[1]))
with block.locked():
    block.set(block.latest_cell(3), 7)          # seen by the parent
    print("LOCKED", flush=True)
    time.sleep(0.5)                              # the parent's lock waits for this
    block.set(block.latest_cell(3), 8)
"""


def test_a_second_process_sees_the_cells_and_the_lock_excludes_it():
    block = ControlBlock.create()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(block.fd)], pass_fds=[block.fd], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout.readline().strip() == "LOCKED"
    assert block.get(block.latest_cell(3)) == 7
    start = time.perf_counter()
    with block.locked():
        waited = time.perf_counter() - start
        assert block.get(block.latest_cell(3)) == 8, "the lock was held until the child let go"
    assert waited > 0.2
    assert child.wait(timeout=30) == 0


def test_a_descriptor_of_another_size_is_refused(tmp_path):
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096 * 9)
    with pytest.raises(ValueError, match="a control block has"):
        ControlBlock(fd)
    os.close(fd)


def test_a_consumer_stays_registered_while_a_channel_of_it_is_referenced():
    import gc

    import torch

    from graphtree.share._control import Membership
    from graphtree.share.channel import Subscription

    block = ControlBlock.create()
    with block.locked():
        block.set(block.pid_cell(5), 4242)
    membership = Membership(ControlBlock(os.dup(block.fd)), 5)
    sub = Subscription("logits", 0, [torch.zeros(1)], membership, os.getpid())
    del membership  # attach(...).channel("logits"): the Attached is dropped at once
    gc.collect()
    assert block.get(block.pid_cell(5)) == 4242 and sub.latest == 0
    del sub
    gc.collect()
    assert block.get(block.pid_cell(5)) == 0, "the last reference gone, the consumer leaves"
