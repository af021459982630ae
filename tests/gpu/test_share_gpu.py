"""graphtree.share on a GPU: a producer process publishes, this process attaches (zero copies,
both directions), the memory outlives a producer killed with SIGKILL, bad input gets clear
errors, and a thousand attach/detach cycles leak no file descriptor."""

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

cuda_core = pytest.importorskip("cuda.core")

import graphtree.share as share  # noqa: E402

PRODUCER = """
import sys, torch, graphtree.share as share
pub = share.Publisher(sys.argv[1])
x = pub.publish("x", torch.arange(1024, dtype=torch.float32, device="cuda"))
h = pub.empty("h", (3, 5), torch.float16)
h.fill_(2.5)
pub.empty("e", (0, 4), torch.float32)  # empty: attached as an empty tensor
torch.cuda.synchronize()
print("READY", flush=True)
for line in sys.stdin:
    torch.cuda.synchronize()
    print("SUM", float(x.sum()), flush=True)
"""


@pytest.fixture
def producer():
    name = f"test-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, name], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    line = proc.stdout.readline()
    assert line.strip() == "READY", line
    yield name, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_attach_sees_the_producers_memory_and_the_producer_sees_our_writes(producer):
    name, proc = producer
    shared = share.attach(name)
    assert sorted(shared) == ["e", "h", "x"]
    assert shared["e"].shape == (0, 4) and shared["e"].dtype == torch.float32 and shared["e"].is_cuda
    x = shared.get("x", shape=(1024,), dtype=torch.float32)
    assert torch.equal(x, torch.arange(1024, dtype=torch.float32, device="cuda"))
    assert torch.equal(shared["h"], torch.full((3, 5), 2.5, dtype=torch.float16, device="cuda"))
    x.add_(1)  # in the producer's memory
    torch.cuda.synchronize()
    proc.stdin.write("check\n")
    proc.stdin.flush()
    assert proc.stdout.readline().split() == ["SUM", str(float(sum(range(1, 1025))))]


def test_the_memory_outlives_a_producer_killed_with_sigkill(producer):
    name, proc = producer
    x = share.attach(name)["x"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    torch.cuda.synchronize()
    assert torch.equal(x, torch.arange(1024, dtype=torch.float32, device="cuda"))
    x.mul_(2)  # still ours to use
    assert float(x.sum()) == 2 * float(sum(range(1024)))
    with pytest.raises(FileNotFoundError, match=r"no graphtree\.share producer serves"):
        share.attach(name, timeout=2)


def test_bad_input_gets_clear_errors(producer, tmp_path):
    name, _ = producer
    shared = share.attach(name)
    with pytest.raises(KeyError, match=r"publishes no tensor 'y' \(it publishes: e, h, x\)"):
        shared["y"]
    with pytest.raises(ValueError, match=r"has shape \(1024,\), not the \(4, 256\) expected"):
        shared.get("x", shape=(4, 256))
    with pytest.raises(ValueError, match=r"has dtype torch\.float32, not the torch\.float16 expected"):
        shared.get("x", dtype=torch.float16)
    with pytest.raises(FileNotFoundError, match=r"no graphtree\.share producer serves"):
        share.attach(f"nobody-{uuid.uuid4().hex[:8]}", timeout=2)
    closed = share.Publisher(f"closed-{uuid.uuid4().hex[:8]}", max_bytes=1 << 20)
    closed.close()
    with pytest.raises(FileNotFoundError, match=r"no graphtree\.share producer serves"):
        share.attach(closed.path, timeout=2)
    with share.Publisher(f"local-{uuid.uuid4().hex[:8]}", max_bytes=1 << 20) as pub:
        with pytest.raises(TypeError, match="publishes CUDA tensors, got a tensor on cpu"):
            pub.publish("cpu", torch.ones(2))
        with pytest.raises(TypeError, match="publishes CUDA tensors, got list"):
            pub.publish("list", [1, 2])
        pub.publish("a", torch.ones(2, device="cuda"))
        with pytest.raises(ValueError, match="already published"):
            pub.publish("a", torch.ones(2, device="cuda"))
        with pytest.raises(FileExistsError):
            share.Publisher(os.path.basename(pub.path).removesuffix(".sock"))


def test_a_thousand_attach_detach_cycles_leak_no_descriptor(producer):
    name, _ = producer
    for _ in range(20):  # settle: CUDA and cuda.core open what they keep
        share.attach(name)["x"].sum()
    before = _fds()
    start = time.perf_counter()
    for _ in range(1000):
        x = share.attach(name)["x"]
        x.add_(0)  # queued work on the memory, then the tensor is dropped: its free must wait for it
        del x
    torch.cuda.synchronize()
    print(f"attach: {(time.perf_counter() - start) * 1e3 / 1000:.3f} ms each (connect, import, map)")
    assert _fds() - before <= 2, (before, _fds())


DROPPED_IN_A_CAPTURE = """
import sys, time, torch, graphtree.share as share
from graphtree.share import consumer
shared = share.attach(sys.argv[1])
x, h = shared["x"], shared["h"]
assert torch.equal(x, torch.arange(1024, device="cuda", dtype=torch.float32))
pool = next(iter(consumer._imports.values()))
graph, static = torch.cuda.CUDAGraph(), torch.zeros(1024, device="cuda")
with torch.cuda.graph(graph):
    static.add_(1)
    del shared, h        # the last tensors on two buffers ("h", "e") go while this thread captures
    if sys.argv[2] == "all":
        del x            # ... and the last of all: the import is to close
graph.replay()
graph.replay()
torch.cuda.synchronize()
assert torch.equal(static, torch.full_like(static, 2)), static
if sys.argv[2] != "all":
    del x
deadline = time.monotonic() + 5
while not pool._mr.is_closed and time.monotonic() < deadline:
    time.sleep(0.01)
print("CLOSED", pool._mr.is_closed, flush=True)
"""


@pytest.mark.parametrize("how", ["some", "all"])
def test_a_shared_tensor_dropped_inside_a_graph_capture_is_freed_after_it(producer, how):
    """Freeing (and closing the import) inside a capture would add a free node to the graph or end
    the capture with an error; both wait for the capture's end."""
    name, _ = producer
    run = subprocess.run(
        [sys.executable, "-c", DROPPED_IN_A_CAPTURE, name, how],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "CLOSED True" in run.stdout, (run.stdout, run.stderr[-3000:])
    assert "Exception" not in run.stderr, run.stderr[-3000:]  # none ignored in a finalizer or a thread
