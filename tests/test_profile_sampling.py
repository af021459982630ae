"""Sampled mode of graphtree.profile (``Sampling``), CPU only, on the fake CUPTI."""

from __future__ import annotations

import pytest

import graphtree
from graphtree.profile import Sampling


def test_activity_is_on_only_inside_windows_and_nothing_outside_is_kept(fake_cupti, monkeypatch):
    sim = fake_cupti.SIM
    from graphtree.profile import _session

    syncs = []
    monkeypatch.setattr(_session, "_synchronize_cuda", lambda: syncs.append(len(syncs)))
    seen = []
    prof = graphtree.profile(sample=Sampling(window_steps=3, every_steps=10, on_window=seen.append))
    prof.start()
    assert not sim.enabled_kinds  # nothing traced before the first step
    sim.launch_kernel("before")
    traced = []
    for _ in range(35):
        prof.step()
        traced.append(bool(sim.enabled_kinds))
        sim.launch_kernel("inside" if traced[-1] else "outside")
    prof.stop()
    assert traced == [(i % 10) < 3 for i in range(35)]  # steps 0-2, 10-12, 20-22, 30-32
    counts = {st.name: st.count for st in prof.kernel_stats()}
    assert counts == {"inside": 12}  # records outside windows are never made
    assert not sim.enabled_kinds  # activity is off after stop()
    windows = prof.windows
    assert [w.index for w in windows] == [0, 1, 2, 3]  # the last one closed by stop()
    assert [sum(r.count for r in w.rows) for w in windows] == [3, 3, 3, 3]
    assert seen == windows
    assert all(w.edge_ms >= 0 and w.duration_ms >= 0 for w in windows)
    assert len(syncs) == 9  # the GPU is idle at each window edge (8), and stop() synchronizes
    assert "inside" in windows[0].table() and "window 0" in windows[0].table()


def test_graph_kernels_keep_their_captured_line_in_sampled_mode(fake_cupti):
    sim = fake_cupti.SIM
    prof = graphtree.profile(sample=Sampling(window_steps=2, every_steps=5))
    prof.start()
    exe = sim.capture(lambda: [sim.launch_kernel(f"k{i}") for i in range(3)])  # captured outside a window
    for _ in range(20):
        prof.step()
        sim.graph_launch(exe)
    prof.stop()
    rows = [st for st in prof.kernel_stats() if st.graph_key]
    assert sorted(st.name for st in rows) == ["k0", "k1", "k2"]
    assert all(st.count == 8 for st in rows)  # 4 windows of 2 replays
    for st in rows:
        assert not st.captured_before_profiling
        filename, _line, function = prof.stack(st.stack_id)[-1]  # the captured line, not the replay's
        assert filename == __file__ and function in ("<lambda>", "<listcomp>")
    assert all("[graph" in r.site for w in prof.windows for r in w.rows)


def test_a_callback_that_raises_is_noted_and_sampling_goes_on(fake_cupti):
    def bad(_report):
        raise RuntimeError("boom")

    prof = graphtree.profile(sample=Sampling(window_steps=1, every_steps=2, on_window=bad))
    with prof:
        for _ in range(6):
            prof.step()
            fake_cupti.SIM.launch_kernel("k")
    assert len(prof.windows) == 3
    assert any("on_window raised RuntimeError: boom" in n for n in prof.data.notes)


def test_a_step_after_the_sampler_stopped_opens_nothing(fake_cupti):
    prof = graphtree.profile(sample=Sampling(window_steps=1, every_steps=2))
    prof.start()
    sampler = prof._session.sampler
    prof.stop()
    sampler.step()  # a step that raced stop() in another thread
    assert not fake_cupti.SIM.enabled_kinds and not sampler.tracing


def test_step_without_sampling_does_nothing(fake_cupti):
    with graphtree.profile() as prof:
        prof.step()
        fake_cupti.SIM.launch_kernel("k")
        prof.step()
    assert prof.windows == [] and prof.summary()["kernels"] == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"window_steps": 0}, "window_steps"),
        ({"window_steps": 5, "every_steps": 5}, "every_steps"),
        ({"window_steps": 1.5}, "window_steps"),
        ({"keep_windows": 0}, "keep_windows"),
    ],
)
def test_bad_sampling_options_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_sample_must_be_a_sampling(fake_cupti):
    with pytest.raises(graphtree.profile.ProfilerUnavailableError, match="Sampling"):
        graphtree.profile(sample=0.01).start()
