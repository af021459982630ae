"""graphtree's native helpers (graphtree/_native): built here with the local C++ compiler, and
checked against their Python twins. Skipped only where no compiler or ninja exists."""

from __future__ import annotations

import array
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import graphtree
from graphtree import _native
from graphtree.tree import inputs, object_state, readable

needs_toolchain = pytest.mark.skipif(
    shutil.which("c++") is None or shutil.which("ninja") is None, reason="needs a C++ compiler and ninja"
)


@pytest.fixture(scope="module")
def native():
    if _native.disabled():  # (GRAPHTREE_NATIVE=0: the suite run on the Python twins alone)
        pytest.skip(_native.status() or "GRAPHTREE_NATIVE=0")
    module = _native.wait(600)
    assert module is not None, _native.status()
    return module


@needs_toolchain
def test_ptrs_equal_sees_every_way_a_tensor_changes_address(native) -> None:
    ts = [torch.randn(4) for _ in range(5)] + [torch.nn.Parameter(torch.zeros(2))]
    ptrs = [t.data_ptr() for t in ts]
    idx = list(range(len(ts)))
    assert native.ptrs_equal(ts, ptrs, idx) is True
    assert native.ptrs_equal(tuple(ts), tuple(ptrs), tuple(idx)) is True
    ts[-1].data = torch.zeros(2)  # what Module.to()/half() do to a parameter
    assert native.ptrs_equal(ts, ptrs, idx) is False
    assert native.ptrs_equal(ts, ptrs, idx[:-1]) is True  # only the indices asked for
    a, b = torch.zeros(3), torch.ones(3)
    held, want = [a], [a.data_ptr()]
    torch.utils.swap_tensors(a, b)  # same Python object, another tensor underneath
    assert native.ptrs_equal(held, want, [0]) is False
    ts[0].set_(torch.zeros(8))
    assert native.ptrs_equal(ts, ptrs, [0]) is False


@needs_toolchain
def test_addresses_unchanged_compares_packed_addresses(native) -> None:
    from graphtree.tree.node import statics_packed

    ts = [torch.nn.Parameter(torch.randn(3)) for _ in range(100)]
    packed = statics_packed(ts)  # (each tensor's TensorImpl and address)
    assert native.addresses_unchanged(ts, packed) is True
    assert native.addresses_unchanged(ts[:-1], packed) is False  # a count that differs never matches
    ts[57].data = torch.randn(3)  # (the same TensorImpl, another storage)
    assert native.addresses_unchanged(ts, packed) is False
    with pytest.raises(TypeError):
        native.addresses_unchanged(tuple(ts), packed)
    with pytest.raises(TypeError, match="list of tensors"):
        native.addresses_unchanged([1], packed[:16])


@needs_toolchain
def test_addresses_unchanged_answers_as_data_ptr_whatever_moved_underneath(native) -> None:
    """A tensor read through the TensorImpl packed with it, or, where it holds another, through its
    Python object: either way the answer is ``data_ptr()``'s."""
    from graphtree.tree.node import statics_packed

    ts = [torch.nn.Parameter(torch.randn(4)) for _ in range(6)]
    packed = statics_packed(ts)
    want = [t.data_ptr() for t in ts]

    def answers_as_data_ptr() -> bool:
        answer = native.addresses_unchanged(ts, packed)
        assert answer is all(t.data_ptr() == w for t, w in zip(ts, want)), answer
        return answer

    assert answers_as_data_ptr()
    keep = ts[1].data
    other = torch.nn.Parameter(keep.view(4))  # (the same memory, another TensorImpl)
    torch.utils.swap_tensors(ts[1], other)  # the same Python object, another TensorImpl underneath
    assert answers_as_data_ptr()  # (its memory did not move)
    torch.utils.swap_tensors(ts[1], other)
    ts[2].untyped_storage().resize_(64)  # the same TensorImpl and StorageImpl, other memory
    assert not answers_as_data_ptr()
    ts[2].untyped_storage().resize_(16)
    packed = statics_packed(ts)
    want = [t.data_ptr() for t in ts]
    assert answers_as_data_ptr()
    with torch.no_grad():
        ts[3].set_(ts[3].untyped_storage(), 1, (3,), (1,))  # the same memory, read from an offset
    assert not answers_as_data_ptr()
    ts[3].data = ts[3].data  # (back where it was packed)
    packed = statics_packed(ts)
    want = [t.data_ptr() for t in ts]
    assert answers_as_data_ptr()
    ts[4].data = torch.randn(4).view(torch.float16)[2:6]  # an offset counted in another dtype's items
    want[4] = ts[4].data_ptr()
    packed = statics_packed(ts)
    assert answers_as_data_ptr()
    ts[4].data = ts[4].data.view(torch.float32)  # (the same memory: its offset in bytes unchanged)
    assert answers_as_data_ptr()
    ts[4].data = ts[4].data[:0]  # empty: data_ptr() is 0 wherever its storage is
    assert ts[4].data_ptr() == 0 and not answers_as_data_ptr()
    packed = statics_packed(ts)
    want = [t.data_ptr() for t in ts]
    assert answers_as_data_ptr()  # (an empty tensor packed: 0 matches 0)
    torch._C._set_throw_on_mutable_data_ptr(ts[5])  # data_ptr() raises now (as on memory graphtree freed)
    with pytest.raises(RuntimeError) as raised:
        ts[5].data_ptr()
    with pytest.raises(RuntimeError, match=re.escape(str(raised.value))):
        native.addresses_unchanged(ts, packed)


@needs_toolchain
def test_weak_unchanged_answers_as_its_python_twin(native) -> None:
    """The check of a recording's outside tensors (globals, an optimizer's state) on every replay."""
    from graphtree import _torch

    kept, dropped = torch.zeros(4), torch.zeros(8)
    refs = [_torch.weak_ref(t.untyped_storage()) for t in (kept, dropped)]
    at = [t.untyped_storage().data_ptr() for t in (kept, dropped)]
    try:

        def both(ptrs: list[int]) -> tuple[bool, bool]:
            packed = (array.array("Q", refs).tobytes(), array.array("Q", ptrs).tobytes())
            return native.weak_unchanged(*packed), all(_torch.weak_data_ptr(r) == p for r, p in zip(refs, ptrs))

        assert both(at) == (True, True)
        assert both([at[0], at[1] + 4]) == (False, False)  # moved
        del dropped
        assert both(at) == (False, False)  # freed
        with pytest.raises(TypeError):
            native.weak_unchanged(b"12345678", b"")
    finally:
        for r in refs:
            _torch.weak_free(r)


def test_ptrs_equal_refuses_bad_input_with_python_errors(native) -> None:
    t = torch.zeros(1)
    with pytest.raises(TypeError, match="expected a tensor"):
        native.ptrs_equal([1], [0], [0])
    with pytest.raises(IndexError):
        native.ptrs_equal([t], [t.data_ptr()], [3])
    with pytest.raises(TypeError, match="3 arguments"):
        native.ptrs_equal([t], [t.data_ptr()])
    with pytest.raises(TypeError):
        native.ptrs_equal(t, [0], [0])


@needs_toolchain
def test_signature_matches_read_call_for_plain_values_and_defers_the_rest(native, monkeypatch) -> None:
    args = (3, 2.5, True, "s", None, torch.float16, torch.device("cpu"))
    got = native.signature(args, readable.PLAIN_TYPES)
    monkeypatch.setattr(_native, "loaded", None)
    want = inputs.read_call(args, {}, None)
    assert got == (want.key, want.device, want.needs_grad)

    class Sub(torch.Tensor):
        pass

    # Anything the Python path must see (it names the reason, or reads the object): None.
    assert native.signature((torch.zeros(2),), readable.PLAIN_TYPES) is None  # CPU tensor
    assert native.signature((torch.zeros(2).as_subclass(Sub),), readable.PLAIN_TYPES) is None
    assert native.signature((object(),), readable.PLAIN_TYPES) is None
    assert native.signature((1, [2]), readable.PLAIN_TYPES) is None
    with pytest.raises(TypeError):
        native.signature([1], readable.PLAIN_TYPES)


@needs_toolchain
def test_read_call_gives_the_same_answers_with_and_without_the_helpers(native, monkeypatch) -> None:
    calls = [((1, None, "a"), {}), ((torch.ones(2),), {}), ((object(),), {}), ((1,), {"k": 2}), ((1,), {"j": 2})]

    def answers() -> list:
        out = []
        for args, kwargs in calls:
            try:
                c = inputs.read_call(args, kwargs, None)
                out.append((c.key, c.device))
            except readable.Unsupported as e:
                out.append(str(e))
        return out

    with_native = answers()
    monkeypatch.setattr(_native, "loaded", None)
    without = answers()
    assert with_native == without
    assert with_native[1].startswith("CPU tensor inputs")


def test_graphtree_native_0_turns_the_helpers_off() -> None:
    code = "from graphtree import _native; print(_native.wait(5) is None, _native.status())"
    env = {**os.environ, "GRAPHTREE_NATIVE": "0"}
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True off (GRAPHTREE_NATIVE=0)")


@needs_toolchain
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build loads the CUDA runtime")
def test_copy_d2d_declines_without_a_cuda_runtime(native) -> None:
    assert native.copy_d2d(0, 0, 0, 0) is False  # nothing done: the caller copies another way
    with pytest.raises(TypeError, match="4 arguments"):
        native.copy_d2d(0, 0)


@needs_toolchain
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build loads the CUDA runtime")
def test_copy_in_declines_without_a_cuda_runtime_and_the_plan_falls_back_to_python(native) -> None:
    from graphtree.tree.placement import InputPlan

    a, b = torch.randn(5), torch.randn(5)
    dst = [torch.zeros(5), torch.zeros((), dtype=torch.float64), torch.zeros(5)]
    assert native.copy_in(0, [a, 0.25, b], (0, dst[0].data_ptr(), 20), (1, dst[1].data_ptr())) is False
    with pytest.raises(TypeError):
        native.copy_in(0, [a], (0, 1), ())  # (copies come in threes)
    plan = InputPlan(
        inplace_idx=[], inplace_ptrs=[0, 0, 0], copy_idx=[0, 1, 2], placeholders=dst,
        padded=(), pad_dim=0, bucket=0, device=0, host=(1,), numbers=(1,),
    )  # fmt: skip
    assert plan._native is not None and plan._native[2] == (1, dst[1].data_ptr())
    plan.copy_in([a, 0.25, b], 0)
    assert torch.equal(dst[0], a) and dst[1].item() == 0.25 and torch.equal(dst[2], b)


@needs_toolchain
@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build loads the CUDA runtime")
def test_graph_launch_declines_without_a_cuda_runtime(native) -> None:
    assert native.graph_launch(1234, 0, 0) is False  # nothing launched: the caller replays through torch
    with pytest.raises(TypeError, match="3 arguments"):
        native.graph_launch(0, 0)


@needs_toolchain
def test_detach_is_tensor_detach_and_leaves_modes_and_subclasses_to_python(native) -> None:
    from torch.overrides import TorchFunctionMode

    base = torch.randn(4, requires_grad=True) * 2
    out = native.detach(base)
    assert type(out) is torch.Tensor and out is not base and not out.requires_grad
    assert out.data_ptr() == base.data_ptr() and out.shape == base.shape and torch.equal(out, base)
    assert out._version == base._version  # (a detached view shares the version counter)

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        native.detach(base)
    assert mode.calls == ["detach"]  # (as Python's base.detach() would tell the mode)

    class Sub(torch.Tensor):
        pass

    sub = base.detach().as_subclass(Sub)
    assert type(native.detach(sub)) is Sub  # (its __torch_function__ kept the subclass: Python's method ran)
    with pytest.raises(TypeError, match="1 argument"):
        native.detach()


def test_a_conjugate_view_is_copied_resolved_never_raw(monkeypatch) -> None:
    """torch.conj(x) is a lazy view: its memory holds x's values. A raw copy of it handed the graph
    the unconjugated values (the sweep on the H100: dot, vdot and mm of complex64 WRONG through
    the native copy; the single-input raw copy had the same flaw). Here the raw copy is a host
    memmove, so that the plan's choice shows on the CPU."""
    import ctypes

    from graphtree.tree.placement import InputPlan, RawCopy

    monkeypatch.setattr(_native, "loaded", None)  # (the raw path: the one the native helpers stand in for)
    x = torch.randn(6, dtype=torch.complex64)
    for view, want in ((x.conj(), x.conj().resolve_conj()), (torch._neg_view(x.real), -x.real), (x, x)):
        dst = torch.zeros(view.shape, dtype=view.dtype)
        plan = InputPlan(
            inplace_idx=[], inplace_ptrs=[0], copy_idx=[0], placeholders=[dst],
            padded=(), pad_dim=0, bucket=0, device=0,
        )  # fmt: skip
        memmove = lambda d, s, n, _: ctypes.memmove(d, s, n)  # noqa: E731
        plan.raw = RawCopy(0, dst.data_ptr(), dst.numel() * dst.element_size(), 0, memmove)
        plan.copy_in([view], 0)
        assert torch.equal(dst, want), (view.is_conj(), view.is_neg())


def test_a_conjugate_view_is_keyed_with_its_bits_and_copied_as_memory_into_a_placeholder_with_them(monkeypatch) -> None:
    """Equal to eager bit for bit: the recording reads a placeholder with the input's lazy bits, so
    that its kernels are eager's (the conjugating cuBLAS path; `dot` of a resolved copy differed from
    eager in the last bits on the H100), and a replay copies the input's memory as it is."""
    from graphtree import _torch
    from graphtree.tree.node import signature
    from graphtree.tree.placement import InputPlan

    monkeypatch.setattr(_native, "loaded", None)
    x = torch.randn(6, dtype=torch.complex64)
    part = lambda t: inputs._tensor_part(t, t.shape, t.stride())  # noqa: E731 - (read_call's, for a CUDA tensor)
    plain, conj, neg = part(x), part(x.conj()), part(torch._neg_view(x.real))
    assert len(plain) == 3 and conj == (*plain, _torch.CONJ) and neg[3] == _torch.NEG

    class _Node:  # (what signature() reads of a recording)
        name, key = "f", (0, (conj, neg))

    assert signature(_Node()) == "f(conj complex64[6], neg float32[6])"  # type: ignore[arg-type]
    for view, bits, memory in ((x.conj(), _torch.CONJ, x), (torch._neg_view(x.real), _torch.NEG, x.real)):
        dst = torch.zeros(view.shape, dtype=view.dtype)
        plan = InputPlan(
            inplace_idx=[], inplace_ptrs=[0, 0], copy_idx=[0, 1], placeholders=[dst, torch.zeros(2)],
            padded=(), pad_dim=0, bucket=0, device=0, lazy={0: bits},
        )  # fmt: skip
        assert plan.raw is None and plan._native is None
        plan.copy_in([view, torch.ones(2)], 0)
        assert torch.equal(dst, memory)  # the memory as it is; the graph reads it with the bits
        assert torch.equal(_torch.flip_bits(dst, bits).resolve_conj().resolve_neg(), view.resolve_conj().resolve_neg())


@needs_toolchain
@pytest.mark.skipif(_native.disabled(), reason="GRAPHTREE_NATIVE=0: no build to test")
def test_a_process_that_exits_during_the_build_does_not_block_later_ones(tmp_path) -> None:
    # The build runs in a child of its own: it finishes and removes cpp_extension's lock file even
    # when the process that started it exits first (in a daemon thread the lock stayed behind, and
    # every later process waited on it forever).
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    quick = "from graphtree import _native; import time; _native.start(); time.sleep(1)"
    subprocess.run([sys.executable, "-c", quick], env=env, check=True, timeout=120)
    later = "from graphtree import _native; m = _native.wait(600); print(m is not None, _native.status())"
    cmd = [sys.executable, "-c", later]
    out = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True, timeout=900)
    assert out.stdout.startswith("True built"), (out.stdout, out.stderr[-2000:])
    from torch.utils import cpp_extension

    if not hasattr(cpp_extension, "FileLock"):
        # torch < 2.14 (its FileBaton): a lock file blocks every later build while it exists, so it
        # must go (allowing the first process's builder time to finish its own build). torch 2.14
        # holds an advisory lock (filelock) on a file it leaves in place, which blocks nobody.
        deadline = time.monotonic() + 120
        while list(tmp_path.rglob("lock")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(tmp_path.rglob("lock")), "cpp_extension's lock stayed behind"


def _random_channels(rng, monkeypatch, native):
    """Two 4-slot CPU channels, one on each path, and a function that sets both to the same random
    state (claims, ready cells behind or not, the newest slot) and runs a step on each."""
    from graphtree.share._control import ControlBlock
    from graphtree.share.channel import Channel

    pair = [Channel("c", 0, [torch.zeros(1) for _ in range(4)], ControlBlock.create(), reap=lambda: None) for _ in "ab"]

    def run(step):
        reading, ready, newest = (
            [rng.choice([0, 0, 1, 5]) for _ in range(4)],
            [rng.randint(0, 3) for _ in range(4)],
            rng.randint(-1, 3),
        )
        results = []
        for ch, module in zip(pair, (None, native), strict=True):
            monkeypatch.setattr(_native, "loaded", module)
            cells, c = ch._block.cells, ch._cells
            for s in range(4):
                cells[c.reading[s]], cells[c.ready[s]], cells[c.version[s]] = reading[s], ready[s], s + 10
            ch._state[:] = array.array("q", [20, newest, -1, 2, 2, 2, 2])
            outcome = step(ch)
            results.append((outcome, cells.tolist(), ch._state.tolist()))
        assert results[0] == results[1], (reading, ready, newest)
        return results[0][0]

    return pair, run


@needs_toolchain
def test_channel_take_and_publish_do_what_the_python_twins_do(native, monkeypatch) -> None:
    import random

    _, run = _random_channels(random.Random(7), monkeypatch, native)

    def step(ch):
        s = ch._take()
        return s if s is None else (s, ch._publish())

    taken = {run(step) for _ in range(400)}
    assert {t if t is None else t[0] for t in taken} == {None, 0, 1, 2, 3}, "every outcome was exercised"
    assert {t[1] for t in taken if t is not None} == {21}


@needs_toolchain
def test_a_graphed_writers_native_call_does_what_its_python_steps_do(native, monkeypatch) -> None:
    # the same random states as above, through GraphedWriter: one C call (channel_write) against
    # the Python steps; the function raises on some calls, and no slot may be free (a timeout)
    import random

    rng = random.Random(11)
    pair, run = _random_channels(rng, monkeypatch, native)
    plan = {}

    def fn(x, *, out):
        if plan["raise"]:
            raise ValueError("boom")
        return out.copy_(x)

    writers = {id(ch): ch.graphed(fn, timeout=0.001) for ch in pair}

    def step(ch):
        try:
            result = writers[id(ch)](torch.ones(1))
        except (ValueError, TimeoutError) as e:
            return type(e).__name__
        return [b is result for b in ch.buffers].index(True), ch.version

    outcomes = []
    for _ in range(300):
        plan["raise"] = rng.random() < 0.2
        outcomes.append(run(step))
    assert {"ValueError", "TimeoutError"} <= set(outcomes)
    assert {o[0] for o in outcomes if isinstance(o, tuple)} == {0, 1, 2, 3}
    graphtree.reset()


@needs_toolchain
def test_channel_take_and_publish_refuse_bad_input(native) -> None:
    cells, state = array.array("q", [0] * 8), array.array("q", [8, -1, -1, 0, 0])  # two slots
    plans = array.array("q", [0, 1, 2, 3, 4] * 3).tobytes()  # newest -1, 0, 1: try slot 0
    assert native.channel_take(cells, state, plans) == 0
    assert cells.tolist() == [0, 0, 0, -1, 9, 0, 0, 0] and state.tolist() == [8, -1, 0, 0, 0]
    assert native.channel_take(cells, state, plans) == -2, "a slot is being written"
    state[2] = -1
    cells[1] = 1
    assert native.channel_take(cells, state, plans) == -1, "no slot free"
    with pytest.raises(ValueError, match="quintuples"):
        native.channel_take(cells, state, plans[:-8])
    with pytest.raises(IndexError, match="cell out of range"):
        native.channel_take(cells, state, array.array("q", [0, 1, 2, 3, 8] * 3).tobytes())
    with pytest.raises(IndexError, match="slot out of range"):
        native.channel_take(cells, state, array.array("q", [2, 0, 2, 3, 4] * 3).tobytes())
    with pytest.raises(IndexError, match="newest slot"):
        native.channel_take(cells, array.array("q", [8, 2, -1, 0, 0]), plans)
    with pytest.raises(ValueError, match="no slot"):
        native.channel_take(cells, array.array("q", [8, -1, -1]), plans)
    with pytest.raises(TypeError, match="int64 cells"):
        native.channel_take(array.array("d", [0] * 8), state, plans)
    with pytest.raises(BufferError):
        native.channel_take(bytes(64), state, plans)  # read-only
    with pytest.raises(TypeError, match="plans must be bytes"):
        native.channel_take(cells, state, list(plans))
    view = memoryview(bytearray(64)).cast("q")
    view.release()
    with pytest.raises(ValueError, match="released"):  # a closed control block: an error, not a crash
        native.channel_take(view, state, plans)
    publishing = array.array("q", [3, 0, 5, 0]).tobytes()
    assert native.channel_publish(cells, state, publishing) == -1, "no slot being written"
    with pytest.raises(ValueError, match="pair per slot"):
        native.channel_publish(cells, state, publishing[:-8])
    state[2] = 1
    with pytest.raises(IndexError, match="cell out of range"):
        native.channel_publish(cells, state, array.array("q", [3, 0, 5, 9]).tobytes())
    assert native.channel_publish(cells, state, publishing) == 9
    assert (cells[5], cells[0]) == (9, 9) and state.tolist() == [9, 1, -1, 0, 9]


@needs_toolchain
def test_channel_write_hands_back_what_it_cannot_do_and_refuses_bad_input(native) -> None:
    from graphtree.share.channel import _AGAIN

    cells, state = array.array("q", [0] * 8), array.array("q", [0, -1, -1, 0])  # one slot
    plans = array.array("q", [0, 1, 2, 3, 4] * 2).tobytes()
    publishing = array.array("q", [3, 0]).tobytes()
    buffers = (torch.zeros(1),)
    calls = []

    def call(x, *, out):
        calls.append(x)
        if x == "raise":
            raise KeyError("boom")
        if x == "close":
            view.release()
        return out

    def writer(c=cells, b=buffers):
        return (c, state, plans, publishing, b, call, "out", _AGAIN)

    assert native.channel_write(writer(), (1,), {}) is buffers[0]
    assert state.tolist() == [1, 0, -1, 1] and cells[3] == 1 and cells[0] == 1
    cells[2] = 1  # "the GPU" wrote version 1: slot 0 may be written again
    assert native.channel_write(writer(), (1,), {"out": 0}) is _AGAIN, "out= given: Python raises"
    cells[1] = 1  # slot 0 being read
    assert native.channel_write(writer(), (1,), {}) is _AGAIN, "no slot free: Python waits"
    cells[1] = 0
    state[2] = 0
    assert native.channel_write(writer(), (1,), {}) is _AGAIN, "a slot being written: Python raises"
    state[2] = -1
    with pytest.raises(KeyError, match="boom"):
        native.channel_write(writer(), ("raise",), {})
    assert state.tolist() == [1, 0, -1, 1], "a call that raised gives its slot up, publishes nothing"
    view = memoryview(bytearray(cells.tobytes())).cast("q")
    with pytest.raises(ValueError, match="released"):  # the call closed the block: no crash
        native.channel_write(writer(c=view), ("close",), {})
    assert len(calls) == 3
    with pytest.raises(ValueError, match="a buffer per slot"):
        native.channel_write(writer(b=buffers * 2), (1,), {})
    with pytest.raises(TypeError, match="tuple of 8"):
        native.channel_write(writer()[:7], (1,), {})
    with pytest.raises(TypeError, match="tuple of 8"):
        native.channel_write(writer(), (1,), None)
    with pytest.raises(TypeError, match="buffers must be a tuple"):
        native.channel_write(writer(b=list(buffers)), (1,), {})


class _Obj:
    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


class _Slotted:
    __slots__ = ("a",)

    def __init__(self) -> None:
        self.a = 1


def _objects() -> dict[str, object]:
    """Objects as calls pass them: caches, dataclass-like states, nests, shared references, cycles,
    and what the native walk leaves to Python (slots, modules, functions, subclasses of containers)."""
    import collections

    shared = _Obj(v=3)
    cyc = _Obj()
    cyc.me = cyc
    deep = cur = _Obj()
    for _ in range(8):
        cur.n = _Obj()
        cur = cur.n
    found = {
        "plain": _Obj(
            a=1, b=1.0, c=True, n=None, s="x", dt=torch.float16, t=torch.zeros(2, 3)[:, 1:], x=shared, y=shared
        ),
        "nested": _Obj(l=[1, (2, 3.0), {"k": torch.ones(1), 2: [torch.zeros(1, dtype=torch.int64)]}]),
        "cycle": cyc,
        "deep": deep,
        "slots": _Slotted(),
        "module": _Obj(m=torch.nn.Linear(2, 2)),
        "function": _Obj(f=len),
        "namedtuple": _Obj(p=collections.namedtuple("P", "a b")(1, 2)),
        "ordered": _Obj(d=collections.OrderedDict(a=1)),
        "size": _Obj(s=torch.Size([2, 3])),
        "tuple key": _Obj(d={(1, 2): 3}),
        "parameter": _Obj(p=torch.nn.Parameter(torch.zeros(2))),
    }
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    lazy = transformers.StaticCache(config=cfg, max_cache_len=16)
    ready = transformers.StaticCache(config=cfg, max_cache_len=16)
    ready.early_initialization(1, 2, 8, torch.float32, torch.device("cpu"))
    found.update({"lazy cache": lazy, "sliding cache": ready, "dynamic cache": transformers.DynamicCache(config=cfg)})
    return found


@needs_toolchain
def test_object_state_reads_objects_as_read_object_does_or_defers(native, monkeypatch) -> None:
    monkeypatch.setattr(_native, "loaded", None)  # read_object: its Python walk
    walked = set()
    for name, obj in _objects().items():
        try:
            want = object_state.read_object(obj, object_state.HeldTensors())
        except readable.Unsupported as e:
            want = e
        got = native.object_state(obj, readable.PLAIN_TYPES, object_state._OPAQUE, 4096)
        if got is None:  # the Python path decides (and names what it cannot read)
            continue
        walked.add(name)
        assert not isinstance(want, Exception), (name, want)
        key, tensors, device, needs_grad = got
        assert key == want and hash(key) == hash(want), (name, key, want)
        assert (tensors, device, needs_grad) == ([], -2, False), name  # CPU tensors are keyed, never held
    assert {"plain", "nested", "cycle", "parameter", "lazy cache", "sliding cache", "dynamic cache"} <= walked
    assert not walked & {"deep", "slots", "module", "function", "namedtuple", "ordered", "size", "tuple key"}


@needs_toolchain
def test_read_object_gives_the_same_keys_with_and_without_the_helpers(native, monkeypatch) -> None:
    objects = _objects()

    def answers() -> list:
        out = []
        for obj in objects.values():
            try:
                out.append(object_state.read_object(obj, object_state.HeldTensors()))
            except readable.Unsupported as e:
                out.append(str(e))
        return out

    with_native = answers()
    monkeypatch.setattr(_native, "loaded", None)
    assert with_native == answers()


@needs_toolchain
def test_object_state_refuses_bad_input(native) -> None:
    with pytest.raises(TypeError, match="object_state"):
        native.object_state(_Obj(), [int], (), 1)
    assert native.object_state(1, (int,), (), 1) is None  # a plain value or a tensor is no object
    assert native.object_state(torch.zeros(1), (int,), (), 1) is None


def test_a_build_that_compiled_says_how_long_it_took_once(monkeypatch) -> None:
    import subprocess as sp
    import types

    so = "/cache/graphtree_native/graphtree_native.so"
    outputs = iter([f"compiled 17.4\n{so}\n", f"{so}\n"])
    monkeypatch.setattr(sp, "run", lambda *a, **k: types.SimpleNamespace(returncode=0, stdout=next(outputs), stderr=""))
    assert _native._build_in_child() == (so, 17.4)
    assert _native._build_in_child() == (so, None)  # (found in the cache: nothing to say)


def test_the_fields_a_hit_reads_most_are_slots():
    """The native replay reads a slot at its offset (``fast_hit.h``: ``field``, a few instructions)
    and an instance attribute through a dict lookup (~100): every name it reads of the classes it
    reads on every hit is a slot of that class (a member descriptor), and the classes whose own
    attribute access answers instead (``threading.local``'s ``user_code.active``) are read through
    ``getattr`` (the test above holds ``field`` to ``getattr``'s answers in every case)."""
    import inspect
    import pathlib
    import re

    from graphtree.tree import fast_hit, graphed, launch_order, liveness, manager, memory, node, reach, stats, walk

    header = pathlib.Path(_native.__file__).with_name("fast_hit.h").read_text()
    listed = header[header.index("const char* all[] = {") :]
    names = set(re.findall(r'"([^"]+)"', listed[: listed.index("};")]))
    assert {"training", "replays", "current", "statics"} <= names
    read = {
        walk.Walk: {"path", "current", "root", "called", "warming", "step_requested", "retired", "generation"},
        node.Node: {"first", "children", "unconditional", "statics_only", "epoch", "statics", "static_packed",
                    "inputs", "exec", "writes", "grads", "replays", "live"},
        node.Root: {"children"},
        manager.TreeManager: {"lock", "walk", "user_steps", "order", "memory", "counters", "hit"},
        liveness.OutputLiveness: {"_base", "_single", "refs", "_keep_base", "_base_storage", "_base_holders"},
        launch_order.LaunchOrder: {"_raw_stream", "_last_raw", "device"},
        memory.TreeMemory: {"live"},
        stats.Counters: {"replays"},
        fast_hit.FastHit: {"plan"},
        reach.FreeValues: {"models", "active", "_reads", "_structure", "_cache", "_epoch"},
        graphed.GraphedCallable: {"_snapshots", "disabled_reason", "bucketing", "_reach", "_step",
                                  "_grad_off_inside", "_forward", "fast_hits", "numbers"},
    }  # fmt: skip
    not_slots = []
    for cls, fields in read.items():
        assert fields <= names, (cls, fields - names)  # (names the hit reads: fast_hit.h)
        not_slots += [
            (cls.__qualname__, f)
            for f in fields
            if type(inspect.getattr_static(cls, f)).__name__ != "member_descriptor"
        ]
    assert not_slots == []


@needs_toolchain
def test_the_hits_own_attribute_reads_and_writes_answer_as_getattr_and_setattr(native) -> None:
    """``field`` and ``set_field`` (``fast_hit.h``), which the native replay reads and writes every
    attribute through, reading a slot at its offset from a table kept per (class, name): the same
    answers and errors as ``getattr``/``setattr`` for a slot (set, unset, set again), an instance
    attribute, a class attribute, a property, a subclass's property over a slot, a class changed
    after its slot was read (a property put over the slot), and a class with ``__getattr__``."""

    class Slotted:
        __slots__ = ("a", "b")
        k = "class"

    class Props(Slotted):
        __slots__ = ()

        @property
        def a(self):  # (over the base's slot: a data descriptor found first)
            return "property"

    class Plain:
        k = "class"

        def __init__(self) -> None:
            self.x = 1

    class Lazy:
        def __getattr__(self, name):
            return f"lazy {name}"

    s = Slotted()
    with pytest.raises(AttributeError):
        native.fast_field(s, "a")  # (unset: getattr's error)
    assert native.fast_field(s, "a", [1]) is None
    assert native.fast_field(s, "a") == [1] and s.a == [1]
    held = s.a
    native.fast_field(s, "a", "again")
    assert s.a == "again" and sys.getrefcount(held) == 2  # (the old value let go: held and the call's)
    assert native.fast_field(s, "k") == "class"
    with pytest.raises(AttributeError):
        native.fast_field(s, "k", 1)  # (a class attribute of a slotted class: setattr's error)
    p = Props()
    assert native.fast_field(p, "a") == "property"
    with pytest.raises(AttributeError):
        native.fast_field(p, "a", 2)  # (a property without a setter)
    object.__setattr__(s, "b", 3)
    assert native.fast_field(s, "b") == 3
    Slotted.b = property(lambda self: "now a property")  # (the class changed: its version tag too)
    assert native.fast_field(s, "b") == "now a property" == s.b
    plain = Plain()
    assert native.fast_field(plain, "x") == 1 and native.fast_field(plain, "k") == "class"
    native.fast_field(plain, "x", 5)
    native.fast_field(plain, "k", "mine")
    assert plain.x == 5 and plain.k == "mine" and Plain.k == "class"
    with pytest.raises(AttributeError):
        native.fast_field(plain, "missing")
    assert native.fast_field(Lazy(), "anything") == "lazy anything"
    assert native.fast_field(os, "sep") == os.sep  # (a module's dict)
    for _ in range(3):  # (from the table once it is filled: the same answers)
        assert native.fast_field(s, "a") == "again" and native.fast_field(p, "a") == "property"
