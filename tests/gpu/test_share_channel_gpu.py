"""graphtree.share channels on a GPU, across processes: versions are stream-ordered both ways
(a reader never sees a half-written version, a writer never overwrites one being read), written
by ``next()``/``commit()`` or by a graphed writer; a consumer killed with SIGKILL leaks nothing in
the producer; a producer that died before its GPU wrote a version does not leave the consumer's
GPU waiting for ever; memory is freed when the last holder lets go; and a graphed decode loop hands
every step's logits to a consumer with no copy."""

import gc
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager

import pytest
import torch

pytest.importorskip("cuda.core")

import graphtree.share as share

# Each version is written in two phases a GPU sleep apart: first -1 everywhere, then the version
# number. A reader whose GPU did not wait for the producer's "ready" write would see -1 (or a mix).
# "plain": next() and commit(); "graphed": a graphed writer, whose recording writes "ready".
PRODUCER = """
import os, sys, time
name, n, slots, how, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
os.environ["GRAPHTREE_NATIVE"] = "1" if path == "native" else "0"
import torch, graphtree.share as share
from graphtree import _native
assert (_native.wait(600) is not None) == (path == "native"), _native.status()
pub = share.Publisher(name)
ch = pub.channel("v", (1 << 20,), torch.float32, slots=slots)

def write(value, *, out):
    out.fill_(-1.0)
    torch.cuda._sleep(20_000_000)   # about 10 ms of GPU time between the two phases
    return out.copy_(value.expand_as(out))

publish = ch.graphed(write, timeout=30)
value = torch.zeros((), device="cuda")
print("READY", flush=True)
while not pub.consumers():
    time.sleep(0.01)
for _ in range(n):
    value.fill_(float(ch.version + 1))
    if how == "graphed":
        publish(value)
    else:
        write(value, out=ch.next(timeout=30))
        ch.commit()
torch.cuda.synchronize()
print("DONE", ch.version, flush=True)
sys.stdin.readline()
"""


def _start(script, *args):
    proc = subprocess.Popen(
        [sys.executable, "-c", script, *map(str, args)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "READY"
    return proc


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


@contextmanager
def _producing(versions, how, path):
    """A PRODUCER process writing ``versions`` versions into 2 slots, and this process's
    subscription to its channel: ``(producer, subscription)``."""
    name = f"ch-{uuid.uuid4().hex[:8]}"
    proc = _start(PRODUCER, name, versions, 2, how, path)
    try:
        with share.attach(name) as shared:
            yield proc, shared.channel("v")
    finally:
        _stop(proc)


@pytest.mark.parametrize("path", ["python", "native"])  # the producer's take and publish
@pytest.mark.parametrize("how", ["plain", "graphed"])
def test_versions_are_stream_ordered_both_ways(how, path):
    with _producing(40, how, path) as (proc, sub):
        seen = []
        while sub.last < 40:
            with sub.read(timeout=30) as frame:
                # a slow reader: the GPU reads the version ~10 ms after read() returned, and the
                # producer's next write into this slot must wait for it (on the GPU)
                torch.cuda._sleep(20_000_000)
                lo_hi = torch.stack([frame.tensor.min(), frame.tensor.max()])
            seen.append((frame.version, *lo_hi.tolist()))
        assert all(lo == hi == v for v, lo, hi in seen), [s for s in seen if not s[1] == s[2] == s[0]][:5]
        assert [v for v, *_ in seen] == sorted({v for v, *_ in seen}), "versions only go forward"
        assert proc.stdout.readline().split() == ["DONE", "40"]


def test_reading_a_slot_without_the_protocol_sees_half_written_versions():
    """The control for the test above: the race it guards against is real on this GPU."""
    with _producing(60, "plain", "python") as (_, sub):
        torn = 0
        deadline = time.monotonic() + 30
        while sub.latest < 60 and time.monotonic() < deadline:
            for buf in sub.buffers:  # no wait on the producer's ready cell
                torn += int(buf.min().item() < 0)
        assert torn > 0, "unordered reads never caught a version being written"


def test_a_consumer_killed_with_sigkill_leaks_nothing_in_the_producer():
    name = f"ch-{uuid.uuid4().hex[:8]}"
    pub = share.Publisher(name)
    ch = pub.channel("v", (1024,), torch.float32, slots=2)
    ch.next().fill_(1.0)
    ch.commit()
    reader = (
        "import sys, time, torch, graphtree.share as share\n"
        "sub = share.attach(sys.argv[1]).channel('v')\n"
        "with sub.read(timeout=30) as f:\n"
        "    print('READING', flush=True)\n"
        "    time.sleep(600)\n"
    )
    fds = None
    try:
        for i in range(6):
            proc = subprocess.Popen([sys.executable, "-c", reader, name], stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "READING"  # holds a claim on the newest slot
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            for _ in range(2):  # both slots are written again: the dead reader's claim is dropped
                ch.next(timeout=10).fill_(float(ch.version + 1))
                ch.commit()
            assert pub.consumers() == []
            if i == 1:
                fds = len(os.listdir("/proc/self/fd"))
        assert len(os.listdir("/proc/self/fd")) <= fds, "no descriptor kept per dead consumer"
        assert pub._consumers == set(), "no consumer number kept per dead consumer"
    finally:
        pub.close()


# The state a producer killed between publishing a version (on its CPU) and its GPU's "ready"
# write leaves behind, built in one process: version 1 published, its ready cell never written,
# and the producer's pid that of a process that has exited.
STRANDED = """
import faulthandler, os, subprocess, sys, time, torch
faulthandler.dump_traceback_later(45, exit=True)  # a hang: every thread's stack on stderr, then exit
from graphtree.share._control import ControlBlock, Membership
from graphtree.share.channel import Channel, Subscription
gone = subprocess.Popen(["true"]); gone.wait()
block = ControlBlock.create()
buffers = [torch.zeros(1024, device="cuda") for _ in range(2)]
ch = Channel("v", 0, buffers, block, reap=lambda: None)
ch.next()
ch._publish()                       # version 1, on the CPU only: no "ready" write queued
sub = Subscription("v", 0, buffers, Membership(ControlBlock(os.dup(block.fd)), 0), gone.pid)
with sub.read(timeout=30) as frame:  # this GPU now waits for ready >= 1
    total = frame.tensor.sum()
print("READ", flush=True)
start = time.monotonic()
torch.cuda.synchronize()            # without the release thread's check: waits for ever
print("SYNCED %.2f" % (time.monotonic() - start), flush=True)
"""


def test_a_producer_that_died_before_its_gpu_wrote_a_version_does_not_hang_the_consumer():
    run = subprocess.run([sys.executable, "-c", STRANDED], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, (run.stdout, run.stderr[-4000:])  # a hang exits 1 with the threads' stacks
    assert run.stdout.split()[:2] == ["READ", "SYNCED"], (run.stdout, run.stderr[-2000:])
    assert "died before its GPU wrote version 1" in run.stderr, run.stderr[-2000:]
    print(run.stdout.strip(), "s: the consumer's GPU was released by its release thread")


HOLDER = """
import sys, torch, graphtree.share as share
pub = share.Publisher(sys.argv[1])
pub.empty("big", (256 << 20,), torch.float32).fill_(3.0)   # 1 GiB
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
"""


def test_memory_lives_while_a_consumer_holds_it_and_is_freed_when_the_last_holder_lets_go():
    # Free memory is the device's, not this process's: another process on the GPU (the other
    # one-process suite, run beside this one) moves it too. So it is read twice only, around the
    # last holder letting go, a second apart, not across the producer's start (seconds of import):
    # that the release frees the 1 GiB shows both that it lived on after the producer was killed and
    # that letting go frees it.
    gib = 1 << 30
    name = f"mem-{uuid.uuid4().hex[:8]}"
    proc = _start(HOLDER, name)
    shared = share.attach(name)
    again = share.attach(name)  # the same import, taken twice: freed only when both let go
    big = shared["big"]
    assert again["big"].data_ptr() == big.data_ptr(), "mapped once"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    time.sleep(1.0)
    assert float(big[-1]) == 3.0, "readable after the producer was killed"
    del big, shared
    gc.collect()
    torch.cuda.synchronize()
    assert float(again["big"][0]) == 3.0, "still held by the second attach"
    free_held = torch.cuda.mem_get_info()[0]
    del again
    gc.collect()
    torch.cuda.synchronize()
    time.sleep(1.0)
    free_after = torch.cuda.mem_get_info()[0]
    print(f"free device memory: {free_held / gib:.2f} GiB held after the SIGKILL, {free_after / gib:.2f} after")
    assert free_after - free_held > 0.9 * gib, "the consumer kept the 1 GiB alive until the last holder let go"


def test_channel_bad_input_gets_clear_errors():
    with share.Publisher(f"bad-{uuid.uuid4().hex[:8]}", max_bytes=1 << 20) as pub:
        with pytest.raises(ValueError, match="slots is an int from 1 to 8"):
            pub.channel("c", (4,), slots=0)
        with pytest.raises(TypeError, match=r"dtype must be a torch\.dtype"):
            pub.channel("c", (4,), "float32")
        ch = pub.channel("c", (4,), slots=1)
        with pytest.raises(RuntimeError, match=r"next\(\) gives the buffer to write before commit\(\)"):
            ch.commit()
        ch.next()
        with pytest.raises(RuntimeError, match=r"commit\(\) the version being written before next\(\)"):
            ch.next()
        ch.commit()
        with pytest.raises(ValueError, match="already published"):
            pub.channel("c", (4,))
        with share.attach(pub.path) as shared, pytest.raises(KeyError, match="read from other processes"):
            shared.channel("c")  # the producer's own process
        reader = (
            "import sys, graphtree.share as share\n"
            "shared = share.attach(sys.argv[1])\n"
            "sub = shared.channel('c')\n"
            "with sub.read() as frame:\n"
            "    print('VERSION', frame.version, flush=True)\n"
            "for bad in ('d', 'c-timeout'):\n"
            "    try:\n"
            "        shared.channel(bad) if bad == 'd' else sub.read(timeout=0.2).__enter__()\n"
            "    except Exception as e:\n"
            "        print(type(e).__name__, e, flush=True)\n"
        )
        r = subprocess.run(
            [sys.executable, "-c", reader, pub.path], check=False, capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.splitlines() == [
            "VERSION 1",
            f"KeyError \"{pub.path} publishes no channel 'd' (it publishes: c)\"",
            "TimeoutError channel 'c': no version newer than 1 within 0.2 s",
        ]


def test_a_graphed_decode_loop_hands_every_steps_logits_to_a_consumer_without_a_copy():
    from graphtree.bench.share import measure

    rows = {r["way"]: r for r in measure(steps=40, warmup=8, layers=2, d_model=128, vocab=4096)}
    print(rows)
    assert {way: r["eager_steps"] for way, r in rows.items()} == dict.fromkeys(rows, 0), "every step replayed"
    for way in ("graphtree.share", "mp-queue", "pinned-copy"):
        assert rows[way]["tokens_equal"], way
        assert rows[way]["versions_read"] > 0, way
    g = rows["graphtree.share"]
    assert g["copied_bytes_per_step"] == 0
    assert g["attach_cached_ms"] < 5
