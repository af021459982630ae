"""graphtree's native helpers on CUDA tensors: the same keys and the same address checks as the
Python path, and recordings made on one path replay on the other."""

import pytest
import torch

import graphtree
from graphtree import _native, _torch
from graphtree.tree import inputs, object_state, readable
from graphtree.tree.outputs import SingleOutput

DEV = "cuda"


@pytest.fixture
def native():
    if _native.disabled():
        pytest.skip("GRAPHTREE_NATIVE=0: the helpers are off in this run")
    module = _native.wait(600)
    if module is None:
        pytest.fail(f"native helpers not built on this GPU machine: {_native.status()}")
    return module


def _python_call(monkeypatch, args):
    with monkeypatch.context() as m:
        m.setattr(_native, "loaded", None)
        return inputs.read_call(args, {}, None)


def test_signature_of_cuda_tensors_equals_the_python_paths(native, monkeypatch):
    base = torch.randn(4, 6, device=DEV)
    cases = [
        (base,),
        (base.t(), 3, None, "s", torch.float16),  # a transposed view: strides differ
        (base[:, ::2], base.half(), torch.zeros((), device=DEV)),  # strided view, fp16, 0-d
        (torch.nn.Parameter(base.clone()), torch.randn(2, device=DEV, requires_grad=True)),
        (torch.empty(0, 3, device=DEV), True, 2.5),
    ]
    for args in cases:
        sig = native.signature(args, readable.PLAIN_TYPES)
        want = _python_call(monkeypatch, args)
        assert sig == (want.key, want.device, want.needs_grad), args
        assert hash(sig[0]) == hash(want.key)
    # A CPU tensor beside a CUDA one: the Python path names the reason.
    assert native.signature((base, torch.zeros(1)), readable.PLAIN_TYPES) is None
    with pytest.raises(readable.Unsupported, match="mixed-device"):
        inputs.read_call((base, torch.zeros(1)), {}, None)


def test_recordings_made_on_the_python_path_replay_on_the_native_one(native, monkeypatch):
    f = graphtree.graphed(lambda x, k: x * k + 1)
    x = torch.randn(8, device=DEV)
    with monkeypatch.context() as m:
        m.setattr(_native, "loaded", None)
        for _ in range(3):  # warm-up, record, replay
            graphtree.mark_step()
            assert torch.equal(f(x, 2), x * 2 + 1)
    before = graphtree.stats()
    for _ in range(3):
        graphtree.mark_step()
        assert torch.equal(f(x, 2), x * 2 + 1)
    after = graphtree.stats()
    assert after.recordings == before.recordings == 1
    assert after.replays == before.replays + 3


@pytest.mark.parametrize("path", ["native", "python"])
def test_a_hundred_parameter_module_notices_any_parameter_moving(native, monkeypatch, path):
    if path == "python":
        monkeypatch.setattr(_native, "loaded", None)
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(50)]).to(DEV)  # 100 parameters
    g = graphtree.graphed(net)
    x = torch.randn(2, 8, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            graphtree.mark_step()
            assert torch.equal(g(x), net(x))
        net[37].bias.data = torch.randn(8, device=DEV)  # a new address, no registration
        graphtree.mark_step()
        assert torch.equal(g(x), net(x))
        torch.utils.swap_tensors(net[3].weight, torch.nn.Parameter(torch.randn(8, 8, device=DEV)))
        graphtree.mark_step()
        assert torch.equal(g(x), net(x))
        # as FSDP frees and gathers a parameter: the same TensorImpl and StorageImpl, other memory
        w = net[10].weight
        saved, storage, before = w.clone(), w.untyped_storage(), w.data_ptr()
        nbytes = storage.nbytes()
        storage.resize_(0)
        blocker = torch.empty(nbytes // 4, device=DEV)  # (holds the freed block: the next is another)
        storage.resize_(nbytes)
        w.copy_(saved)
        assert w.data_ptr() != before
        graphtree.mark_step()
        assert torch.equal(g(x), net(x))
        del blocker
    assert graphtree.stats().recordings == 4, graphtree.stats()


def test_copy_d2d_copies_on_the_current_stream_and_reports_cuda_errors(native):
    src = torch.arange(1 << 20, device=DEV, dtype=torch.float32)
    dst = torch.zeros_like(src)
    stream = torch.cuda.current_stream().cuda_stream
    assert native.copy_d2d(dst.data_ptr(), src.data_ptr(), src.numel() * 4, stream) is True
    assert torch.equal(dst, src)
    # A CUDA error (an address that is not device memory) raises with the runtime's words; in a
    # subprocess, as a failed copy may leave the context unusable.
    import subprocess
    import sys

    code = (
        "import torch; from graphtree import _native; m = _native.wait(600); x = torch.zeros(4, device='cuda')\n"
        "try:\n    m.copy_d2d(x.data_ptr(), 8, 16, torch.cuda.current_stream().cuda_stream); torch.cuda.synchronize()\n"
        "except RuntimeError as e:\n    print('raised', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert "raised" in out.stdout, (out.stdout, out.stderr[-2000:])


GRAPH_LAUNCH_AFTER_A_FAULT = """
import torch
from graphtree import _native, _torch
m = _native.wait(600)
x = torch.zeros(4, device="cuda")
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    x.add_(1)
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    x.add_(1)
exec_, stream = _torch.graph_exec(g), torch.cuda.current_stream().cuda_stream
print("LAUNCHED", m.graph_launch(exec_, 0, stream), m.graph_launch(0, 0, stream))
torch.cuda.synchronize()
print("X", x.tolist())
try:
    torch.zeros(4, device="cuda")[torch.tensor([10], device="cuda")].sum().item()  # a device-side assert
except Exception as e:
    print("FAULT", type(e).__name__)
try:
    m.graph_launch(exec_, 0, stream)
    print("NO ERROR")
except Exception as e:
    print("RAISED", type(e).__name__, str(e).splitlines()[0])
"""


def test_graph_launch_launches_a_recording_and_raises_cuda_errors_as_torch_does(native):
    """The native hit's launch (issue 47): a captured graph's exec launched on the current stream
    (exec 0: nothing launched), and after a device-side fault the error torch raises for it (its
    type, "CUDA error: ..."). In a subprocess: the fault ends its context."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", GRAPH_LAUNCH_AFTER_A_FAULT], capture_output=True, text=True, timeout=300, check=False
    )
    text = out.stdout
    assert "LAUNCHED True False" in text and "X [2.0, 2.0, 2.0, 2.0]" in text, (text, out.stderr[-2000:])
    fault = [line.split()[1] for line in text.splitlines() if line.startswith("FAULT")]
    raised = [line.split(maxsplit=2)[1:] for line in text.splitlines() if line.startswith("RAISED")]
    assert fault and raised, (text, out.stderr[-2000:])
    assert raised[0][0] == fault[0], "the launch raises the type torch raised for the same error"
    assert raised[0][1].startswith("CUDA error: device-side assert triggered"), raised


def test_copy_in_copies_tensors_and_writes_numbers_in_stream_order(native):
    stream = torch.cuda.Stream()
    a, b = (torch.randn(1 << 16, device=DEV) for _ in range(2))
    da, db = torch.zeros_like(a), torch.zeros_like(b)
    f, i = torch.zeros((), dtype=torch.float64, device=DEV), torch.zeros((), dtype=torch.int64, device=DEV)
    leaves = [a, 0.1, b, -(2**40) - 3]
    copies = (0, da.data_ptr(), a.numel() * 4, 2, db.data_ptr(), b.numel() * 4)
    writes = (1, f.data_ptr(), 3, i.data_ptr())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(1_000_000)  # (the writes wait behind it: stream-ordered)
        assert native.copy_in(stream.cuda_stream, leaves, copies, writes) is True
        f_after, i_after = f * 1, i * 1
    torch.cuda.synchronize()
    assert torch.equal(da, a) and torch.equal(db, b)
    assert f_after.item() == 0.1 and i_after.item() == -(2**40) - 3  # (0.1 as a float64, bit for bit)
    # a leaf the plan does not expect: nothing written, the Python path does it
    assert native.copy_in(stream.cuda_stream, [a, "x", b, 1], copies, writes) is False
    assert native.copy_in(stream.cuda_stream, [a, 0.5, b, 2**64], copies, writes) is False
    with pytest.raises(IndexError):
        native.copy_in(stream.cuda_stream, [a], copies, ())


def test_a_replay_with_two_inputs_and_a_float_copies_and_writes_in_one_native_call(native):
    f = lambda x, m, t: (x / t).masked_fill(~m, 0.0).softmax(-1)  # noqa: E731 - (issue 45's sampler's shape)
    g = graphtree.graphed(f)
    x = torch.randn(4, 256, device=DEV)
    m = x > 0
    for k in range(6):
        graphtree.mark_step()
        t = 0.5 + k / 7
        assert torch.equal(g(x, m, t), f(x, m, t)), t
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays >= 4 and not s.eager, s
    (node,) = [n for mgr in graphtree.tree.manager.managers() for n in mgr.nodes()]
    assert node.inputs._native is not None and len(node.inputs._native[2]) == 2, node.inputs._native


class _State:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def test_object_arguments_holding_cuda_tensors_read_as_on_the_python_path(native, monkeypatch):
    """The C++ walk of object arguments (_native.object_state): the same key, the same tensors held
    in place, in order, and the same call key through read_call, with CUDA tensors in them."""
    shared = torch.randn(3, device=DEV)
    objects = [
        _State(k=torch.zeros(1, 2, 8, 4, device=DEV), v=torch.ones(1, 2, 8, 4, device=DEV), n=3, on=True),
        _State(layers=[_State(keys=shared, len=torch.zeros((), dtype=torch.long, device=DEV)) for _ in range(3)]),
        _State(cpu=torch.zeros(2), cuda=torch.randn(2, 2, device=DEV).t(), d={"a": shared, "b": 1.5}),
        _State(p=torch.nn.Parameter(torch.randn(2, device=DEV)), g=torch.randn(2, device=DEV, requires_grad=True)),
    ]
    x = torch.ones(2, device=DEV)  # one argument for both paths: the leaves are compared by identity
    for obj in objects:
        got = native.object_state(obj, readable.PLAIN_TYPES, object_state._OPAQUE, 4096)
        assert got is not None, vars(obj)
        with monkeypatch.context() as m:
            m.setattr(_native, "loaded", None)
            held = object_state.HeldTensors()
            want = object_state.read_object(obj, held)
            python_call = inputs.read_call((x,), {"state": obj}, None)
        key, tensors, device, needs_grad = got
        assert key == want and hash(key) == hash(want)
        assert [id(t) for t in tensors] == [id(t) for t in held.tensors]
        assert (device, needs_grad) == (held.device, held.needs_grad)
        native_call = inputs.read_call((x,), {"state": obj}, None)
        assert native_call.key == python_call.key
        assert [id(t) for t in native_call.leaves] == [id(t) for t in python_call.leaves]
    if torch.cuda.device_count() > 1:  # several devices: the Python path names it
        mixed = _State(a=torch.zeros(1, device=DEV), b=torch.zeros(1, device="cuda:1"))
        assert native.object_state(mixed, readable.PLAIN_TYPES, object_state._OPAQUE, 4096) is None


def test_a_single_output_built_and_invalidated_in_cpp_is_what_torchs_bindings_make(native):
    """outputs.cpp (issue 47, output kept): the tensor single_output builds on a recording's memory
    equals _torch.storage_at + tensor_on's (layout, address, values, no grad, a plain tensor), its
    weak reference counts as _weak_ref's does, and invalidate_storage does what
    _torch.invalidate_storage does: a read raises the message, a block the storage owned goes back."""
    if not hasattr(native, "single_output"):
        pytest.fail("the native helpers were built without their CUDA part")
    src = torch.randn(4, 6, device=DEV, dtype=torch.float16)
    view = src[:, 1:].t()  # a storage offset and strides of its own
    nbytes = src.untyped_storage().nbytes()
    single = SingleOutput(src.data_ptr(), nbytes, _torch.meta_of(view))
    t, ref = native.single_output(single, 0)
    twin = _torch.tensor_on(single.meta, _torch.storage_at(single.ptr, torch.device(DEV, 0), nbytes))
    assert type(t) is torch.Tensor and not t.requires_grad
    for got in (t, twin):
        assert (got.shape, got.stride(), got.storage_offset(), got.dtype, got.device) == (
            view.shape,
            view.stride(),
            view.storage_offset(),
            view.dtype,
            view.device,
        )
        assert got.data_ptr() == view.data_ptr() and torch.equal(got, view)
    assert not _torch.weak_expired(ref) and _torch.storage_use_count(ref) == 1
    del t
    assert _torch.weak_expired(ref)
    _torch.weak_free(ref)

    # Invalidated: a read raises the message; memory the storage did not own stays the pool's.
    kept = src.clone()
    t, ref = native.single_output(single, 0)
    native.invalidate_storage(ref, "graphtree: a stale output (test)")
    with pytest.raises(RuntimeError, match="a stale output"):
        t + 1
    _torch.weak_free(ref)
    assert torch.equal(src, kept)

    # A storage that owns its block: the block goes back to the allocator, as with the twin.
    torch.cuda.synchronize()
    freed = []
    for invalidate in (native.invalidate_storage, _torch.invalidate_storage):
        owned = torch.empty(1 << 18, device=DEV)
        r = _torch.weak_ref(owned.untyped_storage())
        before = torch.cuda.memory_allocated()
        invalidate(r, "graphtree: gone (test)")
        freed.append(before - torch.cuda.memory_allocated())
        with pytest.raises(RuntimeError, match="gone"):
            owned.sum()
        del owned  # (its deleter now frees nothing: no double free)
        _torch.weak_free(r)
    assert freed[0] == freed[1] == 1 << 20, freed
