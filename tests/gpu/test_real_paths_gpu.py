"""The paths ordinary code takes by default (issue 24): ambient state, torch.compile around a graphed
call, what the user holds, tensor kinds a graph cannot take, ops that must not be frozen, dropped
callables, other threads drawing random numbers. Each test fails on the code before the fix."""

import gc
import os
import subprocess
import sys
import threading
import types
import warnings
import weakref

import pytest
import torch

import graphtree
from graphtree.tree import manager

DEV = "cuda"


def _matmul(x, w):
    return x @ w


def _ones_plus(x):
    return x + torch.ones(x.shape, device=x.device)


# 1. ambient state ---------------------------------------------------------------------------------
def test_a_recording_made_under_autocast_is_not_replayed_without_it():
    g = graphtree.graphed(_matmul)
    x, w = torch.randn(64, 64, device=DEV), torch.randn(64, 64, device=DEV)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):
            graphtree.mark_step()
            assert g(x, w).dtype == torch.bfloat16
    assert graphtree.stats().replays == 1
    for _ in range(3):  # without autocast: fp32, as eager gives
        graphtree.mark_step()
        out = g(x, w)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out, x @ w)
    with torch.autocast("cuda", dtype=torch.float16):  # another autocast dtype: another recording
        graphtree.mark_step()
        assert g(x, w).dtype == torch.float16
    assert graphtree.stats().replays == 2 and graphtree.stats().recordings == 2


def test_default_dtype_grad_mode_and_tf32_are_part_of_the_key():
    g = graphtree.graphed(_ones_plus)
    x = torch.randn(8, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        g(x)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        graphtree.mark_step()
        assert g(x).dtype == torch.float64  # x + ones(float64): eager promotes
    finally:
        torch.set_default_dtype(old)
    w = torch.randn(256, 256, device=DEV)
    h = graphtree.graphed(_matmul)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        for flag in (False, True, False):
            torch.backends.cuda.matmul.allow_tf32 = flag
            for _ in range(3):
                graphtree.mark_step()
                torch.testing.assert_close(h(w, w), w @ w, rtol=0, atol=0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    with torch.no_grad():
        for _ in range(3):
            graphtree.mark_step()
            g(x)
    recorded = graphtree.stats().recordings
    assert recorded == 4, graphtree.describe()  # g: fp32 grad on, g: no_grad; h: tf32 off and on


# 3. torch.compile around a graphed call -------------------------------------------------------
def test_compiled_code_calling_a_graphed_function_breaks_its_graph_there_quietly():
    g = graphtree.graphed(lambda x: (x * 3).sin(), name="inner")

    @torch.compile
    def outer(x):
        return g(x + 1) * 2

    x = torch.randn(1024, device=DEV)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(5):
            graphtree.mark_step()
            torch.testing.assert_close(outer(x), ((x + 1) * 3).sin() * 2)
    mine = [str(w.message) for w in seen if "graphtree" in str(w.message) or "_bump_epoch" in str(w.message)]
    assert not mine, mine
    assert graphtree.stats().replays >= 3, graphtree.stats()


# 5. the recorder and what the user holds ----------------------------------------------------------
STALE = []  # outputs kept from earlier steps: graphtree invalidated them
LAST_OUTPUT = None  # one of them kept in a global of its own, where a recording's search finds it first
W_GLOBAL = None


def _reads_a_global(x):
    return x @ W_GLOBAL


def test_a_held_invalidated_output_does_not_break_the_next_recording():
    global W_GLOBAL, LAST_OUTPUT
    W_GLOBAL = torch.randn(32, 32, device=DEV)
    g = graphtree.graphed(lambda x: x * 2, name="doubler")
    x = torch.randn(32, 32, device=DEV)
    for _ in range(4):
        graphtree.mark_step()
        STALE.append(g(x))
    graphtree.mark_step()
    g(x)
    with pytest.raises(RuntimeError, match="graphtree"):
        STALE[1].sum()  # it is invalidated, and the user still holds it in a global
    LAST_OUTPUT = STALE[1]
    h = graphtree.graphed(_reads_a_global)  # its recording looks for W_GLOBAL among the globals
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(h(x), x @ W_GLOBAL)
    assert graphtree.stats().replays >= 1
    STALE.clear()
    LAST_OUTPUT = None


# 6. tensor kinds -----------------------------------------------------------------------------------
def test_sparse_inputs_and_outputs_run_eagerly_with_the_reason():
    g = graphtree.graphed(torch.sparse.mm, name="spmm")
    s = torch.eye(8, device=DEV).to_sparse()
    x = torch.randn(8, 4, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(g(s, x), x)
    eager = graphtree.stats().eager
    assert any("input 0 is a sparse_coo tensor" in r for r in eager), eager
    idx = torch.tensor([[1, 3, 5]], device=DEV)
    make = graphtree.graphed(lambda v: torch.sparse_coo_tensor(idx, v * 2, (8,)), name="make_sparse")
    v = torch.randn(3, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        out = make(v)
        assert out.is_sparse
        torch.testing.assert_close(out.to_dense()[idx[0]], v * 2)
    eager = graphtree.stats().eager
    assert any("output 0 is a sparse_coo tensor" in r for r in eager), eager


def test_an_expanded_input_is_graphed():
    g = graphtree.graphed(lambda x: x * 2 + 1, name="expanded")
    for _ in range(5):
        graphtree.mark_step()
        x = torch.rand(1, 512, device=DEV).expand(4, 512)
        torch.testing.assert_close(g(x), x * 2 + 1, rtol=0, atol=0)
    s = graphtree.stats()
    assert s.replays == 3 and not s.eager, s


# 7. ops that must not be frozen --------------------------------------------------------------------
_lib = torch.library.Library("graphtree_test", "DEF")
_lib.define("host_counter(Tensor x) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,))
_calls = [0]


def _host_counter(x):
    _calls[0] += 1
    return x + _calls[0]  # a value of the host, read at every call


_lib.impl("host_counter", _host_counter, "CUDA")


def _counter_times_one(x):
    return torch.ops.graphtree_test.host_counter(x) * 1


def test_an_op_tagged_cudagraph_unsafe_is_never_frozen():
    g = graphtree.graphed(_counter_times_one, name="counter")
    x = torch.zeros(4, device=DEV)
    got = []
    for _ in range(5):
        graphtree.mark_step()
        got.append(g(x)[0].item())
    assert got == [_calls[0] - 4 + i for i in range(5)], got  # fresh on every call
    assert any("cudagraph_unsafe" in r for r in graphtree.stats().eager), graphtree.stats().eager


# 8. memory of dropped callables --------------------------------------------------------------------
def _closure(w):
    return graphtree.graphed(lambda x: (x @ w).relu(), name="closure")


def test_a_dropped_graphed_callable_gives_its_recordings_and_memory_back():
    x = torch.randn(512, 512, device=DEV)
    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    w = torch.randn(1024, 512, device=DEV).t()  # 2 MiB the closure holds
    g = _closure(w)
    w_ref = weakref.ref(w)
    del w
    for _ in range(4):
        graphtree.mark_step()
        y = g(x)
    del y
    assert graphtree.stats().pool_bytes > 0
    del g
    gc.collect()
    other = graphtree.graphed(lambda x: x + 1, name="other")
    graphtree.mark_step()
    other(x)  # a new step in this thread's tree: the dropped callable's recordings go
    assert w_ref() is None, "the recording still holds the closure's tensor"
    # The dropped callable's pool went; `other`'s warm-up made a new one for its cuBLAS workspace
    # (issue 45: a warm-up's workspace comes from the pool), free and ready for its recording.
    assert graphtree.stats().pool_bytes <= 32 << 20, "the dropped callable's recordings still hold pool memory"
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20, (before, torch.cuda.memory_allocated())


def test_closures_made_again_and_again_do_not_grow_memory():
    x = torch.randn(256, 256, device=DEV)
    keep = graphtree.graphed(lambda x: x * 2, name="kept")  # the tree stays non-empty
    sizes = []
    for _ in range(12):
        g = _closure(torch.randn(256, 256, device=DEV))
        for _ in range(3):
            graphtree.mark_step()
            keep(x)
            g(x)
        del g
        gc.collect()
        torch.cuda.synchronize()
        sizes.append(torch.cuda.memory_allocated())
    assert sizes[-1] - sizes[2] < 1 << 20, sizes


# 2. threads and random numbers ----------------------------------------------------------------------
@pytest.mark.parametrize("n_threads", [2, 4])
def test_other_threads_draw_random_numbers_while_one_records(n_threads):
    errors: list[str] = []
    replays: list[int] = []
    barrier = threading.Barrier(n_threads)

    def worker(k):
        try:
            drop = graphtree.graphed(lambda x: torch.nn.functional.dropout(x, 0.5) + x.sin(), name=f"drop{k}")
            noisy = graphtree.graphed(lambda x: x + torch.randn_like(x), name=f"noisy{k}")
            barrier.wait()
            for _ in range(30):
                graphtree.mark_step()
                x = torch.randn(4096, device=DEV)  # the default generator, drawn while another thread records
                a = drop(x)
                kept = a != x.sin()
                torch.testing.assert_close(a[kept], (x * 2 + x.sin())[kept])
                b = noisy(x)
                assert (b - x).std() > 0.5
            replays.append(manager.tree_for(0).counters.replays)  # this thread's tree
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"thread {k}: {e!r}"[:400])

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    torch.randn(8, device=DEV)  # and the process's generator still works
    assert len(replays) == n_threads and min(replays) >= 40, replays  # 2 functions x 30 steps, less warm-ups


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))


class _Counter:
    def __init__(self):
        self.count = 0  # a Python int the call advances, as transformers' sliding-window cache does
        self.seen = {"last": 0}


def _advance(x, state):
    state.count += 1
    state.seen["last"] = state.count * 10
    return x * state.count


def test_python_values_a_call_writes_into_its_arguments_are_written_again_on_replay():
    # A replay runs no Python: state.count stayed as it was, the next call's key matched the same
    # recording again, and it returned x * 1 where eager gives x * 2 (silently wrong). transformers'
    # StaticSlidingWindowLayer keeps its length in such an int (a kept StaticCache, reset per prompt).
    g = graphtree.graphed(_advance, name="advance")
    x = torch.ones(4, device=DEV)
    for _ in range(3):  # the first round warms up, the second records, the third replays
        state = _Counter()
        for i in range(1, 6):
            graphtree.mark_step()
            out = g(x, state)
            assert state.count == i and state.seen["last"] == 10 * i, (state.count, state.seen)
            torch.testing.assert_close(out, x * i)
    assert graphtree.stats().replays >= 5, graphtree.stats()


def test_a_call_that_grows_its_arguments_runs_eagerly_with_the_reason():
    def grow(x, state):
        state.items.append(len(state.items))
        return x + len(state.items)

    g = graphtree.graphed(grow, name="grow")
    x = torch.ones(4, device=DEV)
    for _ in range(4):
        state = types.SimpleNamespace(items=[])
        graphtree.mark_step()
        torch.testing.assert_close(g(x, state), x + 1)
        assert state.items == [0]
    reasons = " ".join(graphtree.stats().eager)
    assert "resizes or rebuilds argument 1.items" in reasons, graphtree.stats()


class _Stepper(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.calls = 0  # Python state of the module: not part of its key

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls  # the value is baked into a recording


def test_a_module_that_changes_its_own_python_attribute_runs_eagerly_not_stale():
    # A replay would leave `calls` as it was and return the recording's `* 2`: silently wrong.
    model = _Stepper().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 8, device=DEV)
    with torch.no_grad():
        for i in range(1, 6):
            graphtree.mark_step()
            torch.testing.assert_close(g(x), model.lin(x) * i)
            assert model.calls == i
    assert "changes the Python attribute `calls` of its module" in " ".join(graphtree.stats().eager), graphtree.stats()


def test_a_method_decorated_with_no_grad_is_graphed_when_called_with_grad_on():
    """The demo's TinyGPT.decode_step turns grad off inside (@torch.no_grad()), its parameters require
    grad and callers leave grad on: graphtree read that as a training call and ran every step eagerly
    ("autograd"; found graphing the tensor-parallel decode step on two H100s)."""
    from graphtree.demo.gpt import GPTConfig, TinyGPT

    cfg = GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=128, max_seq=16)
    eager_model, model = (TinyGPT(cfg, batch=2, device="cuda", seed=1) for _ in range(2))
    assert torch.is_grad_enabled() and all(p.requires_grad for p in model.parameters())
    step = graphtree.graphed(model.decode_step)
    for p in range(6):
        tokens = torch.full((2, 1), p + 3, device="cuda")
        pos = torch.tensor(p, device="cuda")
        want, got = eager_model.decode_step(tokens, pos), step(tokens, pos)
        assert torch.equal(want, got) and not got.requires_grad
    s = graphtree.stats()
    assert s.recordings == 1 and s.replays == 4 and s.eager == {}, s


def test_a_function_that_turns_grad_on_inside_no_grad_is_not_recorded():
    """Its output requires grad: a replay would hand it back without its history, so it runs eagerly."""
    w = torch.randn(8, 8, device="cuda", requires_grad=True)

    @torch.no_grad()
    def f(x):
        with torch.enable_grad():
            return x @ w

    g = graphtree.graphed(f)
    for _ in range(3):
        out = g(torch.randn(4, 8, device="cuda"))
        assert out.requires_grad and out.grad_fn is not None
    s = graphtree.stats()
    assert s.recordings == 0 and any("requires grad" in k for k in s.eager), s


def test_a_closure_cell_rebound_to_a_new_tensor_is_read_by_the_next_call():
    # Issue 44: the graphed function read its closure's tensor as recorded; after `w = new` the old
    # one's memory was reused and the next call returned a wrong result without an error.
    w = torch.full((4096,), 2.0, device=DEV)

    def scale(x):
        return x * w

    g = graphtree.graphed(scale, name="scale")
    x = torch.ones(4096, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(g(x), x * 2)
    for value in (3.0, 5.0, 7.0):
        w = torch.full((4096,), value, device=DEV)  # (read by scale through its cell)
        junk = torch.full((4096,), -1.0, device=DEV)  # may land on the old tensor's freed memory
        for _ in range(3):
            graphtree.mark_step()
            assert torch.equal(g(x), x * value), value
        del junk
    assert graphtree.stats().replays >= 6, graphtree.stats()


def test_a_deep_copy_of_a_graphed_module_records_its_own_and_replays():
    # Issue 45, item 1: copy.deepcopy of a graphed module raised "cannot pickle '_thread.lock' object".
    import copy

    torch.manual_seed(0)
    g = graphtree.graphed(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).to(DEV).eval())
    x = torch.randn(8, 64, device=DEV)
    with torch.inference_mode():
        for _ in range(3):
            graphtree.mark_step()
            g(x)
    ema = copy.deepcopy(g)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    with torch.inference_mode():
        for _ in range(3):
            graphtree.mark_step()
            a, b = g(x).clone(), ema(x).clone()
        torch.testing.assert_close(a, g.graphed_callable.fn(x))
        torch.testing.assert_close(b, ema.graphed_callable.fn(x))
    assert not torch.equal(a, b)
    assert graphtree.stats().recordings >= 2 and graphtree.stats().replays >= 3, graphtree.stats()


SCALE = 2.0  # a setting the graphed code reads as a global (tests below rebind it)


def _scaled_relu(x):
    return torch.relu(x) * SCALE


def test_a_global_or_closure_value_the_code_reads_is_never_replayed_stale():
    # A graph holds `SCALE` as a constant: the key held the arguments only, so a recording made at
    # 2.0 would replay x * 2.0 after SCALE = 3.0 (found reading the code; torch.compile guards on
    # such globals).
    global SCALE
    g = graphtree.graphed(_scaled_relu)
    x = torch.randn(64, device=DEV)
    try:
        for value in (2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 2.0):
            SCALE = value
            graphtree.mark_step()
            assert torch.equal(g(x), _scaled_relu(x)), value
    finally:
        SCALE = 2.0
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= 3 and not s.eager, s
    offset = 1

    def shifted(x):
        return x + offset

    h = graphtree.graphed(shifted)
    for value in (1, 1, 1, 5, 5):
        offset = value
        graphtree.mark_step()
        assert torch.equal(h(x), x + value), value


class _Settings:
    def __init__(self) -> None:
        self.scale = 2.0


SETTINGS = _Settings()  # a config object the graphed code reads (the test below changes it)


def _configured(x):
    return torch.relu(x) * SETTINGS.scale


def test_a_config_objects_attribute_the_code_reads_is_never_replayed_stale():
    # `x * SETTINGS.scale`: the key held neither the object nor its attributes, so a recording made
    # at 2.0 replayed x * 2.0 after SETTINGS.scale = 3.0 (found reading the code after the
    # sixteenth session's device time; CPU test in tests/test_free_values.py)
    g = graphtree.graphed(_configured)
    x = torch.randn(64, device=DEV)
    try:
        for value in (2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 2.0):
            SETTINGS.scale = value
            graphtree.mark_step()
            assert torch.equal(g(x), _configured(x)), value
    finally:
        SETTINGS.scale = 2.0
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= 3 and not s.eager, s


def _activation(x):
    return torch.relu(x)


def _through_activation(x):
    return _activation(x) * 2


def test_a_helper_defined_anew_is_called_not_the_recorded_one():
    # A notebook cell run again defines `_activation` anew: eager calls the new one; the key held
    # neither the helper nor its identity, so the old recording replayed (found reading the code
    # after the sixteenth session's device time; CPU test in tests/test_free_values.py)
    global _activation
    g = graphtree.graphed(_through_activation)
    x = torch.randn(64, device=DEV)
    old = _activation
    try:
        for i in range(6):
            if i == 3:
                _activation = torch.tanh  # (redefined)
            graphtree.mark_step()
            assert torch.equal(g(x), _through_activation(x)), i
    finally:
        _activation = old
    s = graphtree.stats()
    assert s.recordings == 2 and not s.eager, s


def test_a_library_modules_setting_changed_between_calls_is_never_replayed_stale():
    # `model[1].negative_slope = 0.2` (a torch class's plain attribute, read by its forward): only
    # the user's classes' attributes were keyed, so the recording made at 0.01 replayed 0.01 (found
    # reading the code after the sixteenth session's device time; CPU test in test_free_values.py)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LeakyReLU(0.01), torch.nn.Dropout(0.0)).to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)
    with torch.no_grad():
        for slope in (0.01, 0.01, 0.01, 0.2, 0.2, 0.2, 0.01):
            model[1].negative_slope = slope
            graphtree.mark_step()
            assert torch.equal(g(x), model(x)), slope
        model[2].p = 1.0  # (in train mode) dropout of everything: eager gives zeros whatever the draw
        for _ in range(3):
            graphtree.mark_step()
            assert not g(x).any()
    s = graphtree.stats()
    assert s.recordings == 3 and s.replays >= 4 and not s.eager, s


class _Sampler(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.temperature = 1.0  # a setting the caller changes between calls

    def forward(self, x):
        return torch.softmax(self.lin(x) / self.temperature, dim=-1)


def test_a_plain_attribute_of_a_graphed_module_set_between_calls_is_never_replayed_stale():
    # The key held the module's identity and `training` only (found reading the code): a recording
    # made at temperature 1.0 would replay it after `model.temperature = 0.5`.
    model = _Sampler().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)
    with torch.no_grad():
        for t in (1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0):
            model.temperature = t
            graphtree.mark_step()
            assert torch.equal(g(x), model(x)), t
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= 3 and not s.eager, s


class _ClassScaled(torch.nn.Module):
    scale = 1.0  # a class attribute, read as self.scale

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * self.scale


def _equal_to_eager_as_it_changes(values, change, graphed_call, eager_call, check=None, replays=3):
    """``change(v)`` for each of ``values``, one call per step: every graphed call equals eager's
    (and passes ``check(out, v)``); two recordings, one per setting, and the calls between replayed."""
    with torch.no_grad():
        for v in values:
            change(v)
            graphtree.mark_step()
            out = graphed_call()
            assert torch.equal(out, eager_call()), v
            if check is not None:
                assert check(out, v), v
    s = graphtree.stats()
    assert s.recordings == 2 and s.replays >= replays and not s.eager, s


def test_a_class_attribute_set_between_calls_is_never_replayed_stale():
    # `_ClassScaled.scale = 0.5` between calls: only instances' attributes were keyed, so the
    # recording made at 1.0 would replay 1.0 (found reading the code, eighteenth session)
    model = _ClassScaled().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)
    try:
        _equal_to_eager_as_it_changes(
            (1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 1.0),
            lambda scale: setattr(_ClassScaled, "scale", scale),
            lambda: g(x),
            lambda: model(x),
        )
    finally:
        _ClassScaled.scale = 1.0


class _Probing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.lin(x) * getattr(self, "scale", 1.0)


def test_an_attribute_probed_with_a_default_and_set_after_the_first_calls_is_never_replayed_stale():
    # `getattr(self, "scale", 1.0)`, then `model.scale = 0.5`: absent at the first call, the
    # attribute was not keyed, and the recording made without it replayed 1.0 (nineteenth session)
    model = _Probing().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)

    def change(scale):
        if scale is None:
            model.__dict__.pop("scale", None)
        else:
            model.scale = scale

    _equal_to_eager_as_it_changes((None, None, None, 0.5, 0.5, 0.5, None), change, lambda: g(x), lambda: model(x))


_STEPS = 0


def _counts_its_steps(x):
    global _STEPS
    _STEPS += 1
    return x * 2


def test_a_counter_the_call_bumps_counts_every_call_as_eager_does():
    # `calls["n"] += 1` in a closure dict, `STEP += 1` in a global: keyed since the eighteenth
    # session, each call was a new signature (warmed up until churn ran it eagerly); before, a
    # replay skipped the count. A warm-up now sees the change: such a call runs eagerly, with the
    # reason, and counts as eager does (nineteenth session)
    global _STEPS
    calls = {"n": 0}

    def counted(x):
        calls["n"] += 1
        return x + 1

    g, h = graphtree.graphed(counted), graphtree.graphed(_counts_its_steps)
    x = torch.randn(64, device=DEV)
    _STEPS = 0
    for i in range(8):
        graphtree.mark_step()
        assert torch.equal(g(x), x + 1) and torch.equal(h(x), x * 2)
        assert (calls["n"], _STEPS) == (i + 1, i + 1)
    eager = graphtree.stats().eager
    assert any("changes the dict `calls`" in r for r in eager), eager
    assert any("`_STEPS`" in r and "on every call" in r for r in eager), eager
    assert graphtree.stats().warmups <= 8, graphtree.stats()  # (not a warm-up per call, as churn made)


_W_REBOUND = None


def _times_w(x):
    return x @ _W_REBOUND


class _Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.mask = torch.ones(16, device=DEV)  # (a plain attribute, not a buffer)

    def forward(self, x):
        return self.lin(x) * self.mask


def test_a_tensor_rebound_while_the_old_one_lives_is_never_replayed_stale():
    # `W = other` (a global) or `model.mask = other` (a plain attribute) while the old tensor is
    # still held: neither freed nor moved, the old one was replayed (README said so; nineteenth
    # session). Now keyed by identity: each binding its own recording.
    global _W_REBOUND
    a, b = torch.randn(16, 16, device=DEV), torch.randn(16, 16, device=DEV)
    g = graphtree.graphed(_times_w)
    x = torch.randn(4, 16, device=DEV)
    _equal_to_eager_as_it_changes(
        (a, a, a, b, b, b, a), lambda w: globals().__setitem__("_W_REBOUND", w), lambda: g(x), lambda: _times_w(x)
    )
    _W_REBOUND = None
    graphtree.reset()
    model = _Masked().to(DEV)
    m = graphtree.graphed(model)
    ones, halves = model.mask, torch.full((16,), 0.5, device=DEV)
    _equal_to_eager_as_it_changes(
        (ones, ones, ones, halves, halves, halves, ones),
        lambda t: setattr(model, "mask", t),
        lambda: m(x),
        lambda: model(x),
    )


def test_torchs_fp32_precision_api_neither_raises_nor_replays_the_other_precision():
    # `torch.backends.cuda.matmul.fp32_precision = "tf32"` (torch 2.9's API) made the legacy TF32
    # getters that the ambient key reads raise: every graphed call raised (found on the CPU,
    # eighteenth session). TF32 and IEEE matmuls differ on the GPU: each must be eager's.
    g = graphtree.graphed(_matmul)
    x, w = torch.randn(256, 256, device=DEV), torch.randn(256, 256, device=DEV)
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    try:
        _equal_to_eager_as_it_changes(
            ("tf32", "tf32", "tf32", "ieee", "ieee", "ieee", "tf32"),
            lambda precision: setattr(matmul, "fp32_precision", precision),
            lambda: g(x, w),
            lambda: _matmul(x, w),
        )
    finally:
        matmul.fp32_precision = old


def _zeros_in_train_mode(out, train):
    """Dropout with p=1.0: zeros in train mode, whatever the draw."""
    return bool(out.any()) != train


def test_a_submodule_put_in_another_mode_between_calls_is_never_replayed_stale():
    # MC dropout: `model.eval()`, then its dropout layers back to train(). Only the graphed
    # module's own mode was keyed, so the recording made with dropout off replayed it off (found by
    # a CPU hunt for keying gaps, eighteenth session).
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(1.0)).to(DEV).eval()
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)
    _equal_to_eager_as_it_changes(
        (False, False, False, True, True, True, False),
        model[1].train,
        lambda: g(x),
        lambda: model(x),
        check=_zeros_in_train_mode,
    )


class _Predictor:
    def __init__(self):
        self.model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(1.0)).to(DEV)

    def predict(self, x):
        return self.model(x)


def test_the_mode_of_a_model_a_graphed_methods_object_holds_is_never_replayed_stale():
    # `graphed(predictor.predict)`, `predictor.model.train()` between calls: no module was found
    # behind the method, so the model's mode was not keyed (found by a CPU hunt for keying gaps,
    # eighteenth session).
    predictor = _Predictor()
    g = graphtree.graphed(predictor.predict)
    x = torch.randn(4, 16, device=DEV)
    _equal_to_eager_as_it_changes(
        (False, False, False, True, True, True, False),
        predictor.model.train,
        lambda: g(x),
        lambda: predictor.model(x),
        check=_zeros_in_train_mode,
    )


USE_GELU = True


class _GeluBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.nn.functional.gelu(self.lin(x)) if USE_GELU else torch.relu(self.lin(x))


class _GeluNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _GeluBlock()

    def forward(self, x):
        return self.block(x) * 2


def _use_gelu(gelu):
    global USE_GELU
    USE_GELU = gelu


def test_a_global_read_in_a_submodules_forward_set_between_calls_is_never_replayed_stale():
    # `USE_GELU = False` between calls of a graphed `_GeluNet`: only the graphed function's own code
    # (and functions it calls by global name) was walked, not its submodules' forwards (found by a
    # CPU hunt for keying gaps, eighteenth session)
    model = _GeluNet().to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)
    try:
        _equal_to_eager_as_it_changes(
            (True, True, True, False, False, False, True), _use_gelu, lambda: g(x), lambda: model(x)
        )
    finally:
        _use_gelu(True)


def test_a_submodule_without_parameters_replaced_between_calls_is_never_replayed_stale():
    # `model[1] = nn.Sigmoid()` in place of `nn.Tanh()`: no address check sees a module without
    # parameters, and neither reads a setting (found by a CPU hunt for keying gaps, eighteenth session)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()).to(DEV)
    g = graphtree.graphed(model)
    x = torch.randn(4, 16, device=DEV)

    def place(act):
        if not isinstance(model[1], act):
            model[1] = act()

    acts = (torch.nn.Tanh, torch.nn.Tanh, torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Sigmoid, torch.nn.Sigmoid)
    _equal_to_eager_as_it_changes(acts, place, lambda: g(x), lambda: model(x), replays=2)


def _apply(model, x):
    return model(x) * 2


def test_a_setting_of_a_module_passed_as_an_argument_set_between_calls_is_never_replayed_stale():
    # `step(model, x)`, `model[1].negative_slope = 0.2` between calls: a module argument was keyed by
    # its type, identity and mode only (found by a CPU hunt for keying gaps, eighteenth session)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.LeakyReLU(0.01)).to(DEV)
    g = graphtree.graphed(_apply)
    x = torch.randn(4, 16, device=DEV)
    _equal_to_eager_as_it_changes(
        (0.01, 0.01, 0.01, 0.2, 0.2, 0.2, 0.01),
        lambda slope: setattr(model[1], "negative_slope", slope),
        lambda: g(model, x),
        lambda: _apply(model, x),
    )


def test_a_call_that_draws_on_the_host_runs_eagerly_with_the_reason():
    # A replay runs no Python: `random.random() < 0.5` would take the recording's branch on every
    # replay, where eager draws anew (found reading the code).
    import random

    def augment(x):
        return x.flip(-1) if random.random() < 0.5 else x

    g = graphtree.graphed(augment)
    x = torch.arange(8.0, device=DEV)
    random.seed(0)
    want = [augment(x) for _ in range(8)]
    random.seed(0)
    for w in want:
        graphtree.mark_step()
        assert torch.equal(g(x), w)
    s = graphtree.stats()
    assert s.recordings == 0 and any("Python's random module" in r for r in s.eager), s


LOSSES = []  # a training loop's log, appended to inside the graphed step


def _step_logging_its_loss(x):
    loss = (x * 2).sum()
    LOSSES.append(loss)
    return loss


def test_a_call_that_appends_to_a_global_list_is_not_replayed_without_the_append():
    # A replay runs no Python: the list would stop growing after the recording (found reading the
    # code: the loss is an output, so no kept tensor showed it).
    g = graphtree.graphed(_step_logging_its_loss)
    x = torch.randn(32, device=DEV)
    LOSSES.clear()
    for i in range(6):
        graphtree.mark_step()
        g(x)
        assert len(LOSSES) == i + 1
    s = graphtree.stats()
    assert s.recordings == 0 and any("changes the list `LOSSES`" in r for r in s.eager), s
    LOSSES.clear()


NET = None  # a model the graphed function calls as a global (set by the test)


def _infer(x):
    return NET(x)


def test_a_global_models_train_and_eval_modes_are_never_replayed_stale():
    # The key held the mode of a graphed module and of one found in the closure only (found reading
    # the code): a function calling a global model, recorded in eval mode, would replay it without
    # dropout after NET.train().
    global NET
    NET = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Dropout(0.5)).to(DEV)
    g = graphtree.graphed(_infer)
    x = torch.randn(8, 64, device=DEV)
    try:
        with torch.no_grad():
            for mode in ("eval", "eval", "eval", "train", "train", "train", "eval"):
                getattr(NET, mode)()
                graphtree.mark_step()
                torch.manual_seed(1)
                want = NET(x)
                torch.manual_seed(1)
                got = g(x)
                assert torch.equal(got, want), mode
                assert (got == 0).any() == (mode == "train"), mode  # (dropout zeroes about half in train mode)
    finally:
        NET = None
    s = graphtree.stats()
    assert s.recordings == 2 and not s.eager, s


_THREADS_WITH_HELPERS_OFF = """
import threading, torch, graphtree
from graphtree import _native
from graphtree.tree import manager
errors, replays, barrier = [], [], threading.Barrier(3)
def worker(k):
    try:
        noisy = graphtree.graphed(lambda x: x + torch.randn_like(x), name=f"noisy{k}")
        barrier.wait()
        for _ in range(30):
            graphtree.mark_step()
            x = torch.randn(4096, device="cuda")  # drawn while another thread records
            assert (noisy(x) - x).std() > 0.5
        replays.append(manager.tree_for(0).counters.replays)
    except Exception as e:
        errors.append(f"thread {k}: {e!r}"[:300])
threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
[t.start() for t in threads]
[t.join(timeout=240) for t in threads]
print("loaded", _native.loaded, "|", _native.status())
print("errors", errors, "replays", replays)
assert _native.loaded is None and not errors and len(replays) == 3 and min(replays) >= 20
"""


@pytest.mark.own_process
def test_with_the_call_paths_helpers_off_other_threads_still_draw_random_numbers_while_one_records():
    """GRAPHTREE_NATIVE=0 runs the call's Python path; on torch < 2.12 it turned the CUDA part off
    too, and another thread's random op failed during a capture ("Offset increment outside graph
    capture": twenty-second session, the helpers-off suite). The switch is the call path's alone."""
    env = {**os.environ, "GRAPHTREE_NATIVE": "0"}
    script = [sys.executable, "-c", _THREADS_WITH_HELPERS_OFF]
    out = subprocess.run(script, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    assert "errors [] " in out.stdout, out.stdout
