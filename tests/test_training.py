"""Autograd over replayed graphs (graphtree.tree.training), on the CPU: the graphs are stand-ins
that compute a linear layer's forward and backward into fixed buffers, as a captured graph would;
what is tested is the glue: gradients where eager puts them, accumulation, outputs kept, and a
backward that belongs to an earlier forward refused."""

from __future__ import annotations

import pytest
import torch

from graphtree.tree.training import STALE_BACKWARD, TrainingRecording, apply


class _Graph:
    def __init__(self, body) -> None:  # type: ignore[no-untyped-def]
        self.body = body
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        self.body()


def _linear_recording(w: torch.Tensor, x_shape: tuple[int, int], x_grad: bool = False) -> TrainingRecording:
    """y = x @ w and z = y.argmax(1) (no grad), in fixed buffers, as a capture of them would be."""
    x = torch.zeros(x_shape, requires_grad=x_grad)
    y = torch.zeros(x_shape[0], w.shape[1])
    z = torch.zeros(x_shape[0], dtype=torch.long)
    gy = torch.zeros_like(y)
    gx, gw = torch.zeros_like(x), torch.zeros_like(w)

    def forward() -> None:
        with torch.no_grad():
            torch.matmul(x, w, out=y)
            z.copy_(y.argmax(1))

    def backward() -> None:
        with torch.no_grad():
            torch.matmul(gy, w.t(), out=gx)
            torch.matmul(x.t(), gy, out=gw)

    grads = [gx if x_grad else None, gw]
    return TrainingRecording("linear", [x], [w], [y, z], [gy, None], grads, _Graph(forward), _Graph(backward))


def test_gradients_accumulate_over_micro_batches_as_eager_and_start_again_after_zero_grad() -> None:
    torch.manual_seed(0)
    w_eager = torch.randn(8, 4, requires_grad=True)
    w = w_eager.detach().clone().requires_grad_(True)
    rec = _linear_recording(w, (5, 8), x_grad=True)
    for _step in range(2):
        for _micro in range(4):  # gradient accumulation: no zero_grad between micro-batches
            x = torch.randn(5, 8, requires_grad=True)
            xe = x.detach().clone().requires_grad_(True)
            y, z = apply(rec, (x,))
            (y.square().sum()).backward()
            (xe @ w_eager).square().sum().backward()
            torch.testing.assert_close(x.grad, xe.grad)
            assert not z.requires_grad and z.dtype == torch.long
        torch.testing.assert_close(w.grad, w_eager.grad)  # four micro-batches summed, not the last one doubled
        assert w.grad.data_ptr() != rec.static_grads[1].data_ptr()  # .grad is never the graph's buffer
        w.grad = None  # zero_grad(set_to_none=True)
        w_eager.grad = None
    assert rec.forward_graph.replays == 8 and rec.backward_graph.replays == 8


def test_outputs_kept_across_calls_keep_their_values() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    rec = _linear_recording(w, (5, 8))
    kept = []
    for _ in range(3):
        x = torch.randn(5, 8)
        y, _z = apply(rec, (x,))
        kept.append((y, (x @ w).detach()))
    for y, want in kept:
        torch.testing.assert_close(y.detach(), want)


def test_the_backward_of_an_earlier_forward_is_refused_not_computed_with_later_activations() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    rec = _linear_recording(w, (5, 8))
    y1, _ = apply(rec, (torch.randn(5, 8),))
    y2, _ = apply(rec, (torch.randn(5, 8),))
    with pytest.raises(RuntimeError, match="backward of an earlier call of `linear`"):
        (y1.sum() + y2.sum()).backward()
    assert "Call backward before the next forward" in STALE_BACKWARD


def test_retain_graph_replays_the_backward_again_and_a_double_backward_raises() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    rec = _linear_recording(w, (5, 8))
    x = torch.randn(5, 8)
    y, _ = apply(rec, (x,))
    loss = y.square().sum()
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * first)  # the same gradient twice, accumulated
    y, _ = apply(rec, (x,))
    (gw,) = torch.autograd.grad(y.square().sum(), w, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gw.sum().backward()


def test_a_call_the_graph_was_not_recorded_for_is_refused_naming_what_differs() -> None:
    w = torch.randn(8, 4, requires_grad=True)
    rec = _linear_recording(w, (5, 8))
    with pytest.raises(ValueError, match=r"input 0: recorded as \(5, 8\) torch.float32"):
        apply(rec, (torch.randn(1, 8),))  # copy_ would have broadcast it
    with pytest.raises(ValueError, match="requires_grad=True"):
        apply(rec, (torch.randn(5, 8, requires_grad=True),))
    with pytest.raises(ValueError, match="recorded with 1 tensor inputs, called with 2"):
        apply(rec, (torch.randn(5, 8), torch.randn(5, 8)))
    w.data = torch.randn(8, 4)  # replaced, not updated in place: the graph would read the old one
    with pytest.raises(RuntimeError, match="a parameter moved"):
        apply(rec, (torch.randn(5, 8),))


def test_module_calls_warm_up_record_replay_and_run_a_pending_call_eagerly(monkeypatch) -> None:
    """graphed(module) under autograd (tree/module_training.py): one eager warm-up, then replays;
    a call made while the last replay's backward may still come runs eagerly, with the reason."""
    from graphtree.tree import manager, module_training

    class Mat(torch.nn.Module):  # what the stand-in recording computes
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(8, 4))

        def forward(self, x):  # type: ignore[no-untyped-def]
            return x @ self.weight

    torch.manual_seed(0)
    lin = Mat()
    made = []

    def capture(fn, args, params, **options):  # type: ignore[no-untyped-def]
        made.append(_linear_recording(lin.weight, (5, 8)))
        return made[-1]

    monkeypatch.setattr(module_training.TrainingRecording, "capture", staticmethod(capture))
    monkeypatch.setattr(module_training.ModuleCalls, "reason", lambda self, a, k: None)  # (CPU tensors here)
    manager.reset()
    calls = module_training.ModuleCalls(lin, "lin", warmup=1)
    eager_reasons = []

    def eager(args, kwargs, reason):  # type: ignore[no-untyped-def]
        eager_reasons.append(reason)
        return lin(*args)

    x = torch.randn(5, 8)
    calls(lin, (x,), {}, "key", eager)  # the warm-up: the module itself
    (y, _z) = calls(lin, (x,), {}, "key", eager)  # recorded, replayed
    assert len(made) == 1 and not eager_reasons
    pending = calls(lin, (x,), {}, "key", eager)  # y is alive and its backward has not run
    assert eager_reasons == [module_training.PENDING.format(name="lin")] and pending.requires_grad
    y.sum().backward()
    loss = calls(lin, (x,), {}, "key", eager)[0].sum()  # the backward ran: replayed again
    calls(lin, (x,), {}, "key", eager)  # its output is gone, but the loss made of it can still backward
    assert len(eager_reasons) == 2
    loss.backward()
    calls(lin, (x,), {}, "key", eager)
    s = manager.stats()
    assert (s.warmups, s.recordings, s.replays) == (1, 1, 3), s
    manager.reset()
