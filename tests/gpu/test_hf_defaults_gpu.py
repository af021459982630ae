"""Hugging Face ``generate()`` with its defaults on (issue 24): ``cache_implementation="static"`` and
nothing turned off, twice in a row with a fresh cache each time, for GPT-2, Llama and a left-padded
Mistral batch. Tokens must equal eager generation. Tiny random-weight models: nothing is downloaded."""

import warnings

import pytest
import torch
from _tiny_hf import tiny_model

import graphtree

pytest.importorskip("transformers")  # (tiny_model imports it)

DEV = "cuda"
NEW = 12


def _inputs(kind):
    g = torch.Generator().manual_seed(1)
    if kind != "mistral":
        return {"input_ids": torch.randint(1, 256, (1, 6), generator=g).to(DEV)}
    ids = torch.randint(1, 256, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 2, 4)):  # left-padded batch of three prompts
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return {"input_ids": ids.to(DEV), "attention_mask": mask.to(DEV)}


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_generate_with_hugging_faces_defaults_equals_eager(kind):
    model = tiny_model(kind)
    inputs = _inputs(kind)
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=NEW, cache_implementation="static", disable_compile=True)
    model.forward = graphtree.graphed(model.forward)
    with warnings.catch_warnings(record=True) as seen, torch.inference_mode():
        warnings.simplefilter("always")
        for _ in range(2):  # a fresh static cache each time, as generate() makes by default
            out = model.generate(**inputs, max_new_tokens=NEW, cache_implementation="static")
            assert torch.equal(out, expected), (out, expected)
    assert model.generation_config.disable_compile is True  # graphtree graphs the decode step: HF does not compile it
    ours = [str(w.message) for w in seen if "graphtree" in str(w.message) or "Dynamo" in str(w.message)]
    assert not ours, ours
    s = graphtree.stats()
    # Mistral's sliding-window layers keep their length in a Python int too, part of the key; inside
    # the window graphtree moves it for the call (tree/hf_cache.py): one decode recording, as the others
    assert s.recordings <= 3, s
    assert s.replays >= 2 * (NEW - 4), s  # every decode step after the first few replays


def test_generate_asked_to_compile_anyway_still_equals_eager():
    model = tiny_model("llama")
    inputs = _inputs("llama")
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=NEW, cache_implementation="static", disable_compile=True)
    model.forward = graphtree.graphed(model.forward)
    with torch.inference_mode():
        for _ in range(2):
            out = model.generate(**inputs, max_new_tokens=NEW, cache_implementation="static", disable_compile=False)
            assert torch.equal(out, expected)
    # and the process is still usable: eager random numbers and a fresh graphed function
    torch.randn(16, device=DEV)
    f = graphtree.graphed(lambda x: x * 2, name="after_compile")
    x = torch.randn(16, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        assert torch.equal(f(x), x * 2)


def test_generate_with_the_default_dynamic_cache_runs_eagerly_without_warm_ups():
    """No cache_implementation: a DynamicCache that grows every step, a new signature on every call.
    Warming each up cost 2.8x eager per generate() on an H100 (graphtree's own parts tried too), so
    such calls run eagerly outright, with the reason that names the fix."""
    model = tiny_model("llama")
    inputs = _inputs("llama")
    with torch.inference_mode():
        expected = model.generate(**inputs, max_new_tokens=NEW)
        model.forward = graphtree.graphed(model.forward)
        for _ in range(3):
            assert torch.equal(model.generate(**inputs, max_new_tokens=NEW), expected)
    s = graphtree.stats()
    assert s.warmups == 0 and s.recordings == 0, s
    assert any("DynamicCache" in r and 'cache_implementation="static"' in r for r in s.eager), s


def test_a_config_setting_changed_between_calls_is_never_replayed_stale():
    # `model.config.output_hidden_states = True` between forwards: the config (an object, not a
    # plain attribute) was not keyed, so the recording made without hidden states replayed without
    # them where eager returns them (found reading the code after the seventeenth session).
    # Compared within float32's tolerances: with SDPA, transformers builds an explicit causal mask
    # when it sees a CUDA stream capturing (`is_tracing`) and none eagerly, so a graph's logits
    # differ from eager's in the last bits (README, "Hugging Face"; eighteenth session, call 3).
    # Eager attention is no way out: its mask uploads a host scalar (`torch.tensor(0.0,
    # device=...)` in `eager_mask`), so the model runs in parts (nineteenth session, call 2).
    model = tiny_model("llama")
    g = graphtree.graphed(model)
    ids = _inputs("llama")["input_ids"]
    with torch.no_grad():
        for hidden in (False, False, False, True, True, True, False):
            model.config.output_hidden_states = hidden
            graphtree.mark_step()
            out, want = g(ids, use_cache=False), model(ids, use_cache=False)
            torch.testing.assert_close(out.logits, want.logits)
            assert (out.hidden_states is None) == (want.hidden_states is None) == (not hidden)
            for a, b in zip(out.hidden_states or (), want.hidden_states or ()):
                torch.testing.assert_close(a, b)
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= 3 and not s.eager, s
