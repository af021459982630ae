"""Breakable recordings (issue 26): a host read of a scalar ends a segment of the recording and its
value keys what is replayed after it. Each test compares every call with eager."""

from __future__ import annotations

import warnings

import pytest
import torch
from _tiny_hf import tiny_model

import graphtree

DEV = "cuda"
ON = 8  # max_break_values: breaks are off by default for now (graphtree.graphed's docstring)


@pytest.fixture(autouse=True)
def _fresh():
    graphtree.reset()
    yield
    graphtree.reset()


def _branchy(x: torch.Tensor) -> torch.Tensor:
    y = x * 2
    if y.sum() > 0:  # a host read (a bool) that decides what runs next
        return (y + 1).relu()
    return (y - 1).abs() * 3


def test_a_value_read_on_the_host_picks_the_branch_on_every_call_and_both_replay():
    f = graphtree.graphed(_branchy, max_break_values=ON)
    x = torch.randn(4096, device=DEV)
    signs = [1, 1, 1, -1, -1, 1, -1, 1, -1, -1]
    for sign in signs:
        graphtree.mark_step()
        x.copy_(torch.rand(4096, device=DEV) * sign)
        torch.testing.assert_close(f(x), _branchy(x))
    s = graphtree.stats()
    assert not s.eager, s
    assert s.values == 1, s  # the second value got its own recording of what follows the read
    assert s.replays >= len(signs) - 3, s  # warm-up, first recording, the new value's recording
    text = graphtree.describe()
    assert "read True at" in text and "read False at" in text, text


def test_a_mixture_of_experts_with_data_dependent_routing_equals_eager():
    torch.manual_seed(0)
    experts = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4)).to(DEV)
    gate = torch.nn.Linear(64, 4).to(DEV)

    def moe(x: torch.Tensor) -> torch.Tensor:
        choice = gate(x).argmax(-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(experts):
            picked = choice == e
            if picked.any():  # run an expert only when a token chose it (a host read)
                out = out + picked.unsqueeze(-1) * expert(x)
        return out

    f = graphtree.graphed(moe, max_break_values=ON)
    with torch.inference_mode(), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for i in range(24):
            graphtree.mark_step()
            x = torch.randn(3, 64, device=DEV) * (1 + i % 3)
            torch.testing.assert_close(f(x), moe(x))
    s = graphtree.stats()
    assert not s.eager, s
    assert s.replays >= 8, s
    # the segment after the last read is empty when the last expert was not picked: no warning of it
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)]


def test_random_numbers_before_a_break_are_fresh_on_every_replay():
    def noisy(x: torch.Tensor) -> torch.Tensor:
        y = x + torch.rand_like(x)
        if (y > 0).all():
            return y * 2
        return y

    f = graphtree.graphed(noisy, max_break_values=ON)
    x = torch.ones(1024, device=DEV)
    outs = []
    for _ in range(5):
        graphtree.mark_step()
        outs.append(f(x).clone())
    assert graphtree.stats().replays >= 2
    assert all(((o >= 2) & (o < 4)).all() for o in outs)  # (1 + U[0, 1)) * 2: the branch taken
    assert not torch.equal(outs[-1], outs[-2]), "a replay repeated the recording's random numbers"


def test_a_value_with_too_many_distinct_results_runs_eagerly_with_the_reason(caplog):
    def logs_a_loss(x: torch.Tensor) -> torch.Tensor:
        loss = (x * x).mean()
        logs_a_loss.seen.append(round(loss.item(), 6))  # a float: new on every call
        return x - loss

    logs_a_loss.seen = []
    f = graphtree.graphed(logs_a_loss, max_break_values=3)
    for i in range(10):
        graphtree.mark_step()
        x = torch.full((256,), float(i + 1), device=DEV)
        torch.testing.assert_close(f(x), x - (i + 1) ** 2)
    s = graphtree.stats()
    assert any("different values at" in r and "max_break_values" in r for r in s.eager), s
    assert s.values >= 2, s


def test_max_break_values_zero_runs_a_host_read_eagerly_as_before():
    f = graphtree.graphed(_branchy, max_break_values=0)
    x = torch.rand(1024, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(f(x), _branchy(x))
    s = graphtree.stats()
    assert s.replays == 0 and any("synchronizes with the host" in r for r in s.eager), s


def test_outputs_of_a_broken_call_are_held_and_invalidated_like_any_other():
    f = graphtree.graphed(_branchy, max_break_values=ON)
    x = torch.rand(512, device=DEV)
    kept = []
    for _ in range(4):
        graphtree.mark_step()
        kept.append(f(x))
    torch.testing.assert_close(kept[-1], _branchy(x))
    # calls: warm-up (eager memory, kept[0] stays), recording, replay, replay: the recording's and the
    # first replay's outputs are the pool memory the last replay wrote again
    for old in kept[1:3]:
        with pytest.raises(RuntimeError, match="graphtree"):
            old.sum()
    y = f(x)  # held across calls of the same step (no mark_step): a new step starts by itself
    torch.testing.assert_close(y, _branchy(x))


def test_a_llama_called_without_a_cache_is_graphed_across_its_host_reads():
    pytest.importorskip("transformers")
    model = tiny_model("llama")
    step = graphtree.graphed(model, max_break_values=ON)
    with torch.inference_mode():
        for length in (8, 8, 8, 12, 12, 12, 8, 12):
            graphtree.mark_step()
            ids = torch.randint(1, 256, (2, length), device=DEV)
            want = model(ids, use_cache=False).logits
            got = step(ids, use_cache=False).logits
            torch.testing.assert_close(got, want)
    s = graphtree.stats()
    assert not s.eager, s
    assert s.replays >= 4, s


def test_a_marked_logging_part_sees_each_replays_fresh_values():
    seen = []

    @graphtree.eager
    def log(loss: torch.Tensor) -> None:
        seen.append(loss.item())  # a host read, on every replay

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = (x * x).mean()
        log(loss)
        return x - loss

    f = graphtree.graphed(step)  # breaks at reads are off: a marked part breaks the recording anyway
    for i in range(6):
        graphtree.mark_step()
        x = torch.full((256,), float(i + 1), device=DEV)
        torch.testing.assert_close(f(x), x - (i + 1) ** 2)
    assert seen == [float((i + 1) ** 2) for i in range(6)], seen
    s = graphtree.stats()
    assert not s.eager and s.replays >= 3, s
    assert "ran the graphtree.eager function" in graphtree.describe()


def test_a_marked_part_that_returns_a_tensor_hands_it_to_the_graph_after_it():
    @graphtree.eager
    def through_the_host(y: torch.Tensor) -> torch.Tensor:
        return (y.cpu() * 2).to(y.device)  # a copy to the host: cannot be captured

    def g(x: torch.Tensor) -> torch.Tensor:
        return through_the_host(x + 1) * 3

    f = graphtree.graphed(g)
    for _ in range(6):
        graphtree.mark_step()
        x = torch.randn(128, device=DEV)
        torch.testing.assert_close(f(x), (x + 1) * 6)
    s = graphtree.stats()
    assert not s.eager and s.replays >= 3, s


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generate_with_a_kept_cache_and_breaks_on_graphs_the_prefill_too_and_equals_eager(kind):
    transformers = pytest.importorskip("transformers")
    model = tiny_model(kind)
    ids = torch.randint(1, 256, (1, 6), device=DEV)
    cache = transformers.StaticCache(config=model.config, max_cache_len=32)
    kw = {"max_new_tokens": 12, "do_sample": False, "past_key_values": cache}
    with torch.inference_mode():
        want = model.generate(ids, **kw, disable_compile=True)
        model.forward = graphtree.graphed(model.forward, max_break_values=ON)
        for _ in range(4):
            cache.reset()
            got = model.generate(ids, **kw)
            assert torch.equal(got, want), (got, want)
    s = graphtree.stats()
    assert not s.eager, s  # the prefill's host reads are breaks: it is recorded and replayed too
    assert s.replays >= 2 * 12, s


@pytest.mark.parametrize("kind", ["llama", "gpt2", "mistral"])
def test_generate_with_hf_defaults_graphs_the_prefill_from_the_second_call_on_and_equals_eager(kind):
    """HF's default makes a new StaticCache in every generate(), which allocates itself in the prefill
    (its lazy initialisation): state made inside a call, which no recording can own. The first
    prefill is a warm-up that finds it (never recorded); from then on graphtree initializes each new cache before
    the call (tree/hf_cache.py, HF's early_initialization): the prefill is recorded once, then
    replayed, every new cache moving into the recording's memory."""
    pytest.importorskip("transformers")
    model = tiny_model(kind)
    ids = torch.randint(1, 256, (1, 6), device=DEV)
    with torch.inference_mode():
        static = {"max_new_tokens": 12, "do_sample": False, "cache_implementation": "static"}
        want = model.generate(ids, **static, disable_compile=True)
        model.forward = graphtree.graphed(model.forward)  # breaks on: the default
        for _ in range(3):  # the prefill: eager (lazy cache), warmed up, recorded
            got = model.generate(ids, **static)
            assert torch.equal(got, want), (got, want)
        before = graphtree.stats()
        for _ in range(3):
            got = model.generate(ids, **static)
            assert torch.equal(got, want), (got, want)
    s = graphtree.stats()
    assert not s.eager, s  # the first prefill (a lazy cache) ran as a warm-up, and no prefill after it is eager
    assert s.recordings == before.recordings, (before, s)
    assert s.replays - before.replays == 3 * 12, (before, s)  # every call of the last three generate()s
    # the prefill's and the decode step's recordings keep one memory: one copy of each new cache
    assert s.adopted - before.adopted == 3, (before, s)


def test_a_small_copy_to_the_host_is_a_read_too():
    def f(x: torch.Tensor) -> torch.Tensor:
        counts = (x > 0).sum(0).tolist()  # four ints copied to the host
        return x * counts[0] + counts[1]

    g = graphtree.graphed(f, max_break_values=ON)
    xs = [torch.randn(16, 4, device=DEV) for _ in range(2)]
    for i in range(8):
        graphtree.mark_step()
        torch.testing.assert_close(g(xs[i % 2]), f(xs[i % 2]))
    s = graphtree.stats()
    assert not s.eager and s.replays >= 4, s


def _run_both_ways(f, g, n=8):
    """Call graphed ``g`` and eager ``f`` on inputs whose sign alternates; every call equal."""
    xs = [torch.randn(64, device=DEV).abs() * s for s in (1, -1)]
    for i in range(n):
        graphtree.mark_step()
        x = xs[i % 2]
        torch.testing.assert_close(g(x), f(x))
    torch.cuda.synchronize()


def test_a_side_stream_forked_before_a_read_is_joined_at_the_break_and_forked_again():
    side = torch.cuda.Stream()

    def f(x):
        main = torch.cuda.current_stream()
        side.wait_stream(main)  # fork
        with torch.cuda.stream(side):
            y = x * 2  # queued on the side stream, not joined yet at the read
        positive = bool(x.sum() > 0)  # a read on the capture's stream while the side one is forked
        with torch.cuda.stream(side):
            y = y + 1  # more side work after the break: captured in the next segment
        main.wait_stream(side)  # the caller's own join
        return y * 3 if positive else y - 3

    g = graphtree.graphed(f)
    _run_both_ways(f, g)
    s = graphtree.stats()
    assert not s.eager and s.replays >= 4, s


def test_a_read_made_on_a_side_stream_breaks_on_the_captures_own_stream():
    side = torch.cuda.Stream()

    def f(x):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            y = x * 3
            positive = bool(y.mean() > 0)  # the read happens with the side stream current
            z = y + (1.0 if positive else -1.0)
        main.wait_stream(side)
        return z * 2

    g = graphtree.graphed(f)
    _run_both_ways(f, g)
    s = graphtree.stats()
    assert not s.eager and s.replays >= 4, s


class _Ema:
    def __init__(self) -> None:
        self.ema = torch.ones((), device=DEV)


def _ema_step(x: torch.Tensor, st: _Ema) -> torch.Tensor:
    st.ema.mul_(0.9).add_(x.mean() * 0.1)  # state written in place, before the read
    return x / st.ema.item()  # a float: a new value on every call


def test_past_the_value_limit_state_written_before_the_read_is_written_once_per_call():
    """The call that meets a value past the limit has replayed the segment before the read, which
    wrote the state: running the whole call eagerly then wrote it twice (every call after the limit,
    too). That call is finished by recording its value; the later ones run eagerly from the start."""
    g = graphtree.graphed(_ema_step, max_break_values=3)
    st, twin = _Ema(), _Ema()
    for i in range(10):
        graphtree.mark_step()
        x = torch.rand(16, device=DEV) + i
        torch.testing.assert_close(g(x, st), _ema_step(x, twin))
        torch.testing.assert_close(st.ema, twin.ema)  # written once per call, as eager does
    s = graphtree.stats()
    assert any("different values" in r for r in s.eager), s
