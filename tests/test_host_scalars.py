"""Host scalars as device placeholders (graphtree/tree/host_scalars.py), on the CPU: where a
warm-up sees a Python number taken, the operator lists a warm-up and a capture compare, what stops a
capture, and how a call is keyed. The values themselves are checked against eager's CUDA kernels in
tests/gpu/test_host_scalars_gpu.py (the CPU's kernels have no CPU-scalar path to match)."""

import pytest
import torch

from graphtree.tree import writes
from graphtree.tree.host_scalars import HostScalars, ScalarEscapes
from graphtree.tree.inputs import read_call
from graphtree.tree.numbers import NUMBER, Numbers

X = torch.randn(5)


def _warm_up(f, value):
    """A warm-up's mode, after calling ``f`` with the plain number (as eager does)."""
    mode = HostScalars({}, "f", {1: value})
    with mode:
        f(value)
    return mode


def _warm_log(f, value):
    """What a warm-up notes: the operators eager calls, those taking the number as operand marked."""
    return _warm_up(f, value).log


def _capture(f, value, kind=NUMBER, dtype=torch.float64):
    """A capture's mode and output, the number given as a placeholder (here on the CPU)."""
    ph = torch.tensor(value, dtype=dtype)
    mode = HostScalars({ph.untyped_storage().data_ptr(): (1, kind)}, "f")
    with mode:
        out = f(ph)
    return mode, out


def _capture_log(f, value, kind=NUMBER, dtype=torch.float64):
    mode, out = _capture(f, value, kind, dtype)
    return mode.log, out


def _compared(f, value):
    """A warm-up, then a capture of ``f``, as the recorder runs them: the reason the number is
    keyed by value (None: a device scalar)."""
    numbers = Numbers()
    call = read_call((torch.tensor(1.0), value), {}, None)
    numbers.rekey(call)
    numbers.warmed(call, [1], _warm_up(f, value))
    if 1 in numbers.by_value:
        return numbers.by_value[1]
    try:
        mode, _ = _capture(f, value)
    except ScalarEscapes as e:
        return str(e)
    return (mode.escaped and str(mode.escaped)) or numbers.compare(call.key, mode.log, [1])


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
    warm = _warm_log(FORMS[form], 0.3)
    captured, out = _capture_log(FORMS[form], 0.3)
    assert warm == captured and any(name.endswith("@") for name in warm), (warm, captured)
    assert out.dtype == FORMS[form](0.3).dtype  # a number promotes as eager's wrapped scalar does
    assert _compared(FORMS[form], 0.3) is None


def test_an_int_tensor_times_a_number_has_the_default_dtype_not_the_placeholders():
    _, out = _capture_log(lambda t: torch.arange(5) * t, 0.5)
    assert out.dtype == torch.float32 and torch.equal(out, torch.arange(5) * 0.5)


@pytest.mark.parametrize(
    ("use", "why"),
    [
        (lambda t: X * 2 if t > 0 else X, "no operator"),  # Python control flow: eager's branch takes no number
        (lambda t: X * (2 if t > 1 else t), "aten::gt"),  # ...or takes it: the capture compares a tensor
        (lambda t: X * (1 - t), "no operator graphtree sees takes it"),  # Python arithmetic: another value
        (lambda t: X * float(f"{t}"), ""),  # (equal value at the warm-up; the capture formats a tensor)
        (lambda t: X if not t else X * t, "read on the host"),
        (lambda t: X * round(t), "no operator"),
        (lambda t: X * t * (1 - t), "aten::rsub"),  # both: an operand, and Python arithmetic at the capture
    ],
)
def test_a_number_used_in_python_is_keyed_by_value_with_the_reason(use, why):
    reason = _compared(use, 0.3)
    assert reason is not None and why in reason, reason


def test_an_isinstance_branch_makes_the_capture_call_other_operators():
    def f(t):
        return X * t if isinstance(t, float) else X @ X.new_ones(5, 5) * t

    reason = _compared(f, 0.3)
    assert reason is not None and "aten::new_ones where eager calls aten::mul@" in reason, reason


def test_a_branch_that_leaves_the_placeholder_unread_is_seen_by_the_operand_marks():
    # (a review's case: both branches call aten::mul, only eager's takes the number)
    reason = _compared(lambda t: X * (t if isinstance(t, float) else 1.0), 0.7)
    assert reason is not None and "aten::mul where eager calls aten::mul@" in reason, reason


def test_type_is_float_runs_eagers_branch_at_the_warm_up():
    # the warm-up passes the number itself: `type(t) is float` holds there as in eager
    seen = []
    _warm_up(lambda t: seen.append(type(t) is float) or X * t, 0.3)
    assert seen == [True]


def test_a_caught_escape_still_stops_the_capture():
    import math

    def f(t):
        try:
            r = math.sqrt(t)  # a host read of the placeholder: ScalarEscapes, caught by the user's code
        except Exception:  # noqa: BLE001 - what user code may do
            r = 1.0
        return X * r

    mode, _ = _capture(f, 0.25)
    assert mode.escaped is not None and "read on the host" in str(mode.escaped)


def test_returning_the_number_stops_the_capture():
    mode, out = _capture(lambda t: (X * t, t), 0.3)
    assert mode.in_outputs(out) is not None


def test_a_cpu_tensors_derived_scalar_stops_the_capture():
    # eager computes `1 - s` on the CPU, then reads it as a CPU scalar in float: not a device operand
    with pytest.raises(ScalarEscapes, match="on its own"):
        _capture(lambda s: X.half() * (1 - s), 0.3, "tensor", torch.float32)


def test_a_float_number_does_not_coincide_with_an_int_dim():
    # HF's default temperature is 1.0; dims are ints (aten::scatter's dim 1 here)
    def f(t):
        scores = X.view(1, 5) / t
        return scores.scatter(1, torch.zeros(1, 1, dtype=torch.long), 0.0)

    assert _compared(f, 1.0) is None


def test_the_warm_up_log_stays_for_a_second_capture_of_the_same_key():
    numbers = Numbers()
    call = read_call((torch.tensor(1.0), 0.3), {}, None)
    numbers.rekey(call)
    numbers.warmed(call, [1], _warm_up(FORMS["x * t"], 0.3))
    for _ in range(2):  # a re-recording, another place in a step, another thread
        mode, _ = _capture(FORMS["x * t"], 0.3)
        assert numbers.compare(call.key, mode.log, [1]) is None


def test_an_int_past_int64_is_keyed_by_value():
    numbers = Numbers()
    for a, b in ((2**63, 5), (2**63 + 1, 6)):  # (an int is a device scalar once it changed)
        call = read_call((torch.tensor(1.0), a, b), {}, None)
        numbers.rekey(call)
    assert call.key[1] == (int, 2**63 + 1) and call.key[2] == ((), torch.int64, NUMBER)


def test_an_int_is_keyed_by_value_until_it_comes_with_another():
    # PyTorch's test_dynamic_warmup: f(n, x) returns x * 2 and is called with n = 2; a device scalar
    # from the start, n was taken for the operand 2 by the warm-up, and the capture failed (Python
    # ran 4 times for 3 calls, H100). As torch.compile specialises ints until one changes:
    numbers = Numbers()
    keys = []
    for n in (2, 2, 3, 2):
        call = read_call((n, torch.tensor(1.0)), {}, None)
        numbers.rekey(call)
        keys.append(call.key[0])
    assert keys == [(int, 2), (int, 2), ((), torch.int64, NUMBER), ((), torch.int64, NUMBER)]
    assert Numbers.positions(call) == [0]
    fresh = Numbers()
    fresh.rekey(read_call((2, torch.tensor(1.0)), {}, None))
    assert fresh.describe() == ["argument 0: an int keyed by its value (2) until it comes with another"]


def test_a_failed_capture_puts_back_the_plain_values_it_wrote():
    class State:
        count = 0

    state = State()
    state.count = 3
    leaves = [torch.tensor(1.0), state]
    before = writes.values(leaves)
    state.count += 1  # what the capture's run of the function did
    writes.restore(leaves, before)
    assert state.count == 3


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
    numbers.rekey(read_call((x, 0.5, True, 2, "s"), {}, None))  # (the int changes next: a device scalar)
    call = read_call((x, 0.5, True, 3, "s"), {}, None)
    numbers.rekey(call)
    assert call.key[1] == ((), torch.float64, NUMBER) and call.key[3] == ((), torch.int64, NUMBER)
    assert call.key[2] == (bool, True) and call.key[4] == (str, "s")
    assert Numbers.positions(call) == [1, 3]
    numbers.keep_by_value([1], "aten::gt reads it")
    again = read_call((x, 0.7, True, 4, "s"), {}, None)
    numbers.rekey(again)
    assert again.key[1] == (float, 0.7) and again.key[3] == ((), torch.int64, NUMBER)
    # a warm-up that finds a number used in Python keys its own call by value (it counts for that signature)
    third = read_call((x, 0.7, True, 4, "s"), {}, None)
    numbers.rekey(third)
    numbers.warmed(third, [3], HostScalars({}, "f", {3: 4}))  # (a warm-up where no operator took it)
    assert third.key[3] == (int, 4) and 3 in numbers.by_value
    assert any("keyed by value (no operator" in line for line in numbers.describe())


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
    mode = _warm_up(f, value)
    call = read_call((torch.tensor(1.0), value), {}, None)
    numbers = Numbers()
    numbers.rekey(call)
    numbers.warmed(call, [1], mode)
    assert why in numbers.by_value.get(1, ""), numbers.by_value
    assert call.key[1] == (type(value), value)


def test_a_warm_up_keeps_a_number_used_only_as_an_operand_a_device_scalar():
    mode = _warm_up(lambda t: torch.softmax(X / t, -1) + (t - X) * (X < t), 0.7)  # noqa: SIM300
    call = read_call((torch.tensor(1.0), 0.7), {}, None)
    numbers = Numbers()
    numbers.rekey(call)
    numbers.warmed(call, [1], mode)
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
    from graphtree.tree.numbers import describe_numbers

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
