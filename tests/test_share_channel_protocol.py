"""The bookkeeping of graphtree.share channels, on the CPU: which slot the producer writes, which
version a reader gets, when a slot may be written again. With CPU buffers the ``ready`` cells are
written and read by the CPU (on a GPU, by the producer's stream and the consumer's stream: tested
in tests/gpu/test_share_channel_gpu.py)."""

import os
import subprocess
import time

import pytest
import torch

import graphtree
from graphtree import _native
from graphtree.share._control import ControlBlock, Membership
from graphtree.share._release import Releaser
from graphtree.share.channel import _WRITING, Channel, Subscription, drain_reads


def _pair(slots, reap=lambda: None):
    """A producer's channel and one consumer's subscription to it (consumer number 3)."""
    block = ControlBlock.create()
    buffers = [torch.zeros(2) for _ in range(slots)]
    ch = Channel("logits", 0, buffers, block, reap=reap)
    sub = Subscription("logits", 0, buffers, Membership(ControlBlock(os.dup(block.fd)), 3), os.getpid())
    return ch, sub


def _ready(ch, s):
    return ch._block.cells[ch._cells.ready[s]]


@pytest.fixture(autouse=True)
def _python_path(monkeypatch):
    """The producer's take and publish in Python, unless a test asks for ``path``."""
    monkeypatch.setattr(_native, "loaded", None)


@pytest.fixture(params=["python", "native"])
def path(request, monkeypatch):
    """Each test run twice: the producer's take and publish in Python, then in C++ (graphtree/_native)."""
    module = None
    if request.param == "native":
        monkeypatch.undo()
        module = _native.wait(600)
        if module is None:
            pytest.skip(f"no native helpers: {_native.status()}")
    monkeypatch.setattr(_native, "loaded", module)
    return request.param


def test_a_reader_gets_the_newest_version_and_its_slot(path):
    ch, sub = _pair(3)
    for value in (1.0, 2.0):
        ch.next().fill_(value)
        assert ch.commit() == value
    assert [_ready(ch, s) for s in range(3)] == [1, 2, 0], "commit() marks the slot's version written"
    with sub.read(timeout=1) as frame:
        assert frame.version == 2 and frame.tensor is ch.buffers[1]
        assert torch.equal(frame.tensor, torch.full((2,), 2.0))
    assert sub.last == 2


def test_the_slot_being_read_is_never_written_until_the_read_ends(path):
    ch, sub = _pair(2)
    ch.next().fill_(1.0)
    ch.commit()  # version 1 in slot 0
    with sub.read(timeout=1) as frame:
        assert frame.version == 1
        assert ch.next() is ch.buffers[1], "never the newest slot"
        ch.commit()
        with pytest.raises(TimeoutError, match="every slot is being read"):
            ch.next(timeout=0.05)  # slot 0 is claimed by the reader, slot 1 is the newest
    assert ch.next(timeout=1) is ch.buffers[0], "free once the read ended"
    ch.commit()
    assert drain_reads(1)


def test_a_slot_is_not_written_again_before_the_gpu_wrote_its_last_version(path):
    # the producer's GPU may lag its CPU: a slot whose ready cell is behind the version last
    # committed there is still being written, and writing it again would mix two versions
    ch, _ = _pair(2)
    for _ in range(2):
        ch.next()
        ch.commit()  # versions 1 (slot 0) and 2 (slot 1)
    ch._block.cells[ch._cells.ready[0]] = 0  # as if the GPU had not yet reached version 1's write
    with pytest.raises(TimeoutError, match="not yet written"):
        ch.next(timeout=0.05)
    ch._block.cells[ch._cells.ready[0]] = 1
    assert ch.next(timeout=1) is ch.buffers[0]
    assert ch._block.cells[ch._cells.pending[0]] == 3, "the version to be written there"


def test_one_slot_is_rewritten_in_place_after_its_reader(path):
    ch, sub = _pair(1)
    ch.next()
    ch.commit()
    with sub.read(timeout=1), pytest.raises(TimeoutError):
        ch.next(timeout=0.05)
    assert ch.next(timeout=1) is ch.buffers[0]


def test_a_reader_waits_for_a_newer_version_and_says_when_none_comes(path):
    ch, sub = _pair(2)
    with pytest.raises(TimeoutError, match=r"no version newer than 0 within 0\.05 s"):
        sub.read(timeout=0.05).__enter__()
    ch.next()
    ch.commit()
    with sub.read(timeout=1) as frame:
        assert frame.version == 1
    with pytest.raises(TimeoutError, match="no version newer than 1"):
        sub.read(timeout=0.05).__enter__()
    with sub.read(after=0, timeout=1) as frame:  # asking for an older floor re-reads the newest
        assert frame.version == 1


def test_a_claim_on_a_slot_the_producer_took_meanwhile_is_let_go():
    # the consumer saw version 1 as the newest, but before its claim was checked the producer
    # published version 2 and took version 1's slot: the claim must not stand
    ch, sub = _pair(2)
    ch.next()
    ch.commit()
    cells, c = ch._block.cells, ch._cells
    import graphtree.share.channel as channel

    saved = channel._fence

    def producer_moves_on():  # at the consumer's fence, between its claim and its check
        channel._fence = saved
        ch.next()
        ch.commit()  # version 2 in slot 1
        claims = cells[c.reading[0]]
        cells[c.reading[0]] = 0  # the producer's look at the claims came before this claim's store
        assert ch.next() is ch.buffers[0]  # so it takes version 1's slot
        cells[c.reading[0]] = claims

    if not channel._LOCK_FREE:
        pytest.skip("the producer takes slots under the lock on this machine")
    channel._fence = producer_moves_on
    try:
        taken = sub._claim(0)
    finally:
        channel._fence = saved
    assert taken is None, "the claim saw its slot taken and gave up"
    assert cells[c.reading[0]] == 0, "and let it go"


def test_the_producer_backs_off_a_slot_claimed_while_it_was_taking_it():
    # a consumer that saw version 1 as the newest claims its slot after the producer looked at
    # the claims and before it marked the slot: the producer must see the claim and leave the slot
    import types

    import graphtree.share.channel as channel

    if not channel._LOCK_FREE:
        pytest.skip("the producer takes slots under the lock on this machine")
    ch, sub = _pair(3)
    ch.next()
    ch.commit()  # version 1, slot 0
    ch.next()
    ch.commit()  # version 2, slot 1
    real, c = ch._block.cells, ch._cells
    seen = {}

    class Cells:  # the producer's view of the cells, with the consumer's claim slipped in
        def __getitem__(self, i):
            return real[i]

        def __setitem__(self, i, value):
            if i == c.version[0] and value == -1 and not seen:
                real[c.latest] = 1  # the consumer's earlier look at "latest"
                seen["claim"] = sub._claim(0)
                real[c.latest] = 2
            real[i] = value

    ch.next()
    ch.commit()  # version 3, slot 2: the producer now tries slot 0 first
    block = ch._block
    ch._block = types.SimpleNamespace(cells=Cells(), acquire=block.acquire, release=block.release)
    try:
        s = ch._take()
    finally:
        ch._block = block
    assert seen["claim"] == (0, 1), "the consumer's claim of version 1 stood (its check came first)"
    assert s == 1, "so the producer left slot 0 to it and took the next free one"
    assert real[c.version[0]] == 1, "slot 0 still holds version 1"


def test_a_dead_readers_claim_is_dropped_by_reaping(path):
    block_holder = {}

    def reap():
        block = block_holder["block"]
        with block.locked():
            for s in range(2):
                block.set(block.reading_cell(0, s), 0)

    ch, sub = _pair(2, reap=reap)
    block_holder["block"] = ch._block
    ch.next()
    ch.commit()
    sub.read(timeout=1).__enter__()  # claims slot 0 and never ends: a reader killed mid-read
    ch.next()
    ch.commit()
    assert ch.next(timeout=1) is ch.buffers[0], "the producer reaped the claim instead of waiting"


def test_misuse_is_refused():
    ch, sub = _pair(2)
    with pytest.raises(RuntimeError, match=r"next\(\) gives the buffer to write before commit\(\)"):
        ch.commit()
    ch.next()
    with pytest.raises(RuntimeError, match=r"commit\(\) the version being written before next\(\)"):
        ch.next()
    sub._membership.close()
    with pytest.raises(RuntimeError, match="this consumer was closed"):
        sub.read(timeout=1).__enter__()


def test_a_graphed_writer_publishes_each_call_as_the_next_version(path):
    # without CUDA graphtree runs the function eagerly: the same calls, the same cells
    ch, sub = _pair(3)
    calls = []

    def step(x, *, out):
        calls.append(out)
        return torch.mul(x, 2, out=out)

    publish = ch.graphed(step)
    for v in range(1, 6):
        result = publish(torch.full((2,), float(v)))
        assert result is ch.buffers[(v - 1) % 3] and ch.version == v
        assert _ready(ch, (v - 1) % 3) == v, "the function's own write marks the version written"
        with sub.read(timeout=1) as frame:
            assert frame.version == v and torch.equal(frame.tensor, torch.full((2,), 2.0 * v))
    with pytest.raises(TypeError, match="gives out= itself"):
        publish(torch.ones(2), out=torch.ones(2))

    def broken(x, *, out):
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        ch.graphed(broken)(torch.ones(2))
    assert ch.version == 5 and ch._state[_WRITING] == -1, "a writer that raised publishes nothing"
    graphtree.reset()


class _Done:
    """Stands in for the CUDA event a read records at the end of its block."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done


def _wait_until(predicate, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_the_release_thread_frees_a_gpu_waiting_for_a_dead_producer_while_the_block_is_open(caplog):
    # On a GPU the consumer's stream waits for version 1's ready cell from the moment read()
    # returns, and a CUDA call inside the block (a kernel's first launch) may block this thread
    # until it is written: the release thread must write it for a dead producer before the
    # block ends (on the H100 the consumer hung at its first sum() when it followed reads only
    # from their end).
    gone = subprocess.Popen(["true"])
    gone.wait()
    block = ControlBlock.create()
    buffers = [torch.zeros(2) for _ in range(2)]
    ch = Channel("logits", 0, buffers, block, reap=lambda: None)
    ch.next()
    ch._publish()  # version 1 in slot 0, published on the CPU; its GPU never wrote ready (it died)
    sub = Subscription("logits", 0, buffers, Membership(ControlBlock(os.dup(block.fd)), 3), gone.pid)
    assert sub._claim(0) == (0, 1)
    releaser, read, end = Releaser(), sub._release_of(0, 1), _Done()
    with caplog.at_level("WARNING", logger="graphtree"):
        releaser.follow(read)
        _wait_until(lambda: _ready(ch, 0) == 1)  # the block is still open
    assert "died before its GPU wrote version 1" in caplog.text
    assert block.cells[ch._cells.reading[0]] == 1 << 3, "claimed until the block's GPU work is done"
    releaser.end(read, end)
    assert not releaser.drain(0.2), "the block's GPU work is not done"
    end.done = True
    assert releaser.drain(5)
    assert block.cells[ch._cells.reading[0]] == 0


def test_the_release_thread_drops_each_claim_once_its_version_is_written_and_its_work_done(path):
    ch, sub = _pair(3)
    releaser, reads = Releaser(), []
    for v in (1, 2):
        ch.next()
        assert ch._publish() == v  # not yet written by "the GPU"
        s, _ = sub._claim(v - 1)
        reads.append((sub._release_of(s, v), _Done(), s))
        releaser.follow(reads[-1][0])
    for read, end, _ in reads:
        releaser.end(read, end)
        end.done = True
    assert not releaser.drain(0.2), "version 1 and 2 are not written yet: the claims stay"
    assert all(ch._block.cells[ch._cells.reading[s]] for *_, s in reads)
    for v, (*_, s) in enumerate(reads, 1):
        ch._block.cells[ch._cells.ready[s]] = v
    assert releaser.drain(5)
    assert not any(ch._block.cells[ch._cells.reading[s]] for *_, s in reads)


def _reader_process(fd, buffers, versions, out):
    """A consumer in another process (forked) reading every newest version, several times
    within each read, and reporting any version it saw torn."""
    sub = Subscription("logits", 0, buffers, Membership(ControlBlock(fd), 5), os.getppid())
    torn = reads = 0
    while sub.last < versions:
        with sub.read(timeout=10) as frame:
            for _ in range(3):
                values = frame.tensor.unique()
                if values.numel() != 1 or int(values[0]) != frame.version:
                    torn += 1
            reads += 1
    out.put((reads, torn))


def test_a_reader_in_another_process_never_sees_a_version_being_written(path):
    # The producer writes each version in pieces while a forked reader reads in a tight loop:
    # the bookkeeping alone (claims checked after a fence against the producer's lock-free take,
    # the unlocked publication) must keep the two apart. Without the claim's check in _claim it
    # failed (torn reads seen) on the two-core CPU machine; as it is, it passed every run.
    import multiprocessing

    versions, slots = 8000, 3
    buffers = [torch.zeros(4096).share_memory_() for _ in range(slots)]
    block = ControlBlock.create()
    ch = Channel("logits", 0, buffers, block, reap=lambda: None)
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    reader = ctx.Process(target=_reader_process, args=(os.dup(block.fd), buffers, versions, out), daemon=True)
    reader.start()
    try:
        for v in range(1, versions + 1):
            buf = ch.next(timeout=10)
            for part in buf.split(256):  # a write that takes a while: a wide window for a torn read
                part.fill_(v)
            assert ch.commit() == v
        reads, torn = out.get(timeout=60)
    finally:
        reader.join(timeout=30)
        if reader.is_alive():
            reader.kill()
    assert reader.exitcode == 0
    assert reads > 20, "the reader read along"
    assert torn == 0, f"{torn} torn reads in {reads}"
