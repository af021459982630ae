"""Host scalars on a GPU (graphtree/tree/host_scalars.py): Python numbers and 0-dim CPU tensors read
from device placeholders compute what eager's CPU-scalar path computes, bit for bit, in every dtype
(issue 45, item 3; the 0-dim CPU tensor in float16 was a wrong result found while designing it); a
number used otherwise is keyed by value, with the reason; a serving loop's per-request temperature
replays."""

from __future__ import annotations

import pytest
import torch

import graphtree

DEV = "cuda"
VALUES = (0.1, 0.3, 1 / 3, 0.7, 2.2, 1e-3, 3.0, -1.5)

FORMS = {
    "x * t": lambda x, t: x * t,
    "t * x": lambda x, t: t * x,
    "x + t": lambda x, t: x + t,
    "t + x": lambda x, t: t + x,
    "x - t": lambda x, t: x - t,
    "t - x": lambda x, t: t - x,
    "x / t": lambda x, t: x / t,
    "t / x": lambda x, t: t / x,
    "x < t": lambda x, t: x < t,
    "t <= x": lambda x, t: t <= x,
    "x == t": lambda x, t: x == t,
    "x.mul_(t)": lambda x, t: x.clone().mul_(t),
    "x.div_(t)": lambda x, t: x.clone().div_(t),
    "x.sub_(t)": lambda x, t: x.clone().sub_(t),
    "x * t + t": lambda x, t: x * t + t,
}


def _x(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(8192, device=DEV) * 3
    return x.round().to(dtype) if not dtype.is_floating_point else x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64])
@pytest.mark.parametrize("kind", ["python float", "cpu float32", "cpu float64"])
@pytest.mark.parametrize("form", FORMS)
def test_a_host_scalar_operand_equals_eager_bitwise_and_replays(form, kind, dtype):
    f = FORMS[form]
    if dtype is torch.int64 and form.startswith("x."):
        pytest.skip("eager refuses a float result into an int tensor")
    g = graphtree.graphed(f, name=form)
    x = _x(dtype)
    for value in VALUES:
        graphtree.mark_step()
        t = value if kind == "python float" else torch.tensor(value, dtype=getattr(torch, kind.split()[1]))
        want, got = f(x, t), g(x, t)
        assert got.dtype == want.dtype and torch.equal(got, want), (form, kind, dtype, value)
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= len(VALUES) - 2 and not s.eager, s


@pytest.mark.parametrize("n", [2, 7])
def test_an_int_operand_is_a_device_scalar_too(n):
    f = lambda x, k: x * k + k  # noqa: E731
    g = graphtree.graphed(f)
    x = _x(torch.float16)
    for k in range(n, n + 6):  # (keyed by value at k = n: a device scalar once it changed)
        graphtree.mark_step()
        assert torch.equal(g(x, k), f(x, k)), k
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 3 and not s.eager, s


@pytest.mark.parametrize(
    "name",
    ["python branch", "isinstance branch", "pow", "shape", "full", "clamp"],
)
def test_a_number_used_otherwise_is_keyed_by_value_and_equals_eager(name):
    fns = {
        "python branch": lambda x, t: x * 2 if t > 1 else x * t,
        "isinstance branch": lambda x, t: x * t if isinstance(t, float) else x - 1,
        "pow": lambda x, t: x**t,
        "shape": lambda x, t: x[: int(t)] * 2,
        "full": lambda x, t: x + torch.full_like(x, t),
        "clamp": lambda x, t: x.clamp(max=t),
    }
    f = fns[name]
    g = graphtree.graphed(f, name=name)
    x = _x(torch.float32)
    for value in (2.0, 3.0) * 5:  # (the first two calls find the number is used otherwise)
        graphtree.mark_step()
        assert torch.equal(g(x, value), f(x, value)), (name, value)
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= 4, s  # keyed by value: each value replays its own recording
    text = graphtree.describe()
    assert "(device scalar)" not in text and ("2.0" in text or "3.0" in text), text
    assert f"{name}: argument 1: keyed by value (" in text, text  # and why


def test_a_serving_loops_new_temperature_per_request_replays_and_equals_eager():
    def sample(logits, temperature, mask):
        scaled = logits / temperature
        return torch.argmax(torch.softmax(scaled.masked_fill(~mask, float("-inf")), dim=-1), dim=-1), scaled

    torch.manual_seed(0)
    logits = torch.randn(8, 32000, device=DEV)
    mask = logits > logits.kthvalue(32000 - 50, dim=-1, keepdim=True).values
    g = graphtree.graphed(sample)
    with torch.inference_mode():
        for i in range(50):
            graphtree.mark_step()
            t = 0.5 + i / 100
            (a, sa), (b, sb) = g(logits, t, mask), sample(logits, t, mask)
            assert torch.equal(a, b) and torch.equal(sa, sb), t
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 45 and not s.eager, s
    assert "float (device scalar)" in graphtree.describe()


def test_a_learning_rate_as_a_cpu_tensor_in_a_half_precision_update_equals_eager():
    def update(p, g, lr):
        return p - lr * g

    torch.manual_seed(0)
    p, gr = torch.randn(4096, device=DEV).half(), torch.randn(4096, device=DEV).half()
    graphed = graphtree.graphed(update)
    for lr in (0.1, 0.03, 0.3, 0.01):
        graphtree.mark_step()
        t = torch.tensor(lr)
        assert torch.equal(graphed(p, gr, t), update(p, gr, t)), lr
    assert graphtree.stats().replays >= 2, graphtree.stats()
