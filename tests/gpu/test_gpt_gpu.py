"""GPU tests of :mod:`graphtree.demo.gpt`: one decode step captured in a plain ``torch.cuda.CUDAGraph``
replays to the same logits as eager execution (no graphtree involved)."""

from __future__ import annotations

import pytest
import torch

from graphtree.demo.gpt import GPTConfig, TinyGPT, greedy_decode

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 5
BATCH = 2


def _eager_run(model: TinyGPT, first: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Greedy decode eagerly; returns the input tokens and the logits of every step."""
    inputs, logits = [], []
    tokens = first
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    for _ in range(STEPS):
        inputs.append(tokens.clone())
        out = model.decode_step(tokens, pos)
        logits.append(out.clone())
        tokens = out.argmax(-1, keepdim=True)
        pos += 1
    return inputs, logits


def test_captured_decode_step_matches_eager() -> None:
    model = TinyGPT(GPTConfig(), batch=BATCH, device="cuda", seed=0)
    first = torch.tensor([[11], [4242]], dtype=torch.long, device="cuda")
    inputs, eager_logits = _eager_run(model, first)
    eager_k, eager_v = model.k_cache.clone(), model.v_cache.clone()

    static_tokens = first.clone()
    static_pos = torch.zeros((), dtype=torch.long, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model.decode_step(static_tokens, static_pos)
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = model.decode_step(static_tokens, static_pos)

    model.reset_cache()  # warm-up wrote position 0; start the replayed run from a clean cache
    for p in range(STEPS):
        static_tokens.copy_(inputs[p])
        static_pos.fill_(p)
        graph.replay()
        torch.testing.assert_close(static_logits, eager_logits[p], rtol=1e-4, atol=1e-4)
        assert torch.equal(static_logits.argmax(-1), eager_logits[p].argmax(-1)), f"step {p}"

    torch.testing.assert_close(model.k_cache, eager_k, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(model.v_cache, eager_v, rtol=1e-4, atol=1e-4)
    assert not model.k_cache[:, :, :, STEPS:].any()


def test_greedy_decode_on_cuda() -> None:
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=64, vocab=1000, max_seq=32)
    model = TinyGPT(cfg, batch=BATCH, device="cuda", seed=1)
    first = torch.zeros(BATCH, 1, dtype=torch.long, device="cuda")
    with torch.inference_mode():
        tokens, times = greedy_decode(model.decode_step, model, first, n_steps=8)
        model.reset_cache()
        again, _ = greedy_decode(model.decode_step, model, first, n_steps=8)
    assert tokens.device.type == "cuda" and tokens.shape == (BATCH, 8)
    assert torch.equal(tokens, again)
    assert len(times) == 8 and all(t > 0 for t in times)
