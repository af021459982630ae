"""CPU tests of the OpInfo sweep's findings 1-5 (issue 44; graphtree runs eagerly on CPU: these drive
the parts directly)."""

import torch

from graphtree.tree.outputs import OutputPlan
from graphtree.tree.placement import state_watch
from graphtree.tree.refusals import unsafe_reason
from graphtree.tree.training import TrainingRecording, _structure


def _replayed(fn, *args):
    """fn's outputs as a recording hands them out: fn runs on copies (the placeholders, storage offset
    0), the outputs are rebuilt from the caller's tensors (the recording call, then a replay)."""
    ph = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype).copy_(a) for a in args]
    plan, leaves = OutputPlan.from_recording(fn(*ph), ph, lambda p: False, "fn", -1, 0)
    first = plan.finish(plan.adopt(leaves, list(args)), -1)
    again, _ = plan.emit(list(args), -1, torch.device("cpu"))
    return first, again


def test_a_size_output_stays_a_size():  # 1
    for out in _replayed(lambda: torch.broadcast_shapes((2, 1), (1, 3))):
        assert type(out) is torch.Size and out == (2, 3)


def test_a_training_recording_returns_the_structure_the_function_returned():  # 2
    a, b = torch.randn(3), torch.arange(3)
    for out in (torch.sort(torch.randn(3)), torch.frexp(torch.randn(3)), [a, b], (a, b), a):
        rec = TrainingRecording("f", [], [], [], [], [], None, None, isinstance(out, torch.Tensor), _structure(out))
        got = rec.returned((out,) if isinstance(out, torch.Tensor) else tuple(out))
        assert type(got) is type(out)


def test_a_host_read_of_a_cpu_scalar_input_is_a_reason_to_run_eagerly():  # 3
    x, i = torch.randn(6), torch.tensor(2)
    for fn, read in ((torch.tensor_split, True), (lambda x, i: x * i, False)):
        watch = state_watch([x, i], [1])
        with watch:
            fn(x, i)
        assert (watch.host_read == 1) is read
        assert ("0-dim CPU tensor input 1" in (unsafe_reason("f", watch) or "")) is read
        watch.close()


def test_views_of_another_dtype_or_with_lazy_bits_are_rebuilt_from_the_input():  # 4
    c, f = torch.randn(5, 5, dtype=torch.cfloat), torch.randn(5, 5, 2)
    for fn, x in (
        (torch.view_as_real, c),
        (lambda c: c.real, c),
        (lambda c: c.imag, c),
        (torch.view_as_complex, f),
        (torch.conj, c),
        (lambda c: c.conj().imag, c),
        (lambda x: x.view(torch.int32), f),
    ):
        want = fn(x)
        for got in _replayed(fn, x):
            assert got.dtype == want.dtype and (got.is_conj(), got.is_neg()) == (want.is_conj(), want.is_neg())
            assert got.data_ptr() == want.data_ptr() and torch.equal(
                got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()
            )


def test_views_of_a_partial_view_input_keep_its_offset_and_as_strided_with_an_offset_is_eager():  # 5
    x = torch.randn(20)[5:15]
    for fn in (lambda x: x, lambda x: x[1:], lambda x: torch.as_strided(x, (2, 2), (1, 2))):
        want = fn(x)
        for got in _replayed(fn, x):
            assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
    for fn, eager in (
        (lambda x: torch.as_strided(x, (2, 2), (1, 2)), False),
        (lambda x: torch.as_strided(x, (2, 2), (1, 2), 0), True),
        (lambda x: torch.as_strided(x, (2, 2), (1, 2), 10), True),
        (lambda x: x.as_strided((4,), (4,)), True),  # past x's last element
    ):
        watch = state_watch([x], [0])
        with watch:
            fn(x)
        assert bool(watch.strided) is eager and bool(unsafe_reason("f", watch)) is eager
        watch.close()
