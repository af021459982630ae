"""Autograd over replayed graphs (graphtree.tree.training; issue 28's first part, not yet wired into
graphed): a small model with BatchNorm trained with gradient accumulation, graphed forward and
backward against the same model eagerly. Passed on the H100 in the one-process suites (sixteenth
session among them)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from graphtree.tree.training import TrainingRecording, apply

DEV = "cuda"


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1)).to(DEV).train()


def test_training_with_accumulation_matches_eager_loss_grads_and_batchnorm_statistics():
    eager = _model()
    graphed = copy.deepcopy(eager)
    params = list(graphed.parameters())
    gen = torch.Generator(DEV).manual_seed(1)
    batches = [torch.randn(16, 32, device=DEV, generator=gen) for _ in range(12)]
    rec = TrainingRecording.capture(graphed, (batches[0],), params, buffers=list(graphed.buffers()), name="mlp")
    # the warm-ups are not steps: BatchNorm's statistics are as before them
    assert int(graphed[1].num_batches_tracked) == 0
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_g = torch.optim.SGD(params, lr=0.1)
    for step in range(3):
        for micro in range(4):
            x = batches[4 * step + micro]
            le = eager(x).square().mean()
            le.backward()
            (lg,) = apply(rec, (x,))
            lg = lg.square().mean()
            lg.backward()
            torch.testing.assert_close(lg, le, rtol=1e-5, atol=1e-6)
        for pe, pg in zip(eager.parameters(), params):
            torch.testing.assert_close(pg.grad, pe.grad, rtol=1e-4, atol=1e-6)  # four micro-batches summed
        opt_e.step()
        opt_g.step()
        opt_e.zero_grad(set_to_none=True)
        opt_g.zero_grad(set_to_none=True)
    for be, bg in zip(eager.buffers(), graphed.buffers()):
        torch.testing.assert_close(bg, be, rtol=1e-5, atol=1e-6)  # 12 updates each, none from warm-ups
    assert rec.generation == 12
