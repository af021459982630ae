"""CPU checks of the pieces behind issue 24 (the GPU tests are tests/gpu/test_real_paths_gpu.py,
test_hf_defaults_gpu.py and test_fault_injection_gpu.py): the ambient key and its native twin,
tensor kinds a graph cannot take, random operations redirected to a capture's own generator,
pruning of collected callables, and Hugging Face's automatic compilation turned off."""

from __future__ import annotations

import gc
import types

import pytest
import torch

import graphtree
from graphtree import _native, _torch
from graphtree.tree import ambient, manager
from graphtree.tree.inputs import read_call
from graphtree.tree.readable import Unsupported, tensor_kind


def _switches():
    """Context managers, each changing one thing ambient.state() must see."""
    yield torch.no_grad()
    yield torch.inference_mode()
    yield torch.backends.cudnn.flags(enabled=False)
    yield torch.backends.cudnn.flags(enabled=True, benchmark=True)
    yield torch.backends.cudnn.flags(enabled=True, deterministic=True)
    yield torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH])


class _Set:
    """Set a global switch for a ``with`` block."""

    def __init__(self, set_, get, value):
        self.set, self.get, self.value = set_, get, value

    def __enter__(self):
        self.old = self.get()
        self.set(self.value)

    def __exit__(self, *exc):
        self.set(self.old)


_GLOBALS = [
    _Set(torch.set_default_dtype, torch.get_default_dtype, torch.float64),
    _Set(torch.use_deterministic_algorithms, torch.are_deterministic_algorithms_enabled, True),
    _Set(torch.set_float32_matmul_precision, torch.get_float32_matmul_precision, "medium"),
    _Set(
        lambda v: setattr(torch.backends.cuda.matmul, "allow_tf32", v),
        lambda: torch.backends.cuda.matmul.allow_tf32,
        True,
    ),
    _Set(
        lambda v: setattr(torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction", v),
        lambda: torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        False,
    ),
    _Set(torch.backends.cuda.enable_math_sdp, torch.backends.cuda.math_sdp_enabled, False),
]


@pytest.mark.parametrize("i", range(len(_GLOBALS) + 6))
def test_every_switch_changes_the_ambient_state_and_the_native_twin_agrees(i):
    native = _native.wait(600)
    before = ambient._python_state()
    switch = _GLOBALS[i] if i < len(_GLOBALS) else list(_switches())[i - len(_GLOBALS)]
    with switch:
        inside = ambient._python_state()
        if native is not None:
            assert native.ambient() == inside
        assert ambient.state() == inside
        assert ambient.describe(inside)
    assert inside != before
    assert ambient._python_state() == before


def test_torchs_fp32_precision_api_is_keyed_and_raises_nothing():
    # torch 2.9's `torch.backends.cuda.matmul.fp32_precision = "tf32"` makes its legacy TF32 getters
    # raise ("mix of the legacy and new APIs"), which ambient.state() and the native ambient() read:
    # every graphed call raised (found by a CPU hunt for keying gaps, eighteenth session)
    _native.wait(600)
    b = torch.backends
    spots = [(b.cuda.matmul, "fp32_precision"), (b.cudnn.conv, "fp32_precision"), (b.cudnn.rnn, "fp32_precision")]
    old = [getattr(o, n) for o, n in spots]
    before = ambient.state()
    try:
        seen = []
        for value in ("tf32", "ieee"):
            for o, n in spots:
                setattr(o, n, value)
                now = ambient.state()  # (raised before the fix)
                assert now == ambient._python_state() and ambient.describe(now)
                seen.append(now)
        assert seen[0] != before and len(set(seen)) >= 4  # (each setting its own state, or as legacy's)
    finally:
        for (o, n), v in zip(spots, old):
            setattr(o, n, v)
    assert ambient.state() == before


def test_the_ambient_state_is_part_of_the_key_of_a_call(monkeypatch):
    from graphtree.tree import graphed as graphed_module
    from graphtree.tree.inputs import Call

    seen = []
    monkeypatch.setattr(graphed_module, "_cuda_ok", True)  # as on a GPU: the call reaches its tree
    monkeypatch.setattr(graphed_module, "read_call", lambda a, k, b: Call(a, None, ("x",), 0, False, -1, -1, (), 1))
    monkeypatch.setattr(graphed_module._manager, "run", lambda gc_, call, device: seen.append(call.key))
    g = graphtree.graphed(lambda x: x, name="keyed")
    g("s")
    with torch.no_grad():
        g("s")
    assert seen[0] == ("x", ambient.state())
    assert seen[1][0] == "x" and seen[1][1] != seen[0][1]


def test_a_global_the_function_reads_is_part_of_the_key_of_a_call(monkeypatch):
    from graphtree.tree import graphed as graphed_module
    from graphtree.tree.inputs import Call

    seen = []
    monkeypatch.setattr(graphed_module, "_cuda_ok", True)
    monkeypatch.setattr(graphed_module, "read_call", lambda a, k, b: Call(a, None, ("x",), 0, False, -1, -1, (), 1))
    monkeypatch.setattr(graphed_module._manager, "run", lambda gc_, call, device: seen.append(call.key))
    g = graphtree.graphed(_times_factor)
    g("s")
    monkeypatch.setitem(globals(), "FACTOR", 3)
    g("s")
    assert seen[0][-1] == ("reads", (("FACTOR", int, 2),)) and seen[1][-1] == ("reads", (("FACTOR", int, 3),))


FACTOR = 2


def _times_factor(x):
    return x * FACTOR


def test_tensor_kinds_a_graph_cannot_take_are_named():
    dense = torch.zeros(3)
    assert tensor_kind(dense) is None
    assert tensor_kind(torch.nn.Parameter(dense)) is None
    assert tensor_kind(dense.to_sparse()) == "a sparse_coo tensor"
    assert tensor_kind(torch.zeros(3, device="meta")) == "a meta tensor"
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    assert tensor_kind(nested) == "a nested tensor"

    class Sub(torch.Tensor):
        pass

    assert tensor_kind(dense.as_subclass(Sub)) == "a tensor subclass (Sub)"
    with pytest.raises(Unsupported, match="input 1 is a sparse_coo tensor"):
        read_call((1, dense.to_sparse()), {}, None)
    assert _torch.readable_storage(dense.to_sparse()) is None
    assert _torch.readable_storage(dense) is not None


def test_random_ops_draw_from_the_stand_in_of_their_generator():
    standin, own = torch.Generator().manual_seed(7), torch.Generator().manual_seed(3)
    watch = _torch.StateWatch({})
    key = _torch.generator_key
    watch.standin_of = lambda g: standin if g is None or key(g) == key(own) else g
    own_state = own.get_state()

    def draws():
        return (
            torch.randn(64),
            torch.rand_like(torch.zeros(8)),
            torch.randint(0, 9, (4,)),
            torch.randperm(5),
            torch.rand(6, generator=own),
        )

    with watch:
        a = draws()
        kept = torch.ops.aten.native_dropout.default(torch.ones(10), 0.5, False)  # not training: no draw
    standin.manual_seed(7)
    with watch:
        b = draws()
    for x, y in zip(a, b):  # the same stand-in state gives the same numbers: they came from it
        assert torch.equal(x, y)
    assert torch.equal(kept[0], torch.ones(10))
    assert torch.equal(own.get_state(), own_state)  # the explicit generator did not move: its stand-in did
    before = torch.get_rng_state()
    with watch:
        torch.randn(64)
    assert torch.equal(torch.get_rng_state(), before)  # nor did the default one


def test_the_explicit_generator_of_a_random_op_is_found():
    gen = torch.Generator()
    assert _torch.generator_of(torch.ops.aten.randn.generator, ((3,),), {"generator": gen}) is gen
    assert _torch.generator_of(torch.ops.aten.randn.default, ((3,),), {}) is None
    assert _torch.generator_of(torch.ops.aten.normal_.default, (torch.zeros(2), 0.0, 1.0), {}) is None


def test_a_collected_graphed_callable_is_pruned_at_the_next_step():
    tree = manager.TreeManager(device=0)

    def node(gid, children=()):
        n = types.SimpleNamespace(key=(gid, ()), children={}, parent=None, first=None, branches=list)
        for c in children:
            n.children.setdefault(c.key, []).append(c)
            c.parent = n
        return n

    below = node(3)
    dead = node(2, [below])
    live = node(1)
    for n in (dead, live):
        tree.walk.root.children.setdefault(n.key, []).append(n)
    tree.warmed.update({(2, "k"): 1, (1, "k"): 1})
    tree.memory._pool = object()  # (as a recording made it)
    g = graphtree.graphed(lambda x: x, name="doomed")
    g.id = 2  # the collected callable's recordings are those keyed by its id
    manager._collected.append(2)  # what its finalizer does
    tree.new_step(())
    assert list(tree.walk.root.children) == [(1, ())]
    assert dead.children == {} and below.parent is None  # unlinked: freed without the collector
    assert tree.warmed == {(1, "k"): 1}
    assert tree.memory.has_pool  # a recording is left: the pool stays
    manager._collected.append(1)
    tree.new_step(())
    assert tree.walk.root.children == {} and not tree.memory.has_pool  # empty: the pool goes


def test_dropping_a_graphed_callable_reports_its_id():
    g = graphtree.graphed(lambda x: x, name="dropped")
    gid = g.id
    del g
    gc.collect()
    assert gid in manager._collected


def test_graphing_a_transformers_model_turns_its_automatic_compile_off():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.generation_config = types.SimpleNamespace(disable_compile=None)
            self.lin = torch.nn.Linear(2, 2)

        def _valid_auto_compile_criteria(self, *a):
            return True

        def forward(self, x):
            return self.lin(x)

    m = Model()
    graphtree.graphed(m.forward)
    assert m.generation_config.disable_compile is True
    kept = Model()
    kept.generation_config.disable_compile = False  # the user's explicit choice stays
    graphtree.graphed(kept)
    assert kept.generation_config.disable_compile is False
    plain = torch.nn.Linear(2, 2)
    graphtree.graphed(plain)
    assert not hasattr(plain, "generation_config")


def test_compiled_code_calls_a_graphed_function_outside_its_trace():
    g = graphtree.graphed(lambda x: x * 3, name="inner")

    def outer(x):
        return g(x + 1) - 1

    explained = torch._dynamo.explain(outer)(torch.ones(4))
    assert explained.graph_break_count >= 1
    compiled = torch.compile(outer, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(4)), torch.full((4,), 5.0))
    torch._dynamo.reset()


def test_a_signature_shows_the_arguments_not_the_ambient_state():
    from graphtree.tree.node import signature

    key = (1, ((torch.Size([4, 8]), torch.float32, (8, 1)), (int, 2), ambient.state(), ("training", False)))
    node = types.SimpleNamespace(name="step", key=key)
    assert signature(node) == "step(float32[4, 8], 2, eval)"


def test_compiled_code_that_builds_modules_compiles_once_with_graphtrees_hooks_installed():
    """graphtree's module-registration hook, traced by torch.compile, made dynamo guard on the
    registration epoch it then bumped: a recompilation on every call (Hugging Face's compiled
    generate() hit the recompile limit on the H100 once graphed() had installed the hook)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from graphtree.tree import state_epoch

    state_epoch.watch_parameter_changes()

    def f(x: torch.Tensor) -> torch.Tensor:
        layers = torch.nn.ModuleList()
        layers.append(torch.nn.Identity())  # add_module: the registration hook runs in the trace
        return layers[0](x) * 2

    torch._dynamo.reset()
    counters.clear()
    g = torch.compile(f, backend="eager")
    x = torch.ones(3)
    epoch = state_epoch.param_epoch()
    for _ in range(4):
        assert torch.equal(g(x), x * 2)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    torch.nn.ModuleList().append(torch.nn.Identity())  # outside compiled code the epoch still moves
    assert state_epoch.param_epoch() > epoch
    torch._dynamo.reset()
