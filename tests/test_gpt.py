"""CPU tests of the demo/benchmark model in :mod:`graphtree.demo.gpt`."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from graphtree.demo.gpt import GPTConfig, TinyGPT, greedy_decode

CFG = GPTConfig(n_layer=2, n_head=4, d_model=32, vocab=97, max_seq=16)


def _model(batch: int = 2, seed: int = 0, cfg: GPTConfig = CFG) -> TinyGPT:
    return TinyGPT(cfg, batch=batch, seed=seed)


def _tokens(batch: int, *values: int) -> torch.Tensor:
    vals = values or tuple(range(batch))
    return torch.tensor(vals, dtype=torch.long).view(batch, 1)


def _reference_logits(model: TinyGPT, seq: torch.Tensor) -> torch.Tensor:
    """Full causal forward over ``seq`` [B, T] without a cache: logits [B, T, vocab]."""
    cfg = model.cfg
    b, t = seq.shape
    h, hd = cfg.n_head, cfg.head_dim
    x = model.wte(seq) + model.wpe.weight[:t]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    for blk in model.blocks:
        q, k, v = blk.qkv(blk.ln1(x)).split(cfg.d_model, dim=-1)
        q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, cfg.d_model)
        x = x + blk.proj(y)
        x = x + blk.fc_out(F.gelu(blk.fc(blk.ln2(x))))
    return model.ln_f(x) @ model.wte.weight.T


def test_same_seed_same_weights_and_logits() -> None:
    a, b, c = _model(seed=0), _model(seed=0), _model(seed=1)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    pos = torch.tensor(0)
    la = a.decode_step(_tokens(2), pos)
    lb = b.decode_step(_tokens(2), pos)
    lc = c.decode_step(_tokens(2), pos)
    assert la.shape == (2, CFG.vocab)
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_init_statistics() -> None:
    m = TinyGPT(GPTConfig(n_layer=1, n_head=4, d_model=64, vocab=1000, max_seq=8), batch=1)
    assert abs(m.wte.weight.std().item() - 0.02) < 0.002
    assert torch.all(m.blocks[0].ln1.weight == 1) and torch.all(m.blocks[0].ln1.bias == 0)
    assert torch.all(m.blocks[0].qkv.bias == 0)


def test_cache_buffers() -> None:
    m = _model(batch=3)
    shape = (CFG.n_layer, 3, CFG.n_head, CFG.max_seq, CFG.d_model // CFG.n_head)
    buffers = dict(m.named_buffers())
    for name in ("k_cache", "v_cache"):
        assert buffers[name].shape == shape
        assert buffers[name].dtype == torch.float32
        assert not buffers[name].any()
    assert "k_cache" in m.state_dict() and "v_cache" in m.state_dict()


def test_dtype_argument() -> None:
    m = TinyGPT(CFG, batch=1, dtype=torch.float64)
    assert m.k_cache.dtype == torch.float64 and m.wte.weight.dtype == torch.float64
    assert m.decode_step(_tokens(1), torch.tensor(0)).dtype == torch.float64


def test_bad_config_rejected() -> None:
    with pytest.raises(ValueError, match="must be divisible by n_head"):
        TinyGPT(GPTConfig(n_layer=1, n_head=5, d_model=32, vocab=10, max_seq=4), batch=1)


def test_decode_step_writes_cache_in_place_only_at_pos() -> None:
    m = _model()
    k_ptr, v_ptr = m.k_cache.data_ptr(), m.v_cache.data_ptr()
    m.decode_step(_tokens(2, 5, 6), torch.tensor(0))
    m.decode_step(_tokens(2, 7, 8), torch.tensor(1))
    k_before, v_before = m.k_cache.clone(), m.v_cache.clone()

    m.decode_step(_tokens(2, 9, 10), torch.tensor(5))

    assert m.k_cache.data_ptr() == k_ptr and m.v_cache.data_ptr() == v_ptr
    for after, before in ((m.k_cache, k_before), (m.v_cache, v_before)):
        others = [p for p in range(CFG.max_seq) if p != 5]
        assert torch.equal(after[:, :, :, others], before[:, :, :, others])
        assert not torch.equal(after[:, :, :, 5], before[:, :, :, 5])
        assert after[:, :, :, 5].abs().sum(-1).gt(0).all()  # every layer, sequence and head written
    # positions 0 and 1 were written by the first two steps, 2..4 were never touched
    assert k_before[:, :, :, :2].abs().sum() > 0
    assert not k_before[:, :, :, 2:].any()


def test_mask_hides_positions_after_pos() -> None:
    m = _model()
    m.decode_step(_tokens(2, 1, 2), torch.tensor(0))
    m.decode_step(_tokens(2, 3, 4), torch.tensor(1))
    snapshot = (m.k_cache.clone(), m.v_cache.clone())
    clean = m.decode_step(_tokens(2, 5, 6), torch.tensor(2))

    m.k_cache.copy_(snapshot[0])
    m.v_cache.copy_(snapshot[1])
    g = torch.Generator().manual_seed(123)
    m.k_cache[:, :, :, 3:] = torch.randn(m.k_cache[:, :, :, 3:].shape, generator=g) * 10
    m.v_cache[:, :, :, 3:] = torch.randn(m.v_cache[:, :, :, 3:].shape, generator=g) * 10
    noisy = m.decode_step(_tokens(2, 5, 6), torch.tensor(2))
    assert torch.equal(clean, noisy)


def test_incremental_decode_matches_full_causal_forward() -> None:
    m = _model()
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(0, CFG.vocab, (2, 7), generator=g)
    with torch.no_grad():
        ref = _reference_logits(m, seq)
    for p in range(seq.shape[1]):
        logits = m.decode_step(seq[:, p : p + 1], torch.tensor(p))
        torch.testing.assert_close(logits, ref[:, p], rtol=1e-4, atol=1e-5)


def test_forward_is_decode_step() -> None:
    a, b = _model(), _model()
    pos = torch.tensor(0)
    assert torch.equal(a(_tokens(2), pos), b.decode_step(_tokens(2), pos))


def test_reset_cache_zeroes_in_place() -> None:
    m = _model()
    m.decode_step(_tokens(2), torch.tensor(3))
    assert m.k_cache.any() and m.v_cache.any()
    ptr = m.k_cache.data_ptr()
    m.reset_cache()
    assert not m.k_cache.any() and not m.v_cache.any()
    assert m.k_cache.data_ptr() == ptr


def test_greedy_decode_shapes_range_and_times() -> None:
    m = _model(batch=3)
    calls: list[int] = []
    tokens, times = greedy_decode(m.decode_step, m, _tokens(3), n_steps=6, before_step=lambda: calls.append(1))
    assert tokens.shape == (3, 6) and tokens.dtype == torch.long
    assert ((tokens >= 0) & (tokens < CFG.vocab)).all()
    assert len(times) == 6 and all(t > 0 for t in times)
    assert len(calls) == 6


def test_greedy_decode_is_argmax_of_step_and_advances_pos() -> None:
    m = _model()
    seen: list[int] = []

    def step(tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        seen.append(int(pos))
        return m.decode_step(tok, pos)

    tokens, _ = greedy_decode(step, m, _tokens(2), n_steps=5)
    assert seen == [0, 1, 2, 3, 4]

    m.reset_cache()
    tok = _tokens(2)
    expected = []
    for p in range(5):
        tok = m.decode_step(tok, torch.tensor(p)).argmax(-1, keepdim=True)
        expected.append(tok)
    assert torch.equal(tokens, torch.cat(expected, dim=1))


def test_greedy_decode_repeatable_after_reset() -> None:
    m = _model()
    a, _ = greedy_decode(m.decode_step, m, _tokens(2), n_steps=CFG.max_seq)
    m.reset_cache()
    b, _ = greedy_decode(m.decode_step, m, _tokens(2), n_steps=CFG.max_seq)
    assert torch.equal(a, b)


def test_greedy_decode_rejects_too_many_steps() -> None:
    m = _model()
    with pytest.raises(ValueError, match="n_steps must be in"):
        greedy_decode(m.decode_step, m, _tokens(2), n_steps=CFG.max_seq + 1)
    tokens, times = greedy_decode(m.decode_step, m, _tokens(2), n_steps=0)
    assert tokens.shape == (2, 0) and times == []


def test_inference_mode_on_cpu() -> None:
    m = _model()
    with torch.no_grad():
        ref, _ = greedy_decode(m.decode_step, m, _tokens(2), n_steps=8)
    m.reset_cache()
    with torch.inference_mode():
        out, _ = greedy_decode(m.decode_step, m, _tokens(2), n_steps=8)
        m.reset_cache()
    assert torch.equal(ref, out)
    assert not m.k_cache.any()


def test_decode_step_does_not_track_grad() -> None:
    m = _model()
    logits = m.decode_step(_tokens(2), torch.tensor(0))
    assert not logits.requires_grad
