"""What PyTorch's operator database found wrong through graphtree (issue 44; `benchmarks/conformance/
opinfo_sweep.py` on an H100, torch 2.11), each case as a user meets it: four calls (warm-up,
recording, two replays) on fresh tensors, each equal to eager (values, dtype, type), or run eagerly
with a reason. Each failed on the code before its fix."""

from __future__ import annotations

import pytest
import torch

import graphtree
from graphtree import _native
from graphtree.tree import readable

DEV = "cuda"


def _twin(a):
    """The same view of a copy of ``a``'s whole storage (as_strided with an offset reads it), a leaf like ``a``."""
    if not isinstance(a, torch.Tensor):
        return a
    storage = a.detach().untyped_storage().clone()
    copy = torch.empty(0, dtype=a.dtype, device=a.device).set_(storage, a.storage_offset(), a.shape, a.stride())
    return copy.requires_grad_(a.requires_grad)


def _calls(fn, make, check, n=4):
    """``fn`` graphed and eager on ``make(i)`` (fresh tensors each call), ``check(got, want)`` on each call."""
    g = graphtree.graphed(fn)
    for i in range(n):
        graphtree.mark_step()
        args = make(i)
        check(g(*args), fn(*[_twin(a) for a in args]))


def _same(got, want):
    assert type(got) is type(want), (type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.device == want.device and got.shape == want.shape
        assert got.is_conj() == want.is_conj() or torch.equal(got.resolve_conj(), want.resolve_conj())
        torch.testing.assert_close(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg())
    elif isinstance(want, (tuple, list)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _same(a, b)
    else:
        assert got == want


@pytest.mark.parametrize(
    "op",
    [torch.view_as_real, lambda c: c.real, lambda c: c.imag, torch.conj, lambda c: c.mH, lambda c: c.conj().imag],
    ids=["view_as_real", "real", "imag", "conj", "mH", "conj_imag"],
)
def test_views_of_a_complex_input_with_another_dtype_or_the_conj_bit(op):
    _calls(op, lambda i: (torch.randn(5, 5, dtype=torch.complex64, device=DEV),), _same)


def test_view_as_complex_of_an_input():
    _calls(torch.view_as_complex, lambda i: (torch.randn(5, 5, 2, device=DEV),), _same)


def test_broadcast_shapes_returns_a_size():
    _calls(lambda x: (torch.broadcast_shapes(x.shape, (1, 3)), x + 1), lambda i: (torch.ones(2, 1, device=DEV),), _same)


def test_tensor_split_by_a_cpu_index_tensor_runs_as_eager():
    make = lambda i: (torch.randn(8, device=DEV), torch.tensor(3 + i % 2))  # noqa: E731
    _calls(torch.tensor_split, make, _same)


@pytest.mark.parametrize("offset", [None, 3])
def test_as_strided_of_a_partial_view_input(offset):
    def fn(x):
        return torch.as_strided(x, (2, 2), (1, 2)) if offset is None else torch.as_strided(x, (2, 2), (1, 2), offset)

    base = lambda i: (torch.randn(20, device=DEV)[2:10],)  # noqa: E731 - a view at an offset
    _calls(fn, base, _same)


def test_an_output_that_is_a_slice_of_an_input_view():
    _calls(lambda x: x[1:], lambda i: (torch.randn(20, device=DEV)[4:12],), _same)


@pytest.mark.parametrize(
    "op", [torch.sort, torch.frexp, lambda x: torch.linalg.qr(x.reshape(3, 3))], ids=["sort", "frexp", "qr"]
)
def test_a_structseq_under_autograd_keeps_its_type(op):
    def check(got, want):
        assert type(got) is type(want)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b)

    _calls(op, lambda i: (torch.randn(9, device=DEV, requires_grad=True),), check)


@pytest.mark.parametrize("inside", [True, False], ids=["autocast_inside", "autocast_around"])
def test_pinv_under_autocast_computes_in_autocasts_dtype(inside):
    # (linalg_pinv waits for the GPU, so it runs eagerly with that reason: what failed was its
    # warm-up, in float32, where eager gives bfloat16 under autocast)
    def fn(x):
        with torch.autocast("cuda", torch.bfloat16, enabled=inside):
            return torch.linalg.pinv(x), torch.pinverse(x)

    with torch.autocast("cuda", torch.bfloat16, enabled=not inside):  # (around both calls of each pair)
        _calls(fn, lambda i: (torch.randn(6, 6, device=DEV),), _same)


def test_the_attention_kernels_random_state_outputs_run_eagerly_with_the_reason():
    q = torch.randn(2, 4, 16, 8, device=DEV, dtype=torch.float16)

    def fn(q):
        return torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), None, None, None, None, None, 0.0, 0, False
        )

    def check(got, want):
        torch.testing.assert_close(got[0], want[0])
        assert [t.device for t in got[2:4]] == [t.device for t in want[2:4]]

    _calls(fn, lambda i: (q.clone(),), check)
    assert any("_efficient_attention_forward" in r for r in graphtree.stats().eager), graphtree.stats()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_view_as_complex_under_autograd_gives_the_inputs_gradient_its_dtype(dtype):
    # The sweep's grad mode (issue 44, H100): a training recording of view_as_complex gave the float
    # input a complex gradient; an output that views an input now runs eagerly, with the reason.
    def make(i):
        torch.manual_seed(i)
        return (torch.randn(3, 4, 2, device=DEV, dtype=dtype).requires_grad_(),)

    def check(got, want):
        (x,) = got[1]
        (y,) = want[1]
        assert x.dtype == y.dtype == dtype, (x.dtype, y.dtype)
        torch.testing.assert_close(x, y)

    g = graphtree.graphed(torch.view_as_complex)
    for i in range(4):
        graphtree.mark_step()
        (a,) = make(i)
        (b,) = (a.detach().clone().requires_grad_(),)
        out_g, out_e = g(a), torch.view_as_complex(b)
        grads_g = torch.autograd.grad(out_g.real.sum() + out_g.imag.sum() * 2, [a])
        grads_e = torch.autograd.grad(out_e.real.sum() + out_e.imag.sum() * 2, [b])
        check((out_g, grads_g), (out_e, grads_e))
    assert any("returns a view of its input" in r for r in graphtree.stats().eager), graphtree.stats()


@pytest.mark.parametrize(
    "name",
    ["dot", "vdot", "mm", "one input: sin", "one input: neg view"],
)
def test_a_conjugate_view_input_replays_with_its_values_conjugated(name):
    # Found by the sweep (H100, 8c15d59): dot, vdot and mm of complex64 with one input a
    # torch.conj view: the native copy-in copied its memory, which holds the values unconjugated
    # (WRONG, "not close"); the single-input raw copy had the same flaw. Before that, the copy
    # resolved the view and the graph's cuBLAS call differed from eager's in the last bits (the
    # sweep's INEXACT dot). Now the view's bits are in the key and on the placeholder the graph
    # reads: eager's kernels, bit for bit.
    fns = {
        "dot": (torch.dot, lambda a, b: (a, b.conj())),
        "vdot": (torch.vdot, lambda a, b: (a, b.conj())),
        "mm": (torch.mm, lambda a, b: (a.view(4, 4), b.view(4, 4).conj())),
        "one input: sin": (torch.sin, lambda a, b: (a.conj(),)),
        "one input: neg view": (lambda t: t * 2, lambda a, b: (torch._neg_view(a.real),)),
    }
    fn, views = fns[name]
    g = graphtree.graphed(fn)
    for i in range(5):
        graphtree.mark_step()
        gen = torch.Generator(DEV).manual_seed(i)
        a, b = (torch.randn(16, dtype=torch.complex64, device=DEV, generator=gen) for _ in range(2))
        args = views(a, b)
        want = fn(*args)
        got = g(*args)
        assert torch.equal(got.resolve_conj().resolve_neg(), want.resolve_conj().resolve_neg()), (name, i)
    s = graphtree.stats()
    assert s.replays >= 2 and not s.eager, s
    native = _native.wait(600)
    if native is not None:  # the C++ key reader leaves a lazy view to the Python path, which keys its bits
        assert native.signature(tuple(args), readable.PLAIN_TYPES) is None
