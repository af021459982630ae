"""graphtree.profile against a fake CUPTI that gates callbacks like the real one (CPU only).

The fake (tests/fakes/fake_cupti) dispatches a callback only for (domain, cbid) pairs that were
enabled, so every launch path here fails if its subscription is missing.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))
from gt_profile_workloads import digest, mixed_workload

import graphtree
from graphtree.profile import ProfilerBusyError, ProfilerUnavailableError, _cbids, _session

RT, DRV, RES = 2, 1, 3


def _line(fn, text: str) -> int:
    src, first = inspect.getsourcelines(fn)
    for i, ln in enumerate(src):
        if text in ln:
            return first + i
    raise AssertionError(text)


def _leaf(prof, sid):
    frames = prof.stack(sid)
    return frames[-1] if frames else None


# ------------------------------------------------------------------------------- subscriptions
def test_subscribes_exactly_the_launch_and_graph_node_callbacks(fake_cupti):
    c = fake_cupti
    R, D = c.runtime_api_trace_cbid, c.driver_api_trace_cbid
    expected = {
        (RT, R.cudaLaunchKernel_v7000),
        (RT, R.cudaLaunchKernel_ptsz_v7000),
        (RT, R.cudaLaunchKernelExC_v11060),
        (RT, R.cudaLaunchKernelExC_ptsz_v11060),
        (RT, R.cudaLaunchCooperativeKernel_v9000),
        (RT, R.cudaLaunchCooperativeKernel_ptsz_v9000),
        (DRV, D.cuLaunchKernel),
        (DRV, D.cuLaunchKernel_ptsz),
        (DRV, D.cuLaunchKernelEx),
        (DRV, D.cuLaunchKernelEx_ptsz),
        (DRV, D.cuLaunchCooperativeKernel),
        (DRV, D.cuLaunchCooperativeKernel_ptsz),
        (RT, R.cudaGraphLaunch_v10000),
        (RT, R.cudaGraphLaunch_ptsz_v10000),
        (DRV, D.cuGraphLaunch),
        (DRV, D.cuGraphLaunch_ptsz),
        (RES, c.CallbackIdResource.GRAPHNODE_CREATED),
        (RES, c.CallbackIdResource.GRAPHNODE_CLONED),
        (RES, c.CallbackIdResource.GRAPH_CLONED),
    }
    with graphtree.profile():
        enabled = c.SIM.enabled_pairs()
        kinds = set(c.SIM.enabled_kinds)
        domains = set(c.SIM.subscriber.domains)
    assert enabled == {(d, int(x)) for d, x in expected}
    capture = {
        (RT, int(R[n])) if d == "runtime" else (DRV, int(D[n]))
        for d, n in _cbids.CAPTURE_CALLBACKS
        if n in R.__members__ or n in D.__members__
    }
    assert not enabled & capture, "stream-capture callbacks must never be enabled"
    assert domains == set(), "no whole domain may be enabled"
    assert kinds == {int(c.ActivityKind.CONCURRENT_KERNEL), int(c.ActivityKind.MEMCPY), int(c.ActivityKind.MEMSET)}
    assert int(c.ActivityKind.GRAPH_TRACE) not in kinds


def test_subscribe_comes_before_anything_global_and_stop_releases_everything(fake_cupti):
    c = fake_cupti
    with graphtree.profile():
        c.SIM.launch_kernel("k")
    names = [n for n, _ in c.SIM.calls]
    assert names[0] == "subscribe_v2"
    first_activity = min(i for i, n in enumerate(names) if n.startswith("activity_"))
    last_enable = max(i for i, (n, a) in enumerate(c.SIM.calls) if n == "enable_callback" and a[0] == 1)
    assert last_enable < names.index("activity_register_callbacks") < names.index("activity_enable")
    assert first_activity > names.index("subscribe_v2")
    # teardown: flushed, disabled, unsubscribed, no finalize
    assert c.SIM.subscriber is None and c.SIM.enabled_kinds == set()
    assert "activity_flush_all" in names and names.index("unsubscribe") > names.index("activity_disable")
    assert c.SIM.flush_period == 0 and c.SIM.finalized == 0
    assert _session.active_session() is None
    # another tool (torch.profiler/Kineto) can subscribe now
    handle = c.subscribe(lambda *a: None, 0)
    c.unsubscribe(handle)


def test_finalize_only_when_asked(fake_cupti):
    with graphtree.profile(finalize=True):
        pass
    assert fake_cupti.SIM.finalized == 1


# ------------------------------------------------------------------------------- launches
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("graph_corr", ["driver", "runtime"])
def test_runtime_graph_launch_counts_once_and_owns_all_its_kernels(fake_cupti, share, graph_corr):
    sim = fake_cupti.SIM
    sim.share_correlation = share
    sim.graph_record_corr = graph_corr

    def body():
        for name in ("a", "b", "c", "d"):
            sim.launch_kernel(name)

    with graphtree.profile() as prof:
        exe = sim.capture(body)
        for _ in range(3):
            sim.graph_launch(exe)
    s = prof.summary()
    assert s["graph_launches"] == 3 and s["api_counts"] == {"cudaGraphLaunch": 3}
    assert s["kernel_launches"] == 0 and s["capture_calls"] == 4
    assert [lz.kernels for lz in prof.graph_launches()] == [4, 4, 4]
    assert s["kernels"] == 12 and s["records_without_launch"] == 0


@pytest.mark.parametrize("api", ["cuGraphLaunch", "cuGraphLaunch_ptsz", "cudaGraphLaunch_ptsz_v10000"])
def test_driver_and_ptsz_graph_launches_are_seen(fake_cupti, api):
    sim = fake_cupti.SIM
    with graphtree.profile() as prof:
        exe = sim.capture(lambda: (sim.launch_kernel("x"), sim.launch_kernel("y")))
        sim.graph_launch(exe, api=api)
        sim.graph_launch(exe, api=api)
    s = prof.summary()
    assert s["api_counts"] == {_cbids.display_name(api): 2}
    assert [lz.kernels for lz in prof.graph_launches()] == [2, 2]
    assert s["records_without_launch"] == 0


def test_missing_driver_graph_subscription_would_be_caught(fake_cupti, monkeypatch):
    """The fake gates callbacks: without the cuGraphLaunch cbids the driver launch is invisible."""
    sim = fake_cupti.SIM
    trimmed = tuple(e for e in _cbids.LAUNCH_CALLBACKS if not e[1].startswith("cuGraphLaunch"))
    monkeypatch.setattr(_cbids, "LAUNCH_CALLBACKS", trimmed)
    with graphtree.profile() as prof:
        exe = sim.capture(lambda: sim.launch_kernel("x"))
        sim.graph_launch(exe, api="cuGraphLaunch")
    s = prof.summary()
    assert s["graph_launches"] == 0 and s["records_without_launch"] == 1


@pytest.mark.parametrize("api", [n for d, n, k in _cbids.LAUNCH_CALLBACKS if k == _cbids.KERNEL])
def test_every_kernel_launch_variant_is_one_launch_at_its_call_site(fake_cupti, api):
    sim = fake_cupti.SIM
    with graphtree.profile() as prof:
        sim.launch_kernel("k", api=api)  # the call site
    here = _line(test_every_kernel_launch_variant_is_one_launch_at_its_call_site, 'sim.launch_kernel("k", api=api)')
    s = prof.summary()
    assert s["kernel_launches"] == 1 and s["graph_launches"] == 0
    assert s["api_counts"] == {_cbids.display_name(api): 1}
    (st,) = prof.kernel_stats()
    assert _leaf(prof, st.stack_id)[1:] == (here, "test_every_kernel_launch_variant_is_one_launch_at_its_call_site")


def test_launches_into_a_capturing_stream_are_not_launches(fake_cupti):
    sim = fake_cupti.SIM
    with graphtree.profile() as prof:
        sim.begin_capture()
        sim.launch_kernel("a")
        sim.launch_kernel("b", api="cuLaunchKernel")
        sim.end_capture()
    s = prof.summary()
    assert s["kernel_launches"] == 0 and s["graph_launches"] == 0 and s["records"] == 0
    assert s["capture_calls"] == 2 and s["nodes_created"] == 2
    assert prof.launches() == []


# ------------------------------------------------------------------------------- attribution
def _model_forward(sim):
    sim.launch_kernel("gemm")
    sim.launch_kernel("gelu", api="cuLaunchKernelEx")
    sim.memcpy(256)


def _old_body(sim):
    sim.launch_kernel("old")


@pytest.mark.parametrize("node_ids", ["clone", "original"])
@pytest.mark.parametrize("graph_ids", ["exec", "original"])
def test_replayed_kernels_carry_the_captured_python_lines(fake_cupti, node_ids, graph_ids):
    sim = fake_cupti.SIM
    sim.record_node_ids = node_ids
    sim.record_graph_ids = graph_ids
    old = sim.capture(lambda: _old_body(sim))  # before profiling
    with graphtree.profile() as prof:
        exe = sim.capture(lambda: _model_forward(sim))
        sim.graph_launch(exe)
        sim.graph_launch(exe)
        sim.graph_launch(old)  # replay of a graph captured before profiling
    replay_line = _line(test_replayed_kernels_carry_the_captured_python_lines, "sim.graph_launch(old)")
    rows = {st.name: st for st in prof.kernel_stats()}
    assert _leaf(prof, rows["gemm"].stack_id)[1:] == (_line(_model_forward, '"gemm"'), "_model_forward")
    assert _leaf(prof, rows["gelu"].stack_id)[1:] == (_line(_model_forward, '"gelu"'), "_model_forward")
    assert _leaf(prof, rows["Memcpy DtoD"].stack_id)[1:] == (_line(_model_forward, "memcpy"), "_model_forward")
    assert rows["gemm"].count == 2 and not rows["gemm"].captured_before_profiling
    assert rows["old"].captured_before_profiling and rows["old"].count == 1
    assert _leaf(prof, rows["old"].stack_id)[1:] == (
        replay_line,
        "test_replayed_kernels_carry_the_captured_python_lines",
    )
    graphs = {g.captured_before_profiling: g for g in prof.graph_stats()}
    assert graphs[False].replays == 2 and graphs[False].kernels == 6
    assert graphs[True].replays == 1 and graphs[True].kernels == 1
    assert prof.summary()["records_before_profiling"] == 1


def test_graphtree_recordings_are_labelled(fake_cupti):
    from graphtree import _events

    sim = fake_cupti.SIM
    with graphtree.profile() as prof:
        _events.publish("record_begin", name="step", node="n3")
        exe = sim.capture(lambda: sim.launch_kernel("k"))
        _events.publish("record_end", name="step", node="n3", graph=None)
        sim.graph_launch(exe)
        plain = sim.capture(lambda: sim.launch_kernel("p"))
        sim.graph_launch(plain)
    labels = {st.name: st.label for st in prof.kernel_stats()}
    assert labels == {"k": "graphtree:step/n3", "p": None}
    assert "graphtree:step/n3" in prof.table()


# ------------------------------------------------------------------------------- busy / unavailable
def test_other_subscriber_is_a_clear_busy_error_and_nothing_is_touched(fake_cupti):
    sim = fake_cupti.SIM
    sim.other_subscriber = "nsys-collector"
    with pytest.raises(ProfilerBusyError) as e:
        graphtree.profile().start()
    msg = str(e.value)
    assert "nsys-collector" in msg and "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED" in msg
    assert sim.enabled_kinds == set() and sim.buffer_requested is None
    assert _session.active_session() is None


def test_busy_error_names_a_running_torch_profiler(fake_cupti):
    import torch

    fake_cupti.SIM.other_subscriber = ""  # Kineto subscribes without a name
    with torch.profiler.profile(), pytest.raises(ProfilerBusyError, match=r"torch\.profiler"):
        graphtree.profile().start()


@pytest.mark.parametrize(
    "path,who",
    [
        ("/usr/local/cuda/compute-sanitizer/libsanitizer-collection.so", "compute-sanitizer"),
        ("/opt/nvidia/nsight-systems/target-linux-x64/libToolsInjection64.so", "Nsight Systems"),
        ("/opt/nvidia/nsight-compute/target/linux-desktop-glibc_2_11_3-x64/libnvperf_host.so", "Nsight Compute"),
    ],
)
def test_busy_error_names_injected_tools(fake_cupti, monkeypatch, path, who):
    monkeypatch.setenv("CUDA_INJECTION64_PATH", path)
    fake_cupti.SIM.other_subscriber = ""
    with pytest.raises(ProfilerBusyError, match=who):
        graphtree.profile().start()


def test_second_graphtree_profile_is_busy(fake_cupti):
    with graphtree.profile(), pytest.raises(ProfilerBusyError, match="already running"):
        graphtree.profile().start()


def test_other_cupti_errors_are_unavailable(fake_cupti, monkeypatch):
    def refuse(*a, **k):
        raise fake_cupti.cuptiError(fake_cupti.Result.ERROR_INSUFFICIENT_PRIVILEGES)

    monkeypatch.setattr(fake_cupti, "subscribe_v2", refuse)
    with pytest.raises(ProfilerUnavailableError, match="INSUFFICIENT_PRIVILEGES"):
        graphtree.profile().start()


def test_failure_after_subscribe_unsubscribes(fake_cupti, monkeypatch):
    def broken(kind):
        raise fake_cupti.cuptiError(fake_cupti.Result.ERROR_UNKNOWN)

    monkeypatch.setattr(fake_cupti, "activity_enable", broken)
    with pytest.raises(ProfilerUnavailableError):
        graphtree.profile().start()
    assert fake_cupti.SIM.subscriber is None and _session.active_session() is None


def test_subscribe_without_v2_falls_back(fake_cupti, monkeypatch):
    monkeypatch.delattr(fake_cupti, "subscribe_v2")
    with graphtree.profile() as prof:
        fake_cupti.SIM.launch_kernel("k")
    assert prof.summary()["kernel_launches"] == 1


# ------------------------------------------------------------------------------- lifecycle
def test_start_stop_start_accumulates_and_nothing_is_seen_in_between(fake_cupti):
    sim = fake_cupti.SIM
    prof = graphtree.profile()
    prof.start()
    exe = sim.capture(lambda: sim.launch_kernel("k"))
    sim.graph_launch(exe)
    prof.stop()
    sim.graph_launch(exe)  # not profiled
    sim.launch_kernel("eager")
    prof.start()
    sim.graph_launch(exe)
    prof.stop()
    s = prof.summary()
    assert s["sessions"] == 2 and s["graph_launches"] == 2 and s["kernels"] == 2 and s["kernel_launches"] == 0
    assert all(not st.captured_before_profiling for st in prof.kernel_stats())


def test_exception_inside_the_block_stops_the_profiler(fake_cupti):
    with pytest.raises(ValueError, match="user error"), graphtree.profile():
        raise ValueError("user error")
    assert _session.active_session() is None and fake_cupti.SIM.subscriber is None


def test_teardown_continues_when_a_step_fails(fake_cupti, monkeypatch):
    prof = graphtree.profile().start()

    def bad_flush(flag):
        raise fake_cupti.cuptiError(fake_cupti.Result.ERROR_UNKNOWN)

    monkeypatch.setattr(fake_cupti, "activity_flush_all", bad_flush)
    prof.stop()
    assert fake_cupti.SIM.subscriber is None and fake_cupti.SIM.enabled_kinds == set()
    assert any("flush" in n for n in prof.data.notes)


def test_errors_inside_callbacks_never_reach_cupti(fake_cupti, monkeypatch):
    prof = graphtree.profile().start()

    def boom(*a, **k):
        raise RuntimeError("bug")

    monkeypatch.setattr(prof.data, "api_enter", boom)
    fake_cupti.SIM.launch_kernel("k")  # must not raise
    prof.stop()
    assert prof.summary()["callback_errors"] >= 1


# ------------------------------------------------------------------------------- long runs
def test_buffers_are_recycled_dropped_records_reported(fake_cupti):
    sim = fake_cupti.SIM
    with graphtree.profile(buffer_size=4096, keep_records=False) as prof:
        exe = sim.capture(lambda: [sim.launch_kernel(f"k{i % 3}") for i in range(50)])
        for _ in range(40):
            sim.graph_launch(exe)
        sim.dropped += 7  # CUPTI reports 7 dropped records
    s = prof.summary()
    assert s["kernels"] == 2000 and s["records_kept"] == 0 and s["records_not_kept"] == 2000
    assert s["dropped_records"] == 7 and "dropped 7" in prof.table()
    assert s["buffers_completed"] >= 2000 // (4096 // 216)
    assert s["max_buffers_in_flight"] == 1
    assert sum(st.count for st in prof.kernel_stats()) == 2000
    assert {g.replays for g in prof.graph_stats()} == {40}


def test_record_cap_keeps_the_first_records_and_aggregates_the_rest(fake_cupti):
    sim = fake_cupti.SIM
    with graphtree.profile(max_records=100) as prof:
        for _i in range(250):
            sim.launch_kernel("k")
    s = prof.summary()
    assert s["records_kept"] == 100 and len(prof.records) == 100 and s["records_not_kept"] == 150
    assert prof.kernel_stats()[0].count == 250
    assert "not kept individually" in prof.table()


def test_vectorized_and_per_record_paths_agree(fake_cupti):
    sim = fake_cupti.SIM
    fast = mixed_workload(sim)
    assert fast.data.notes == []
    sim.reset()
    slow = mixed_workload(sim, vectorized=False)
    a, b = digest(fast), digest(slow)
    for x, y in zip(a[:4], b[:4]):
        assert x == y
    strip = lambda recs: [r._replace(stack_id=0, correlation_id=0) for r in recs]  # noqa: E731
    assert strip(a[4]) == strip(b[4])


def test_layout_mismatch_falls_back_to_per_record_path(fake_cupti):
    sim = fake_cupti.SIM
    sim.corrupt_layout = True
    prof = mixed_workload(sim)
    assert any("vectorized record parsing disabled" in n for n in prof.data.notes)
    s = prof.summary()
    assert s["kernels"] == 30 * 2 + 30 + 3 * 1 and s["record_errors"] == 0
    assert all(r.start != 12345 for r in prof.records)


def test_prepare_initialises_cupti_and_releases_it(fake_cupti):
    from graphtree.profile import prepare

    assert prepare() is True
    assert fake_cupti.SIM.subscriber is None and fake_cupti.SIM.enabled_kinds == set()
    fake_cupti.SIM.other_subscriber = "someone"
    assert prepare() is False


def test_fast_parser_refuses_records_that_are_not_one_buffer(fake_cupti):
    from graphtree.profile._model import ProfileOptions
    from graphtree.profile._parse import _FastParser, _LayoutMismatch

    parser = _FastParser.create(fake_cupti, ProfileOptions(buffer_size=4096))
    assert parser is not None
    got = []
    fake_cupti.SIM.buffer_requested = lambda: (4096, 0)
    fake_cupti.SIM.buffer_completed = got.append
    fake_cupti.SIM.enabled_kinds = {int(fake_cupti.ActivityKind.CONCURRENT_KERNEL)}
    for name in ("a", "b", "c"):
        fake_cupti.SIM.launch_kernel(name)
    fake_cupti.activity_flush_all(1)
    (records,) = got
    assert [sorted(b[1]) for b in parser.parse(records)] == [["a", "b", "c"]]
    with pytest.raises(_LayoutMismatch):
        parser.parse(list(reversed(records)))
