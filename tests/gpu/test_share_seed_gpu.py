"""Seed 002: a consumer opens a producer's memory, destroys its CUDA context, creates a new one and
opens the memory again. With legacy IPC (``cuIpcOpenMemHandle``) the second open failed with
CUDA_ERROR_INVALID_HANDLE on drivers 455/460. Two forms, each with the seed's three sizes and a
consumer that uses the driver API only (``cuda.bindings``, contexts of its own):

- raw legacy IPC, to show whether this driver has the bug (reported, not asserted);
- graphtree's path (the pool's descriptor over the rendezvous, ``cuMemPoolImportPointer``),
  which must pass on any driver: the consumer asks again after re-creating its context; the
  producer does nothing."""

import subprocess
import sys
import uuid

import pytest

pytest.importorskip("cuda.bindings")
pytest.importorskip("cuda.core")

SIZES = (146064, 226656, 154909264)

DRIVER = """
import ctypes
from cuda.bindings import driver as d

def ck(result):
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(d.cuGetErrorName(err)[1].decode())
    return rest[0] if len(rest) == 1 else rest

def new_context():
    dev = ck(d.cuDeviceGet(0))
    try:
        return ck(d.cuCtxCreate(None, 0, dev))   # CUDA 13: (params, flags, device)
    except TypeError:
        return ck(d.cuCtxCreate(0, dev))

def byte_at(ptr, offset):
    out = ctypes.create_string_buffer(1)
    ck(d.cuMemcpyDtoH(ctypes.addressof(out), int(ptr) + offset, 1))
    return out.raw[0]
"""

LEGACY_PRODUCER = (
    DRIVER
    + """
import sys
ck(d.cuInit(0))
ctx = ck(d.cuDevicePrimaryCtxRetain(ck(d.cuDeviceGet(0))))
ck(d.cuCtxSetCurrent(ctx))
for i, size in enumerate(map(int, sys.argv[1:])):
    ptr = ck(d.cuMemAlloc(size))
    ck(d.cuMemsetD8(ptr, i + 1, size))
    print(size, bytes(ck(d.cuIpcGetMemHandle(ptr)).reserved).hex(), flush=True)
print("READY", flush=True)
sys.stdin.readline()
"""
)

LEGACY_CONSUMER = (
    DRIVER
    + """
import sys
ck(d.cuInit(0))
handles = [(int(s), bytes.fromhex(h)) for s, h in (line.split() for line in sys.argv[1:])]
for attempt in (1, 2):
    ctx = new_context()
    ptrs = []
    try:
        for i, (size, raw) in enumerate(handles):
            h = d.CUipcMemHandle()
            h.reserved = raw
            ptr = ck(d.cuIpcOpenMemHandle(h, d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
            ptrs.append(ptr)
            assert byte_at(ptr, size - 1) == i + 1
        print(f"open {attempt}: ok", flush=True)
    except RuntimeError as e:
        print(f"open {attempt}: {e}", flush=True)
    for ptr in ptrs:
        ck(d.cuIpcCloseMemHandle(ptr))
    ck(d.cuCtxDestroy(ctx))
"""
)

GRAPHTREE_PRODUCER = """
import sys, torch, graphtree.share as share
pub = share.Publisher(sys.argv[1])
for i, size in enumerate(map(int, sys.argv[2:])):
    pub.empty(f"t{i}", (size,), torch.uint8).fill_(i + 1)
torch.cuda.synchronize()
print("READY", flush=True)
sys.stdin.readline()
"""

GRAPHTREE_CONSUMER = (
    DRIVER
    + """
import base64, os, sys
from graphtree.share._rendezvous import default_path, request
ck(d.cuInit(0))
path = default_path(sys.argv[1])
for attempt in (1, 2):
    ctx = new_context()
    reply, fds = request(path, {"op": "attach"})
    pool = ck(d.cuMemPoolImportFromShareableHandle(
        fds[0], d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
    for fd in fds:
        os.close(fd)
    ptrs = []
    for i in range(len(reply["tensors"])):
        meta = reply["tensors"][f"t{i}"]
        data = d.CUmemPoolPtrExportData()
        data.reserved = base64.b64decode(meta["export"]["data"])
        ptr = ck(d.cuMemPoolImportPointer(pool, data))
        ptrs.append(ptr)
        size = meta["shape"][0]
        assert byte_at(ptr, 0) == i + 1 and byte_at(ptr, size - 1) == i + 1, (attempt, i)
    print(f"open {attempt}: ok", flush=True)
    for ptr in ptrs:
        ck(d.cuMemFree(ptr))
    ck(d.cuMemPoolDestroy(pool))
    ck(d.cuCtxDestroy(ctx))
"""
)


def _producer(args):
    proc = subprocess.Popen([sys.executable, "-c", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        if line.strip() == "READY":
            return proc, lines
        lines.append(line.strip())
    raise AssertionError(f"the producer ended before it was ready: {lines}")


def _run(args):
    r = subprocess.run([sys.executable, "-c", *args], check=False, capture_output=True, text=True, timeout=120)
    return r.returncode, r.stdout.strip().splitlines(), r.stderr[-2000:]


def test_seed_002_with_raw_legacy_ipc_reports_whether_this_driver_has_the_bug():
    proc, handles = _producer([LEGACY_PRODUCER, *map(str, SIZES)])
    try:
        rc, out, err = _run([LEGACY_CONSUMER, *handles])
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert rc == 0, err
    assert out[0] == "open 1: ok", out
    verdict = "passed" if out[1] == "open 2: ok" else f"FAILED ({out[1].removeprefix('open 2: ')})"
    print(f"seed 002, legacy IPC (cuIpcOpenMemHandle) after a re-created context: {verdict}")


def test_seed_002_with_graphtrees_path_passes_after_the_context_is_re_created():
    name = f"seed-{uuid.uuid4().hex[:8]}"
    proc, _ = _producer([GRAPHTREE_PRODUCER, name, *map(str, SIZES)])
    try:
        rc, out, err = _run([GRAPHTREE_CONSUMER, name])
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert rc == 0, err
    assert out == ["open 1: ok", "open 2: ok"], (out, err)
    print("seed 002, graphtree.share after a re-created context: passed")
