"""What graphtree.profile does while the profiled program runs (CPU only, fake CUPTI).

The replay loop pays for the launch callbacks (in the launching thread) and for the processing of
completed activity buffers (CUPTI's thread, holding the GIL). These tests pin the cheap paths:
one stack capture per launch (none for the nested driver call), stack keys resolved to file/line
once per call site, and completed buffers only copied (aggregated at stop, on queries, or when
``defer_records`` records are pending).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))

import graphtree
from graphtree.profile import _attribution, _session
from graphtree.profile._attribution import StackTable, capture_stack, capture_stack_slow


def test_one_stack_capture_per_launch_none_for_the_nested_driver_call(fake_cupti, monkeypatch):
    calls = []
    real = _session.capture_stack

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(_session, "capture_stack", counting)
    sim = fake_cupti.SIM
    with graphtree.profile() as prof:
        exe = sim.capture(lambda: [sim.launch_kernel(f"k{i}") for i in range(3)])
        n0 = len(calls)
        for _ in range(10):
            sim.graph_launch(exe)  # cudaGraphLaunch, nesting cuGraphLaunch: 4 callbacks
    assert prof.summary()["graph_launches"] == 10 and prof.summary()["nested_calls"] >= 10
    assert len(calls) - n0 == 10


def test_stack_keys_resolve_like_f_lineno_and_only_once_per_site(monkeypatch):
    t = StackTable()

    def site():
        return capture_stack(t), capture_stack_slow(t)

    fast, slow = site()
    assert fast == slow and t.get(fast)[-1][2] == "site"
    resolved = []
    real = _attribution._resolve_raw
    monkeypatch.setattr(_attribution, "_resolve_raw", lambda key: resolved.append(key) or real(key))
    ids = {capture_stack(t) for _ in range(50)}  # one call site, 50 launches
    assert len(ids) == 1 and len(resolved) == 1


class _Counting:
    """A record object that counts attribute reads (what per-record Python work would do)."""

    reads = 0

    def __init__(self, obj):
        self.__dict__["_o"] = obj

    def __getattr__(self, name):
        _Counting.reads += 1
        return getattr(self._o, name)


def test_completed_buffers_are_stashed_not_parsed_per_record(fake_cupti):
    from graphtree.profile._model import ProfileOptions
    from graphtree.profile._parse import _FastParser

    sim = fake_cupti.SIM
    got = []
    sim.buffer_requested = lambda: (1 << 20, 0)
    sim.buffer_completed = got.append
    sim.enabled_kinds = {int(fake_cupti.ActivityKind.CONCURRENT_KERNEL)}
    for i in range(2000):
        sim.launch_kernel(f"k{i % 7}")
    fake_cupti.activity_flush_all(1)
    (records,) = got
    parser = _FastParser.create(fake_cupti, ProfileOptions(buffer_size=1 << 20))
    _Counting.reads = 0
    items = parser.stash([_Counting(r) for r in records])
    assert _Counting.reads < 50  # a handful of objects checked, not 2000 read
    ((_code, cols),) = items
    assert cols.shape == (2000,) and cols.dtype.itemsize <= 64
    (batch,) = parser.batches(items)
    assert sorted(batch[1]) == [f"k{i}" for i in range(7)] and len(batch[3]) == 2000


def test_records_are_aggregated_at_stop_and_on_queries(fake_cupti):
    sim = fake_cupti.SIM
    prof = graphtree.profile(buffer_size=4096)
    prof.start()
    exe = sim.capture(lambda: [sim.launch_kernel(f"k{i}") for i in range(50)])
    for _ in range(20):
        sim.graph_launch(exe)
    data = prof.data
    assert data.buffers_completed > 0 and data.records_total == 0  # only stashed so far
    assert prof._session.buffers.stash.records > 0
    fake_cupti.activity_flush_all(1)  # what CUPTI still holds is not the query's business
    assert prof.summary()["kernels"] == 1000  # a query aggregates what is pending
    assert prof._session.buffers.stash.records == 0
    for _ in range(20):
        sim.graph_launch(exe)
    prof.stop()
    s = prof.summary()
    assert s["kernels"] == 2000 and s["records_without_launch"] == 0 and s["record_errors"] == 0
    assert {g.replays for g in prof.graph_stats()} == {40}


def test_pending_records_stay_bounded(fake_cupti):
    from graphtree.profile import Profile, ProfileOptions

    sim = fake_cupti.SIM
    seen = []
    with Profile(ProfileOptions(buffer_size=4096, defer_records=100, keep_records=False)) as prof:
        exe = sim.capture(lambda: [sim.launch_kernel("k") for _ in range(50)])
        for _ in range(40):
            sim.graph_launch(exe)
            seen.append(prof._session.buffers.stash.records)
    assert max(seen) < 100 + 4096 // 216
    assert prof.summary()["kernels"] == 2000


def test_pending_records_drain_before_their_launches_are_evicted(fake_cupti):
    from graphtree.profile import Profile, ProfileOptions

    sim = fake_cupti.SIM
    with Profile(ProfileOptions(buffer_size=1 << 20, launch_generation=16)) as prof:
        for _ in range(200):  # one record per launch: the launch table turns over every 16
            sim.launch_kernel("eager")
            fake_cupti.activity_flush_all(1)
    s = prof.summary()
    assert s["kernels"] == 200 and s["records_without_launch"] == 0
