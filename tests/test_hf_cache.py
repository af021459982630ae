"""graphtree.tree.hf_cache on the CPU: a fresh Hugging Face StaticCache of a kind met before is
initialized before the call exactly as its own lazy initialization would have done it."""

import sys

import pytest
import torch

from graphtree.tree.hf_cache import CacheLayouts

transformers = pytest.importorskip("transformers")


_SIZES = {  # a 2-layer Llama-shaped model (Mistral's adds a sliding window)
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg2 = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(cfg2).eval()
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SIZES)).eval()


def _layouts(cache) -> list:
    return [(lay.keys.shape, lay.values.shape, lay.keys.dtype, lay.keys.device) for lay in cache.layers]


def _watched(original, layouts: CacheLayouts, seen: list[tuple[bool, bool]]):
    """``original`` (a model's forward) with ``layouts.before_call`` first, noting for each call whether
    its cache's layers were initialized before it and after it."""

    def forward(**kwargs):
        before = all(lay.is_initialized for lay in kwargs["past_key_values"].layers)
        layouts.before_call(kwargs)
        seen.append((before, all(lay.is_initialized for lay in kwargs["past_key_values"].layers)))
        return original(**kwargs)

    return forward


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_fresh_cache_is_initialized_as_its_first_update_would_and_generates_the_same(kind):
    model = _model(kind)
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    layouts = CacheLayouts()
    seen: list[tuple[bool, bool]] = []
    forward = _watched(model.forward, layouts, seen)

    kw = {"max_new_tokens": 4, "do_sample": False, "cache_implementation": "static", "return_dict_in_generate": True}
    with torch.inference_mode():
        want = model.generate(ids, **kw)
        model.forward = forward
        first = model.generate(ids, **kw)  # the prefill initializes lazily; the decode steps teach the layout
        second = model.generate(ids, **kw)  # the prefill gets a cache initialized before the call
    assert seen[0] == (False, False)  # nothing learned yet: left to the cache
    assert seen[len(seen) // 2] == (False, True)  # the second prefill: initialized before the call
    assert torch.equal(first.sequences, want.sequences) and torch.equal(second.sequences, want.sequences)
    assert _layouts(second.past_key_values) == _layouts(want.past_key_values)
    for a, b in zip(second.past_key_values.layers, want.past_key_values.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_another_batch_length_or_model_dtype_is_left_alone(monkeypatch):
    model = _model("llama")
    # (the layouts learned from filled caches: what a model whose config cannot say does)
    monkeypatch.setattr(type(model), "_get_static_cache_init_shape", lambda self: None)
    cfg = model.config
    layouts = CacheLayouts(model)
    ids = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}

    def met_empty_then_filled() -> object:
        cache = transformers.StaticCache(config=cfg, max_cache_len=16)
        layouts.before_call({**ids, "past_key_values": cache})  # a prefill: left to the cache
        assert not any(lay.is_initialized for lay in cache.layers)
        cache.early_initialization(2, 2, 8, torch.float32, torch.device("cpu"))  # (what its prefill does)
        layouts.before_call({"input_ids": torch.zeros(2, 1, dtype=torch.long), "past_key_values": cache})
        return cache

    known = met_empty_then_filled()
    other_batch = transformers.StaticCache(config=cfg, max_cache_len=16)
    layouts.before_call({"input_ids": torch.zeros(3, 5, dtype=torch.long), "past_key_values": other_batch})
    assert not any(lay.is_initialized for lay in other_batch.layers)
    other_batch.early_initialization(3, 2, 8, torch.float32, torch.device("cpu"))  # (what its prefill does)
    layouts.before_call({"input_ids": torch.zeros(3, 1, dtype=torch.long), "past_key_values": other_batch})
    of_three = transformers.StaticCache(config=cfg, max_cache_len=16)  # that batch is learned now too
    layouts.before_call({"input_ids": torch.zeros(3, 5, dtype=torch.long), "past_key_values": of_three})
    assert all(lay.is_initialized for lay in of_three.layers) and _layouts(of_three) == _layouts(other_batch)

    other_length = transformers.StaticCache(config=cfg, max_cache_len=20)
    layouts.before_call({**ids, "past_key_values": other_length})
    assert not any(lay.is_initialized for lay in other_length.layers)

    fresh = transformers.StaticCache(config=cfg, max_cache_len=16)
    layouts.before_call({**ids, "past_key_values": fresh})
    assert all(lay.is_initialized for lay in fresh.layers) and _layouts(fresh) == _layouts(known)

    model.double()  # its keys would be float64 now: the learned float32 layout no longer vouches
    cast = transformers.StaticCache(config=cfg, max_cache_len=16)
    layouts.before_call({**ids, "past_key_values": cast})
    assert not any(lay.is_initialized for lay in cast.layers)

    layouts.before_call(dict(ids))  # no cache: nothing to do, nothing raised
    dynamic = transformers.DynamicCache(config=cfg)
    layouts.before_call({**ids, "past_key_values": dynamic})  # met empty: would learn from it
    dynamic.update(torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), 0)
    dynamic.update(torch.zeros(2, 2, 5, 8), torch.zeros(2, 2, 5, 8), 1)
    layouts.before_call({"input_ids": torch.zeros(2, 1, dtype=torch.long), "past_key_values": dynamic})
    fresh_dynamic = transformers.DynamicCache(config=cfg)
    layouts.before_call({**ids, "past_key_values": fresh_dynamic})  # a dynamic cache is never set up early
    assert not any(lay.is_initialized for lay in fresh_dynamic.layers)


def _mistral(window: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(transformers.MistralConfig(**_SIZES, sliding_window=window)).eval()


@pytest.mark.parametrize("window", [4096, 9])
def test_sliding_window_lengths_are_moved_for_calls_inside_the_window_and_generate_the_same(window):
    """Mistral's sliding-window layers count their length in a Python int, part of the call's key:
    inside the window every decode step gets the same key (the int at 0, the length read from the
    device), the int is right again after each call, and the tokens equal those of plain calls.
    Past the window's end (window 9: a 5-token prompt and 8 new tokens) the int is left as it is."""
    from graphtree.tree.object_state import HeldTensors, read_object

    model = _mistral(window)
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    layouts = CacheLayouts(model)
    original = model.forward
    lazy = []
    seen = []  # per call: (tokens, length before, int during, get_seq_length during, length after, key)

    def forward(**kwargs):
        cache = kwargs["past_key_values"]
        lay = cache.layers[0]
        before = lay.cumulative_length_int
        moved_lengths = layouts.before_call(kwargs)
        if not lay.is_initialized:  # allocated in the call (nothing learned yet): left as it is
            lazy.append(before)
        key = read_object(cache, HeldTensors())  # the cache's part of the call's key
        length = cache.get_seq_length()
        during = (lay.cumulative_length_int, (type(length), int(length)))  # (the device tensor moves on)
        try:
            return original(**kwargs)
        finally:
            if moved_lengths is not None:
                moved_lengths.restore()
            seen.append((kwargs["input_ids"].shape[1], before, *during, lay.cumulative_length_int, key))

    kw = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "cache_implementation": "static"}
    with torch.inference_mode():
        want = model.generate(ids, **kw)
        model.forward = forward
        got = model.generate(ids, **kw)  # each prefill gets a cache initialized before the call,
        again = model.generate(ids, **kw)  # from the config (the first) or as learned (the second)
    assert torch.equal(got, want) and torch.equal(again, want)
    first, *rest = seen
    assert lazy == [] and first[1:4] == (0, 0, (torch.Tensor, 0))  # (moved: 5 tokens fit in both windows)
    assert len([row for row in rest if row[0] == 1]) == 14
    for tokens, before, int_during, length_during, after, _ in rest:
        assert after == before + tokens  # the cache's own count, right after every call
        if before + tokens <= min(window, 13):  # inside the window: moved
            assert int_during == 0 and length_during == (torch.Tensor, before)
        else:  # past it: left alone, keyed by its length
            assert int_during == before and length_during == (int, before)
    decode = [row for row in rest if row[0] == 1]
    inside = [row[-1] for row in decode if row[1] + 1 <= min(window, 13)]
    assert len(inside) >= 8 and all(key == inside[0] for key in inside)  # one signature for those steps
    if window == 9:
        past = {row[-1] for row in decode if row[1] + 1 > 9}
        assert len(past) == 3  # lengths 9, 10 and 11, past the window: a key each


def test_code_dynamo_traces_inside_a_moved_call_reads_the_device_length_and_nested_calls_keep_it():
    """A model compiled inside the graphed call (``graphed(model)`` after ``model.compile()``) reads
    the length through code dynamo traces: it must get the device length too, or its mask and
    positions would say 0 (found in review: logits off by up to 0.28). A graphed call nested in a
    moved one leaves the layer as the outer call set it; HF's own compiled path, outside any
    moved call, traces get_seq_length as transformers wrote it."""
    from graphtree.tree import hf_cache

    cfg = _mistral(4096).config
    cache = transformers.StaticCache(config=cfg, max_cache_len=16)
    cache.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    layer = cache.layers[0]
    layer.cumulative_length_int = 3
    layer.cumulative_length.fill_(3)
    step = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    traced = torch.compile(lambda lay: lay.get_seq_length() + 0, backend="eager", fullgraph=True)
    assert traced(layer) == 3  # not moved: the int, as transformers wrote it
    moved_lengths = hf_cache._move_lengths(cache.layers, step)
    assert moved_lengths is not None and layer.cumulative_length_int == 0
    assert isinstance(traced(layer), torch.Tensor) and int(traced(layer)) == 3  # the device length
    assert hf_cache._move_lengths(cache.layers, step) is None  # nested: already moved, left alone
    assert isinstance(layer.get_seq_length(), torch.Tensor)
    moved_lengths.restore()
    assert layer.get_seq_length() == 3 and layer.cumulative_length_int == 3 and traced(layer) == 3
    assert not hasattr(layer, hf_cache.MOVED)


def test_a_dynamic_cache_gets_one_hint_naming_the_fix(caplog):
    """transformers' default cache grows every step: nothing to replay. The user is told once, with the
    argument that makes generate() graphable; a static cache gets no such line."""
    model = _model("llama")
    layouts = CacheLayouts(model)
    ids = {"input_ids": torch.zeros(1, 5, dtype=torch.long)}
    with caplog.at_level("WARNING", logger="graphtree"):
        static = {**ids, "past_key_values": transformers.StaticCache(config=model.config, max_cache_len=8)}
        assert layouts.eager_reason(static) is None
        assert not caplog.records
        for _ in range(3):  # the call runs eagerly outright: its signature is new every step
            reason = layouts.eager_reason({**ids, "past_key_values": transformers.DynamicCache(config=model.config)})
            assert reason is not None and "DynamicCache" in reason
    (record,) = caplog.records
    assert "LlamaForCausalLM" in record.getMessage() and 'cache_implementation="static"' in record.getMessage()


def test_another_transformers_version_keeps_the_length_in_the_key(monkeypatch):
    """The move rests on transformers 5.17's code, read use by use: another version is left as it is."""
    from graphtree.tree import hf_cache

    cache = transformers.StaticCache(config=_mistral(4096).config, max_cache_len=16)
    cache.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    step = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    installed = sys.modules["transformers"]  # (not always the module importorskip gave: it is lazy)
    monkeypatch.setattr(installed, "__version__", "5.18.0")
    assert hf_cache._move_lengths(cache.layers, step) is None
    monkeypatch.setattr(installed, "__version__", "5.17.2")
    moved = hf_cache._move_lengths(cache.layers, step)
    assert moved is not None
    moved.restore()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_cache_kept_across_generates_is_initialized_from_the_config_before_its_first_prefill(kind):
    # Issue 45, item 4: its first prefill had initialized it lazily (state made inside the call: a
    # warm-up of a signature no later prefill has), so the prefill recorded only at the third generate().
    model = _model(kind)
    ids = torch.randint(1, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    layouts = CacheLayouts(model)
    seen: list[tuple[bool, bool]] = []
    forward = _watched(model.forward, layouts, seen)

    lazy = transformers.StaticCache(config=model.config, max_cache_len=16)
    kept = transformers.StaticCache(config=model.config, max_cache_len=16)
    kw = {"max_new_tokens": 4, "do_sample": False, "return_dict_in_generate": True}
    with torch.inference_mode():
        want = model.generate(ids, past_key_values=lazy, **kw)
        model.forward = forward
        got = [model.generate(ids, past_key_values=kept, **kw)]
        kept.reset()
        got.append(model.generate(ids, past_key_values=kept, **kw))
    assert seen[0] == (False, True)  # the first prefill: initialized before the call
    assert all(s == (True, True) for s in seen[1:])
    assert all(torch.equal(g.sequences, want.sequences) for g in got)
    assert _layouts(kept) == _layouts(lazy)
    for a, b in zip(kept.layers, lazy.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_a_cache_is_left_to_its_lazy_initialization_under_autocast_or_mixed_dtypes(monkeypatch):
    model = _model("llama")
    layouts = CacheLayouts(model)
    ids = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    autocast_on = torch.is_autocast_enabled
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: True if a == ("cuda",) else autocast_on(*a))
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    layouts.before_call({**ids, "past_key_values": cache})  # (its keys' dtype is autocast's to say)
    assert not any(lay.is_initialized for lay in cache.layers)
    monkeypatch.undo()
    model.lm_head.half()  # two floating dtypes: which one the keys get is not the config's to say
    cache = transformers.StaticCache(config=model.config, max_cache_len=16)
    layouts.before_call({**ids, "past_key_values": cache})
    assert not any(lay.is_initialized for lay in cache.layers)
