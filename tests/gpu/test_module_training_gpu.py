"""A graphed module called with grad enabled (issue 28, item 1): its forward and backward graphed
(tree/module_training.py), the optimizer eager, against the same module run eagerly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphtree

DEV = "cuda"


def _pair():
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(32, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10)).to(DEV).train()
    mine = copy.deepcopy(eager)
    return eager, mine, graphtree.graphed(mine)


def _data(n, batch=16):
    gen = torch.Generator(DEV).manual_seed(1)
    return [
        (torch.randn(batch, 32, device=DEV, generator=gen), torch.randint(0, 10, (batch,), device=DEV, generator=gen))
        for _ in range(n)
    ]


def test_forward_and_backward_replay_with_micro_batches_accumulated_as_eager():
    eager, mine, g = _pair()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05, momentum=0.9)
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9)
    data = _data(16)
    for step in range(4):
        for x, y in data[4 * step : 4 * step + 4]:
            le = F.cross_entropy(eager(x), y) / 4
            lm = F.cross_entropy(g(x), y) / 4
            le.backward()
            lm.backward()
            torch.testing.assert_close(lm, le, rtol=1e-5, atol=1e-6)
        for pe, pm in zip(eager.parameters(), mine.parameters()):
            torch.testing.assert_close(pm.grad, pe.grad, rtol=1e-5, atol=1e-6)  # four summed
        opt_e.step()
        opt_m.step()
        opt_e.zero_grad(set_to_none=True)
        opt_m.zero_grad(set_to_none=True)
    for te, tm in zip(eager.state_dict().values(), mine.state_dict().values()):  # BatchNorm counted 16 updates
        torch.testing.assert_close(tm, te, rtol=1e-5, atol=1e-6)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 14 and s.warmups == 1 and not s.eager, s


def test_an_input_that_requires_grad_gets_its_gradient():
    eager, _, g = _pair()
    for x, y in _data(4):
        xe, xm = x.clone().requires_grad_(), x.clone().requires_grad_()
        F.cross_entropy(eager(xe), y).backward()
        F.cross_entropy(g(xm), y).backward()
        torch.testing.assert_close(xm.grad, xe.grad, rtol=1e-5, atol=1e-6)
    assert graphtree.stats().replays >= 2 and not graphtree.stats().eager, graphtree.stats()


def test_hooks_and_keyword_arguments_run_eagerly_with_the_reason():
    eager, mine, g = _pair()
    seen = []
    handle = mine[1].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    for x, _ in _data(3):
        torch.testing.assert_close(g(x), eager(x), rtol=1e-5, atol=1e-6)
    handle.remove()
    assert len(seen) == 3  # the hook ran on every call
    assert any("hooks" in r for r in graphtree.stats().eager), graphtree.stats()
    assert graphtree.stats().replays == 0


def test_a_module_returning_a_dict_is_given_up_with_the_reason():
    class Dict(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return {"y": self.lin(x)}

    m = Dict().to(DEV)
    g = graphtree.graphed(m)
    x = torch.randn(4, 8, device=DEV)
    for _ in range(4):
        out = g(x)
        assert out["y"].grad_fn is not None
        out["y"].sum().backward()
    assert any("could not be recorded for training" in r for r in graphtree.stats().eager), graphtree.stats()


def test_two_forwards_then_one_backward_through_both_is_right():
    """The graph holds one call's activations: the second call, made while the first one's backward
    may still come, runs eagerly (before, the first's backward raised)."""
    eager, mine, g = _pair()
    data = _data(8)
    for i in range(0, 8, 2):
        (x1, y1), (x2, y2) = data[i], data[i + 1]
        (F.cross_entropy(eager(x1), y1) + F.cross_entropy(eager(x2), y2)).backward()
        (F.cross_entropy(g(x1), y1) + F.cross_entropy(g(x2), y2)).backward()
        for pe, pm in zip(eager.parameters(), mine.parameters()):
            torch.testing.assert_close(pm.grad, pe.grad, rtol=1e-5, atol=1e-6)
    s = graphtree.stats()
    assert s.replays >= 3 and any("backward of its last call may still come" in r for r in s.eager), s


def test_under_autocast_with_a_grad_scaler_equal_to_eager():
    eager, mine, g = _pair()
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_m = torch.optim.SGD(mine.parameters(), lr=0.05)
    sc_e, sc_m = torch.amp.GradScaler("cuda"), torch.amp.GradScaler("cuda")
    for i, (x, y) in enumerate(_data(10)):
        for model, opt, sc in ((eager, opt_e, sc_e), (g, opt_m, sc_m)):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad(set_to_none=True)
        for pe, pm in zip(eager.parameters(), mine.parameters()):
            torch.testing.assert_close(pm, pe, rtol=1e-3, atol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 8 and not s.eager, s


def test_a_timm_resnet18_trained_through_its_graphed_module_equal_to_eager():
    """The user's loop unchanged, the model graphed: forward and backward replayed, AdamW eager."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    eager = timm.create_model("resnet18", num_classes=100).to(DEV).train()
    mine = copy.deepcopy(eager)
    g = graphtree.graphed(mine)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-3)
    opt_m = torch.optim.AdamW(mine.parameters(), lr=1e-3)
    gen = torch.Generator(DEV).manual_seed(2)
    for i in range(8):
        x = torch.randn(8, 3, 224, 224, device=DEV, generator=gen)
        y = torch.randint(0, 100, (8,), device=DEV, generator=gen)
        losses = []
        for model, opt in ((eager, opt_e), (g, opt_m)):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
    s = graphtree.stats()
    print(f"MODULE_TRAIN resnet18 batch 8: {s}")
    assert s.recordings == 1 and s.replays >= 6 and not s.eager, s


def test_a_function_given_tensors_that_require_grad_is_graphed_and_one_reading_a_global_is_not():
    w = torch.randn(32, 16, device=DEV)

    def affine(x, weight):
        return torch.tanh(x @ weight).sum(1)

    g = graphtree.graphed(affine)
    for _ in range(4):
        x = torch.randn(8, 32, device=DEV, requires_grad=True)
        we, wm = w.clone().requires_grad_(), w.clone().requires_grad_()
        xe = x.detach().clone().requires_grad_()
        affine(xe, we).square().sum().backward()
        g(x, wm).square().sum().backward()
        torch.testing.assert_close(wm.grad, we.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-5, atol=1e-5)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 2 and not s.eager, s

    bias = torch.zeros(16, device=DEV, requires_grad=True)  # read from the closure: not an argument
    h = graphtree.graphed(lambda x, weight: (x @ weight + bias).sum())
    for _ in range(3):
        h(torch.randn(8, 32, device=DEV), w.clone().requires_grad_()).backward()
    calls = getattr(h, "_autograd", None)
    seen = (graphtree.stats(), getattr(calls, "given_up", None), len(getattr(calls, "recordings", {}) or {}))
    assert bias.grad is not None and torch.equal(bias.grad, torch.full((16,), 24.0, device=DEV)), seen  # 3 x 8 rows
    assert any("besides its arguments" in r for r in graphtree.stats().eager), graphtree.stats()
