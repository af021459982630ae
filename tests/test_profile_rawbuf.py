"""Raw activity buffers (libcupti through ctypes, ``graphtree/profile/_rawbuf.py``), CPU only.

* the ctypes plumbing against a C stand-in of libcupti (built with the C compiler when there is
  one): callback signatures, the buffer pool, CUPTI's record iterator, finding the mapped library;
* the session on the fake CUPTI: the raw path is the one used, builds no Python object per record,
  agrees with cupti-python's path, falls back when the layout check fails;
* speed: a million records stashed and aggregated at stop() in well under a second.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))
from gt_profile_workloads import digest, mixed_workload

import graphtree
from graphtree.profile import ProfileOptions, _buffers, _parse, _rawbuf
from graphtree.profile._model import KERNEL, MEMCPY

STUB = Path(__file__).resolve().parent / "fakes" / "libcupti_stub.c"
_NAMES: dict = {}


def _name_ptr(name: str) -> int:
    buf = _NAMES.get(name)
    if buf is None:
        buf = _NAMES[name] = ctypes.create_string_buffer(name.encode())
    return ctypes.addressof(buf)


def _kernels(cupti, n, corr0=1, names=("a", "b", "c"), graph_id=0, node0=0):
    arr = np.zeros(n, dtype=cupti.activity_kernel10_dtype)
    arr["kind"] = int(cupti.ActivityKind.CONCURRENT_KERNEL)
    arr["start"] = 1000 + 100 * np.arange(n)
    arr["end"] = arr["start"] + 40
    arr["stream_id"] = 7
    arr["correlation_id"] = corr0 + np.arange(n)
    ptrs = np.asarray([_name_ptr(nm) for nm in names], dtype=np.int64)
    arr["name"] = ptrs[np.arange(n) % len(names)]
    arr["graph_id"] = graph_id
    arr["graph_node_id"] = (node0 + np.arange(n) % len(names)) if node0 else 0
    return arr


def _memcpys(cupti, n, corr0=1000):
    arr = np.zeros(n, dtype=cupti.activity_memcpy6_dtype)
    arr["kind"] = int(cupti.ActivityKind.MEMCPY)
    arr["copy_kind"] = int(cupti.ActivityMemcpyKind.HTOD)
    arr["bytes"] = 64
    arr["start"] = 5000 + np.arange(n)
    arr["end"] = arr["start"] + 10
    arr["correlation_id"] = corr0 + np.arange(n)
    return arr


@pytest.fixture(scope="module")
def stub_lib(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the libcupti stand-in")
    out = tmp_path_factory.mktemp("stub") / "libcupti.so.99"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(out), str(STUB)], check=True)
    return str(out)


def test_ctypes_buffers_pool_and_iterator_against_a_libcupti_stand_in(stub_lib):
    from fake_cupti import cupti

    backend = _rawbuf.LibcuptiBuffers(stub_lib)
    lib = backend.lib
    lib.stub_emit.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    kdt, mdt = cupti.activity_kernel10_dtype, cupti.activity_memcpy6_dtype
    lib.stub_set_size(10, kdt.itemsize)
    lib.stub_set_size(1, mdt.itemsize)
    # the library is found where the process mapped it
    _path, mapped = _rawbuf.find_libcupti()
    assert stub_lib in mapped

    parser = _parse._RawParser.create(cupti, ProfileOptions(buffer_size=4096))
    parser.backend = backend
    pool = _rawbuf.BufferPool(4096, keep=1)
    got, offsets = [], []

    def complete(addr, size, valid):
        assert pool.owns(addr) and size == 4096 and addr % 8 == 0
        offsets.append(backend.record_offsets(addr, valid))
        got.append(parser.stash_raw(addr, valid))
        pool.give(addr)

    backend.register(pool.take, complete)
    backend.enable(10)
    backend.flush_period(250)
    assert lib.stub_enabled(10) == 1 and lib.stub_flush_period() == 250
    parts = [_kernels(cupti, 12), _memcpys(cupti, 3), _kernels(cupti, 30, corr0=100)]
    for a in parts:
        lib.stub_emit(a.ctypes.data, a.nbytes)
    backend.flush_all(1)
    backend.disable(10)
    assert lib.stub_enabled(10) == 0
    assert len(got) >= 2  # 45 records of up to 216 bytes do not fit one 4 KiB buffer
    # CUPTI's iterator and the numpy walk agree on the first (mixed) buffer
    assert offsets[0][:13] == [i * kdt.itemsize for i in range(12)] + [12 * kdt.itemsize]
    kernels = np.concatenate([c for items in got for code, c in items if code == KERNEL])
    memcpys = np.concatenate([c for items in got for code, c in items if code == MEMCPY])
    assert kernels.shape == (42,) and memcpys.shape == (3,)
    assert sorted(kernels["correlation_id"].tolist()) == list(range(1, 13)) + list(range(100, 130))
    assert memcpys["bytes"].tolist() == [64, 64, 64]
    (batch,) = parser.batches([(KERNEL, kernels)])
    assert sorted(batch[1]) == ["a", "b", "c"]
    # the pool: one buffer at a time here, at most `keep` kept, nothing left in flight
    assert pool.in_flight == 0 and pool.max_in_flight == 1 and pool.allocated == 1
    backend.release()


def test_a_buffer_request_failure_drops_records_instead_of_crashing(stub_lib):
    backend = _rawbuf.LibcuptiBuffers(stub_lib)
    lib = backend.lib
    lib.stub_emit.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def request():
        raise MemoryError

    backend.register(request, lambda *a: None)
    a = np.zeros(216, dtype=np.uint8)
    a[:4] = np.frombuffer(np.uint32(10).tobytes(), dtype=np.uint8)
    lib.stub_set_size(10, 216)
    before = lib.stub_dropped()
    lib.stub_emit(a.ctypes.data, a.nbytes)
    backend.flush_all(1)
    assert lib.stub_dropped() == before + 1
    backend.release()


# ------------------------------------------------------------------------------- session
def _graph_run(sim, prof_kwargs, replays=40, kernels=20):
    with graphtree.profile(**prof_kwargs) as prof:
        exe = sim.capture(lambda: [sim.launch_kernel(f"k{i % 5}") for i in range(kernels)])
        for _ in range(replays):
            sim.graph_launch(exe)
    return prof


def test_raw_path_is_used_and_creates_no_object_per_record(fake_cupti, monkeypatch):
    sim = fake_cupti.SIM
    built = []
    real = fake_cupti.ActivityKernel10.from_ptr.__func__

    def counting(cls, ptr, readonly=False, owner=None):
        built.append(ptr)
        return real(cls, ptr, readonly, owner)

    monkeypatch.setattr(fake_cupti.ActivityKernel10, "from_ptr", classmethod(counting))
    slow = []
    monkeypatch.setattr(_buffers.ActivityBuffers, "_completed_slow", lambda self, acts: slow.append(acts))
    prof = _graph_run(sim, {"buffer_size": 64 * 216}, replays=100, kernels=40)
    s = prof.summary()
    assert prof.data.buffer_path.startswith("libcupti") and prof.data.notes == []
    assert (
        s["kernels"] == 4000 and s["records_without_launch"] == 0 and {g.replays for g in prof.graph_stats()} == {100}
    )
    assert slow == [] and sim.buffer_completed is None  # cupti-python's buffer callbacks unused
    # per buffer: first and last record checked against cupti-python's class, nothing per record
    assert s["buffers_completed"] >= 4000 // 64 and len(built) <= 2 * s["buffers_completed"]
    assert s["max_buffers_in_flight"] == 1


@pytest.mark.parametrize("other", [{"raw_buffers": False}, {"vectorized": False}])
def test_raw_path_agrees_with_cupti_python_paths(fake_cupti, other):
    sim = fake_cupti.SIM
    raw = mixed_workload(sim)
    assert raw.data.buffer_path.startswith("libcupti") and raw.data.notes == []
    sim.reset()
    ref = mixed_workload(sim, **other)
    assert ref.data.buffer_path == "cupti-python"
    assert digest(raw, strip_ids=True) == digest(ref, strip_ids=True)


def test_offsets_that_disagree_with_cuptis_iterator_fall_back(fake_cupti, monkeypatch):
    sim = fake_cupti.SIM
    real = fake_cupti.FakeLibcupti.record_offsets

    def lying(self, addr, valid, limit=None):
        offs = real(self, addr, valid, limit)
        return offs if limit is None else [o + 8 for o in offs]  # only the check is lied to

    monkeypatch.setattr(fake_cupti.FakeLibcupti, "record_offsets", lying)
    prof = _graph_run(sim, {"buffer_size": 4096})
    assert any("vectorized record parsing disabled" in n for n in prof.data.notes)
    s = prof.summary()
    assert s["kernels"] == 800 and s["record_errors"] == 0 and {g.replays for g in prof.graph_stats()} == {40}
    # the next session does not try the raw layout again
    sim.reset()
    again = _graph_run(sim, {"buffer_size": 4096})
    assert again.data.buffer_path == "cupti-python" and again.summary()["kernels"] == 800


def test_without_libcupti_the_session_uses_cupti_pythons_buffers(fake_cupti, monkeypatch):
    def missing(_cupti):
        raise _rawbuf.RawBuffersUnavailable("libcupti not found")

    monkeypatch.setattr(_rawbuf, "BACKEND_FACTORY", missing)
    prof = _graph_run(fake_cupti.SIM, {})
    assert prof.data.buffer_path == "cupti-python" and "not found" in prof.data.buffer_path_reason
    assert prof.summary()["kernels"] == 800


def test_stop_aggregates_a_million_records_in_well_under_a_second(fake_cupti):
    """The decode loop's shape: graph replays of 81 kernels, ~1M records, 8 MB buffers."""
    cupti = fake_cupti
    per, n = 81, 1_000_000
    replays = n // per
    prof = graphtree.profile(buffer_size=8 << 20)
    prof.start()
    session = prof._session.buffers  # the activity side of the session
    data = prof.data
    size = cupti.activity_kernel10_dtype.itemsize

    class Iterator:  # CUPTI's iterator over these synthetic buffers (all kernel records)
        def record_offsets(self, addr, valid, limit=None):
            return list(range(0, valid, size))[:limit]

    session._raw.backend = Iterator()
    session._raw.objects = {}  # no cupti-python objects for synthetic records
    capture = lambda: 0  # noqa: E731
    for j in range(per):
        data.node_created(1, 1000 + j, 0, 12345, capture)
    for r in range(replays):  # cudaGraphLaunch: enter + exit, correlation r + 1
        data.api_enter(2, 311, r + 1, 1, 0, capture)
        data.api_exit(2, 311, r + 1, 1, 0)
    template = _kernels(cupti, per, names=[f"kernel_{j}" for j in range(per)], graph_id=1, node0=1000)
    per_buf = (8 << 20) // template.dtype.itemsize // per * per
    buf = np.zeros(per_buf, dtype=template.dtype)
    stash_s = 0.0
    done = 0
    while done < replays:
        k = min(per_buf // per, replays - done)
        view = buf[: k * per]
        view[:] = np.tile(template, k)
        view["correlation_id"] = np.repeat(np.arange(done + 1, done + k + 1), per)
        t0 = time.perf_counter()
        session._raw_completed(view.ctypes.data, 8 << 20, view.nbytes)
        stash_s += time.perf_counter() - t0
        done += k
    t0 = time.perf_counter()
    prof.stop()
    stop_s = time.perf_counter() - t0
    s = prof.summary()
    assert s["kernels"] == replays * per and s["records_without_launch"] == 0 and s["record_errors"] == 0
    assert {g.replays for g in prof.graph_stats()} == {replays}
    assert len(prof.kernel_stats()) == per and all(st.count == replays for st in prof.kernel_stats())
    print(f"stash {stash_s:.3f} s, stop {stop_s:.3f} s, timings {prof.data.stop_timings}")
    assert stash_s < 0.5, f"stashing 1M records took {stash_s:.2f} s"
    assert stop_s < 1.0, f"stop() aggregating 1M records took {stop_s:.2f} s"


@pytest.mark.parametrize("pattern", [(1, 1), (3, 1), (275, 1), (40, 7)])
def test_buffers_mixing_kinds_are_parsed_exactly_with_a_few_numpy_calls(fake_cupti, monkeypatch, pattern):
    """A decode loop's buffers on an H100 mixed kinds every ~4 records (9,600 runs in 40,000): each
    run costing a few numpy calls made one 8 MB buffer take 300-400 ms. The walk follows short runs
    in Python and gathers each kind's fields at once: numpy is called per kind, not per run."""
    cupti = fake_cupti
    parser = _parse._RawParser.create(cupti, ProfileOptions(buffer_size=8 << 20))
    parser.backend, parser.objects = None, {}
    kernels, memcpys = [], []
    parts = []
    for s in range(max(1, 30_000 // sum(pattern))):  # about 30,000 records: one buffer of 6-8 MB
        k = _kernels(cupti, pattern[0], corr0=1 + s * 1000)
        m = _memcpys(cupti, pattern[1], corr0=700 + s * 1000)
        kernels.append(k)
        memcpys.append(m)
        parts += [k.tobytes(), m.tobytes()]
    blob = bytearray(b"".join(parts))
    buf = np.frombuffer(blob, dtype=np.uint8)
    calls = {"count_run": 0, "gather": 0}
    for name in calls:
        orig = getattr(_parse._RawParser, f"_{name}")

        def counted(self, *a, _orig=orig, _name=name):
            calls[_name] += 1
            return _orig(self, *a)

        monkeypatch.setattr(_parse._RawParser, f"_{name}", counted)
    out = dict(parser.stash_raw(buf.ctypes.data, len(blob)))
    k_all, m_all = np.concatenate(kernels), np.concatenate(memcpys)
    assert out[KERNEL]["correlation_id"].tolist() == k_all["correlation_id"].tolist()
    assert out[KERNEL]["name"].tolist() == k_all["name"].tolist()
    assert out[KERNEL]["start"].tolist() == k_all["start"].tolist()
    assert out[MEMCPY]["correlation_id"].tolist() == m_all["correlation_id"].tolist()
    assert out[MEMCPY]["bytes"].tolist() == m_all["bytes"].tolist()
    assert calls["gather"] <= 2  # once per kind
    long_runs = sum(n > _parse._RawParser._step_limit for n in pattern) * len(kernels)
    assert calls["count_run"] <= long_runs  # numpy only for runs longer than the Python steps


def test_stop_leaves_aggregation_to_the_first_query(fake_cupti):
    sim = fake_cupti.SIM
    prof = graphtree.profile()
    with prof:
        for _ in range(5):
            sim.launch_kernel("k")
    timings = dict(prof.data.stop_timings)
    assert "read kernel names" in timings and "aggregate records" not in timings
    assert prof.data.summary()["kernels"] == 0  # nothing aggregated yet
    assert prof.summary()["kernels"] == 5  # the first query aggregates
    assert "aggregate records" in prof.data.stop_timings
    assert [s.name for s in prof.kernel_stats()] == ["k"]
