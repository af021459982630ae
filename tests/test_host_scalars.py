"""Host scalars as device placeholders (graphtree/tree/host_scalars.py), on the CPU: what notes a
Python number's use, the operator lists a warm-up and a capture compare, what stops a capture, and
how a call is keyed. The values themselves are checked against eager's CUDA kernels in
tests/gpu/test_host_scalars_gpu.py (the CPU's kernels have no CPU-scalar path to match)."""

import pytest
import torch

from graphtree.tree.host_scalars import NUMBER, HostScalars, Numbers, ScalarEscapes, _watched
from graphtree.tree.inputs import read_call

X = torch.randn(5)


def _warm_up(f, value):
    """A warm-up's mode and watched number, after calling ``f`` with it."""
    w = _watched(value, 1)
    mode = HostScalars({}, "f", {1: value})
    with mode:
        f(w)
    return mode, w


def _warm_log(f, value):
    """What a warm-up notes: the operators eager calls with the (watched) number."""
    mode, w = _warm_up(f, value)
    return mode.log, w.used


def _capture_log(f, value, kind=NUMBER, dtype=torch.float64):
    """What a capture notes, the number given as a placeholder (here on the CPU)."""
    ph = torch.tensor(value, dtype=dtype)
    mode = HostScalars({ph.untyped_storage().data_ptr(): (1, kind)}, "f")
    with mode:
        out = f(ph)
    return mode.log, out


FORMS = {
    "x * t": lambda t: X * t,
    "t * x": lambda t: t * X,
    "x + t": lambda t: X + t,
    "t - x": lambda t: t - X,  # eager: rsub
    "x / t": lambda t: X / t,
    "t / x": lambda t: t / X,  # eager: x.reciprocal() * t
    "t < x": lambda t: t < X,  # eager: x > t
    "x >= t": lambda t: X >= t,  # noqa: SIM300 - the form under test
    "x.mul_(t)": lambda t: X.clone().mul_(t),
    "softmax(x / t)": lambda t: torch.softmax(X / t, -1),
    "arange * t": lambda t: torch.arange(5) * t,
}


@pytest.mark.parametrize("form", FORMS)
def test_a_warm_up_and_a_capture_note_the_same_operators_for_a_number_used_as_an_operand(form):
    warm, used = _warm_log(FORMS[form], 0.3)
    captured, out = _capture_log(FORMS[form], 0.3)
    assert used == "" and warm == captured, (warm, captured)
    assert out.dtype == FORMS[form](0.3).dtype  # a number promotes as eager's wrapped scalar does


def test_an_int_tensor_times_a_number_has_the_default_dtype_not_the_placeholders():
    _, out = _capture_log(lambda t: torch.arange(5) * t, 0.5)
    assert out.dtype == torch.float32 and torch.equal(out, torch.arange(5) * 0.5)


@pytest.mark.parametrize(
    ("use", "noted"),
    [
        (lambda t: X * 2 if t > 0 else X, "__gt__"),
        (lambda t: X * (1 - t), "__rsub__"),
        (lambda t: X * float(f"{t}"), "__format__"),
        (lambda t: X if not t else X * t, "__bool__"),
        (lambda t: X * round(t), "__round__"),
    ],
)
def test_a_number_used_in_python_is_noted_with_what_used_it(use, noted):
    _, used = _warm_log(use, 0.3)
    assert used.startswith(noted) and "argument 1" in used, used


def test_a_watched_number_is_still_a_float_and_an_int():
    w, n = _watched(0.3, 0), _watched(3, 1)
    assert isinstance(w, float) and isinstance(n, int) and w.used == n.used == ""
    assert torch.equal(X * w, X * 0.3) and torch.equal(X[:n], X[:3])  # (C reads the value: not noted)


def test_an_isinstance_branch_makes_the_capture_call_other_operators():
    def f(t):
        return X * t if isinstance(t, float) else X @ X.new_ones(5, 5) * t

    numbers = Numbers()
    mode, w = _warm_up(f, 0.3)
    call = read_call((torch.tensor(1.0), 0.3), {}, None)
    numbers.rekey(call)
    numbers.warmed(call, [None, w], [1], mode)
    captured, _ = _capture_log(f, 0.3)
    reason = numbers.compare(call.key, captured, [1])
    assert reason is not None and "aten::new_ones where eager calls aten::mul" in reason
    assert 1 in numbers.by_value and 1 not in numbers.device


@pytest.mark.parametrize(
    ("f", "op"),
    [
        (lambda t: X**t, "aten::pow"),
        (lambda t: torch.full((2,), t), "read on the host"),
        (lambda t: torch.where(X > 0, X, t), "aten::where"),
        (lambda t: X.clamp(max=t), "aten::clamp"),
        (lambda t: X[: int(t)], "read on the host"),
    ],
)
def test_a_number_reaching_another_operator_stops_the_capture_with_its_leaf(f, op):
    with pytest.raises(ScalarEscapes, match=op) as e:
        _capture_log(f, 2.0)
    assert e.value.positions == (1,)


def test_a_cpu_tensor_passes_through_operators_that_read_it_as_eager_does_and_stops_at_others():
    ph_kind = "tensor"
    _, out = _capture_log(lambda s: torch.maximum(X, s), 0.3, ph_kind, torch.float32)
    assert torch.equal(out, torch.maximum(X, torch.tensor(0.3)))
    half = X.half()
    with pytest.raises(ScalarEscapes, match="float16 tensor") as e:
        _capture_log(lambda s: torch.maximum(half, s), 0.3, ph_kind, torch.float32)
    assert e.value.positions == ()  # (a CPU tensor: the signature runs eagerly, there is no value to key)
    with pytest.raises(ScalarEscapes, match="picks by the scalar's value"):
        _capture_log(lambda s: torch.pow(X, s), 2.0, ph_kind, torch.float32)


def test_a_half_tensor_times_a_scalar_is_computed_in_float_and_rounded_once():
    half = (X * 3).half()
    _, out = _capture_log(lambda s: half * s, 0.3, "tensor", torch.float32)
    assert out.dtype == torch.float16
    assert torch.equal(out, (half.float() * torch.tensor(0.3)).half())


def test_in_place_into_an_int_tensor_stops_where_eager_refuses():
    with pytest.raises(ScalarEscapes):
        _capture_log(lambda t: torch.arange(5).mul_(t), 0.5)


def test_numbers_are_keyed_by_type_until_one_is_found_to_reach_python():
    x = torch.tensor(1.0)  # (a 0-dim CPU tensor: no GPU needed to read the call)
    numbers = Numbers()
    call = read_call((x, 0.5, True, 3, "s"), {}, None)
    numbers.rekey(call)
    assert call.key[1] == ((), torch.float64, NUMBER) and call.key[3] == ((), torch.int64, NUMBER)
    assert call.key[2] == (bool, True) and call.key[4] == (str, "s")
    assert Numbers.positions(call) == [1, 3]
    numbers.keep_by_value([1], "it reaches Python (__gt__ of argument 1)")
    again = read_call((x, 0.7, True, 4, "s"), {}, None)
    numbers.rekey(again)
    assert again.key[1] == (float, 0.7) and again.key[3] == ((), torch.int64, NUMBER)
    # a warm-up that finds a number used in Python keys its own call by value (it counts for that signature)
    third = read_call((x, 0.7, True, 4, "s"), {}, None)
    numbers.rekey(third)
    watched = Numbers().warm_up_leaves(third, [3])
    assert watched[3] + 1 == 5 and watched[3].used.startswith("__add__")
    numbers.warmed(third, watched, [3], HostScalars({}, "f", {3: 4}))
    assert third.key[3] == (int, 4) and 3 in numbers.by_value
    assert any("keyed by value (it reaches Python" in line for line in numbers.describe())


@pytest.mark.parametrize(
    ("f", "why"),
    [
        (lambda t: X.sum(dim=int(0 * X.new_ones(()).item()) + 0) * 0 + X.sum(t), "aten::sum takes it as argument 1"),
        (lambda t: X + 1, "no operator graphtree sees"),  # (unused)
        (lambda t: X.new_full((3,), t), "aten::new_full takes it"),
    ],
)
def test_a_warm_up_keys_by_value_a_number_an_operator_takes_otherwise(f, why):
    """The dispatcher reads ints and floats in C (a dim, a size, a fill value), unseen by the watched
    number; the warm-up's operators show where it went (by value), and a number no operator takes as
    an operand (unused, or inside compiled code, whose kernels graphtree does not see) stays by value."""
    value = 0 if "sum" in why else 0.25
    mode, w = _warm_up(f, value)
    assert w.used == ""
    call = read_call((torch.tensor(1.0), value), {}, None)
    numbers = Numbers()
    numbers.rekey(call)
    numbers.warmed(call, [None, w], [1], mode)
    assert why in numbers.by_value.get(1, ""), numbers.by_value
    assert call.key[1] == (type(value), value)


def test_a_warm_up_keeps_a_number_used_only_as_an_operand_a_device_scalar():
    mode, w = _warm_up(lambda t: torch.softmax(X / t, -1) + (t - X) * (X < t), 0.7)  # noqa: SIM300
    call = read_call((torch.tensor(1.0), 0.7), {}, None)
    numbers = Numbers()
    numbers.rekey(call)
    numbers.warmed(call, [None, w], [1], mode)
    assert numbers.by_value == {} and call.key[1] == ((), torch.float64, NUMBER)


def test_compiled_code_inside_a_warm_up_stays_compiled():
    """Under a dispatch mode that does not say ``ignore_compile_internals``, dynamo skips the frame
    for good; a warm-up with numbers (HostScalars logging) made a compiled Mistral decoder inside a
    graphed call run uncompiled, and generate other tokens (H100, session 14, call 6)."""
    from torch._dynamo.utils import counters

    @torch.compile(backend="eager")
    def f(x):
        return x * 2 + 1

    torch._dynamo.reset()
    counters.clear()
    with HostScalars({}, "f", {1: 0.5}):
        f(torch.randn(3))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.parametrize("value", [2.2, 16777217])  # (an int past 2**24: its float32 reciprocal differs)
def test_a_division_by_a_scalar_multiplies_by_its_reciprocal_taken_in_double(value):
    """As BinaryDivTrueKernel.cu does for a CPU-scalar divisor (high_prec_t), seen on the H100."""
    dtype = torch.float64 if isinstance(value, float) else torch.int64
    _, out = _capture_log(lambda t: X / t, value, NUMBER, dtype)
    inv = torch.reciprocal(torch.tensor(value, dtype=torch.float64)).float()
    assert torch.equal(out, X * inv)


def test_an_alpha_other_than_one_stops_the_capture_whatever_the_overload():
    out = torch.empty(5)
    with pytest.raises(ScalarEscapes, match="alpha"):
        _capture_log(lambda s: torch.add(X, s, alpha=0.5, out=out), 0.3, "tensor", torch.float32)
    with pytest.raises(ScalarEscapes, match="alpha"):
        _capture_log(lambda s: torch.add(X, s, alpha=0.5), 0.3, "tensor", torch.float32)


def test_describe_names_a_number_by_its_keyword_and_says_why_it_is_keyed_by_value():
    from graphtree.tree.host_scalars import describe_numbers

    numbers = Numbers(owner=-7)
    call = read_call((torch.tensor(1.0),), {"temperature": 0.5, "top_k": 50}, None)
    numbers.rekey(call)
    numbers.keep_by_value([2], "it reaches Python (__index__ of argument 2)")
    numbers.device.add(1)
    lines = describe_numbers(-7)
    assert lines == [
        "argument 1 (temperature=): a device scalar, filled on each call",
        "argument 2 (top_k=): keyed by value (it reaches Python (__index__ of argument 2))",
    ], lines
