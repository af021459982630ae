"""tree/fast_hit.py on the GPU: loops replay through a callable's fast hit, with eager's results, and
whatever changes the Python path's answer (grad, a hook, the module's mode, autocast, a value the
code reads, a held output) still changes it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from gt_fast_hit import count_fast_replays

import graphtree
from graphtree import _native

DEV = "cuda"
SCALE = 2.0


@pytest.fixture(params=["native", "helpers off"])
def fast_replays(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """1 for each call a fast hit replayed, 0 for each it left to the Python path: natively (the
    helpers are built first), or with the helpers off (``GRAPHTREE_NATIVE=0``: the fast hit's
    Python twin, and the Python path's own reads and checks)."""
    if _native.disabled():  # (a run with GRAPHTREE_NATIVE=0: the helpers are off already)
        if request.param == "native":
            pytest.skip("GRAPHTREE_NATIVE=0: no native fast hit in this run")
    else:
        native = _native.wait(600)
        assert native is not None and hasattr(native, "fast_call"), _native.status()
        if request.param == "helpers off":
            monkeypatch.setattr(_native, "loaded", None)
    seen = count_fast_replays(monkeypatch)
    graphtree.reset()
    yield seen
    graphtree.reset()


def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + 1


def test_a_loop_of_fresh_inputs_replays_through_the_fast_hit_with_eagers_results(fast_replays):
    step = graphtree.graphed(scaled)
    for _ in range(20):
        x = torch.randn(64, 64, device=DEV)
        torch.testing.assert_close(step(x), scaled(x), rtol=0, atol=0)
    s = graphtree.stats()
    assert s.replays >= 17, s
    assert sum(fast_replays) >= 15, fast_replays


def sample(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits / temperature, dim=-1)


def test_a_new_temperature_each_call_replays_through_the_fast_hit_with_eagers_results(fast_replays):
    # a serving loop: a Python float that changes every call (issue 45) is a device scalar, one
    # recording for every value, and each call's value reaches the replay
    step = graphtree.graphed(sample)
    logits = torch.randn(4, 1000, device=DEV)
    for k in range(40):
        temperature = 0.5 + k / 37
        torch.testing.assert_close(step(logits, temperature), sample(logits, temperature), rtol=0, atol=0)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 37, s
    assert sum(fast_replays) >= 35, fast_replays


def test_a_value_the_code_reads_changed_mid_loop_is_not_replayed_stale(fast_replays):
    global SCALE
    step = graphtree.graphed(scaled)
    x = torch.randn(64, 64, device=DEV)
    for _ in range(8):  # a warm-up, the recording, a replay by the Python path, then fast hits
        step(x)
    try:
        SCALE = 3.0
        torch.testing.assert_close(step(x), x * 3.0 + 1, rtol=0, atol=0)
    finally:
        SCALE = 2.0
    torch.testing.assert_close(step(x), scaled(x), rtol=0, atol=0)
    assert sum(fast_replays[:-2]) >= 3 and fast_replays[-2:] == [0, 0], fast_replays  # (both changes missed)


def test_a_module_in_a_loop_keeps_every_check_of_the_python_path(fast_replays):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Dropout(0.5)).to(DEV).eval()
    gm = graphtree.graphed(model)
    x = torch.randn(8, 32, device=DEV)
    calls: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)
        assert sum(fast_replays) >= 3, fast_replays
        handle = model[0].register_forward_hook(lambda m, i, o: calls.append(1))
        gm(x)
        assert calls == [1], "a hook registered mid-loop runs"
        handle.remove()
        model.train()  # dropout on: never the eval recording
        out = gm(x)
        assert (out == 0).any(), "train mode's dropout ran"
        model.eval()
        with torch.autocast("cuda", torch.bfloat16):
            assert gm(x).dtype == torch.bfloat16
        assert gm(x).dtype == torch.float32
        held = gm(x)
        gm(x)  # a new step: the held output of the last one is invalidated, as on the Python path
    with pytest.raises(RuntimeError):
        held + 1


def test_the_native_entry_replays_and_hands_calls_back_when_the_helpers_are_swapped(monkeypatch):
    """``fast_hit.entry`` on the GPU: once the helpers have loaded, graphed calls go through their C
    entry (``fast_entry``) with eager's results; with ``_native.loaded`` swapped for None mid-loop
    (the helpers off), the entry hands each call back to ``replay_again``, whose Python twin replays
    with the same results and counts."""
    from graphtree.tree import fast_hit

    if _native.disabled():  # (a run with GRAPHTREE_NATIVE=0: no entry is bound, nothing to hand back)
        pytest.skip("GRAPHTREE_NATIVE=0: the helpers are off in this run")
    assert _native.wait(600) is not None, _native.status()
    monkeypatch.setattr(fast_hit, "entry", fast_hit.replay_again)  # (made again from these helpers)
    graphtree.reset()
    step = graphtree.graphed(scaled)
    x = torch.randn(64, 64, device=DEV)
    for _ in range(6):
        torch.testing.assert_close(step(x), scaled(x), rtol=0, atol=0)
    assert type(fast_hit.entry).__name__ == "builtin_function_or_method", fast_hit.entry
    replays = graphtree.stats().replays
    monkeypatch.setattr(_native, "loaded", None)
    twins: list[int] = []
    real_twin = fast_hit.FastHit.replay

    def twin(hit, *args, **kwargs):
        twins.append(1)
        return real_twin(hit, *args, **kwargs)

    monkeypatch.setattr(fast_hit.FastHit, "replay", twin)
    for _ in range(4):
        y = torch.randn(64, 64, device=DEV)
        torch.testing.assert_close(step(y), scaled(y), rtol=0, atol=0)
    assert graphtree.stats().replays == replays + 4 and twins, (graphtree.stats(), twins)
    graphtree.reset()


def _launch_counted(step: object, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[int]]:
    """The recording ``step``'s fast hit replays, with its launcher (torch's replay, or graphtree's
    launch of a graph that draws) counting its calls."""
    (hit,) = [h for h in step.fast_hits.values() if hasattr(h, "node")]  # type: ignore[attr-defined]
    node = hit.node()
    calls: list[int] = []
    launch = node._launch

    def counted() -> object:
        calls.append(1)
        return launch()

    monkeypatch.setattr(node, "_launch", counted)
    return node, calls


def noisy(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE + torch.rand_like(x)


def test_a_graph_that_draws_nothing_is_launched_by_the_native_hit_and_one_that_draws_by_its_launcher(monkeypatch):
    """Issue 47: the native fast hit launches a recording that draws nothing itself
    (``cudaGraphLaunch`` of ``Node.exec``), not through torch's replay binding; one that draws goes
    through its launcher (``launch_drawing``: the generators' seeds and offsets), with eager's numbers."""
    if _native.disabled():
        pytest.skip("GRAPHTREE_NATIVE=0: no native fast hit in this run")
    assert _native.wait(600) is not None, _native.status()
    graphtree.reset()
    step = graphtree.graphed(scaled)
    x = torch.randn(64, 64, device=DEV)
    for _ in range(6):
        step(x)
    node, calls = _launch_counted(step, monkeypatch)
    assert node.exec != 0
    replays = node.replays
    for _ in range(10):
        y = torch.randn(64, 64, device=DEV)
        torch.testing.assert_close(step(y), scaled(y), rtol=0, atol=0)
    assert node.replays == replays + 10 and calls == [], (node.replays, calls)

    drawing = graphtree.graphed(noisy)
    for _ in range(6):
        drawing(x)
    node, calls = _launch_counted(drawing, monkeypatch)
    assert node.exec == 0
    for seed in range(5):
        torch.manual_seed(seed)
        got = drawing(x)
        torch.manual_seed(seed)
        torch.testing.assert_close(got, noisy(x), rtol=0, atol=0)
    assert len(calls) == 5, calls
    graphtree.reset()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_fast_hit_called_with_another_current_device_replays_through_torch_with_eagers_results(monkeypatch):
    """The native launch declines where the current device is not the recording's (torch's replay
    switches to it first): the launcher runs, and the results are eager's."""
    if _native.disabled():
        pytest.skip("GRAPHTREE_NATIVE=0: no native fast hit in this run")
    assert _native.wait(600) is not None, _native.status()
    graphtree.reset()
    step = graphtree.graphed(scaled)
    x = torch.randn(64, 64, device="cuda:0")
    for _ in range(6):
        step(x)
    _, calls = _launch_counted(step, monkeypatch)
    with torch.cuda.device(1):
        for _ in range(4):
            y = torch.randn(64, 64, device="cuda:0")
            torch.testing.assert_close(step(y), scaled(y), rtol=0, atol=0)
        assert torch.cuda.current_device() == 1
    assert len(calls) >= 3, calls
    graphtree.reset()


def test_outputs_kept_call_after_call_are_eagers_and_each_raises_once_the_next_call_ran(fast_replays):
    """``y = step(x)`` in a loop (issue 47, output kept): every call ends a step whose output the
    caller holds; the native fast hit invalidates it itself. Each output equals eager's while it is
    the newest, and reading it after the next call raises with the recording's message."""
    step = graphtree.graphed(scaled)
    xs = [torch.randn(64, 64, device=DEV) for _ in range(12)]
    y = None
    for i, x in enumerate(xs):
        previous = y
        y = step(x)
        torch.testing.assert_close(y, scaled(x), rtol=0, atol=0)
        if i >= 4:  # (replays from here: each call invalidated the output held before it)
            with pytest.raises(RuntimeError, match="graphtree"):
                previous + 1
    assert sum(fast_replays) >= 7, fast_replays
