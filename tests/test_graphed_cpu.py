"""The core on a machine without CUDA (CI), and the parts of it that need no GPU."""

import dataclasses
import logging

import pytest
import torch

import graphtree
from graphtree.tree.inputs import Bucketing, flatten, read_call, unflatten
from graphtree.tree.outputs import Constant, FromInput, FromPool, OutputPlan, Repeat, stale_message
from graphtree.tree.readable import Unsupported

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA behaviour")


@pytest.fixture(autouse=True)
def fresh():
    graphtree.reset()
    yield
    graphtree.reset()


def test_public_api_is_exported():
    for name in ["graphed", "mark_step", "reset", "stats", "describe", "mark_static", "profile", "Stats"]:
        assert name in graphtree.__all__ and hasattr(graphtree, name)


@needs_no_cuda
def test_without_cuda_everything_runs_eagerly(caplog):
    calls = []

    @graphtree.graphed
    def f(x, k=2):
        calls.append(1)
        return {"y": x * k, "n": 1}

    with caplog.at_level(logging.WARNING, logger="graphtree"):
        for i in range(3):
            out = f(torch.full((3,), float(i)), k=3)
            assert torch.equal(out["y"], torch.full((3,), 3.0 * i)) and out["n"] == 1
    assert len(calls) == 3
    s = graphtree.stats()
    assert s.cuda is False and "no CUDA" in s.note and s.eager == {"no CUDA": 3}
    assert s.recordings == s.replays == 0
    assert sum("no CUDA" in r.getMessage() for r in caplog.records) == 1  # logged once
    assert "no trees" in graphtree.describe()
    assert graphtree.describe(format="dot").startswith("digraph")


@needs_no_cuda
def test_modules_methods_and_decorator_with_options():
    lin = torch.nn.Linear(4, 2)
    g = graphtree.graphed(lin)
    x = torch.randn(3, 4)
    assert torch.equal(g(x), lin(x))
    m = graphtree.graphed(lin.forward, name="fwd")
    assert m.name == "fwd" and torch.equal(m(x), lin(x))

    @graphtree.graphed(buckets=[1, 2, 4], warmup=2)
    def h(x):
        return x + 1

    assert isinstance(h, graphtree.GraphedCallable) and h.bucketing.sizes == [1, 2, 4]
    assert torch.equal(h(x), x + 1)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(TypeError, match="callable"):
        graphtree.graphed(3)
    with pytest.raises(ValueError, match="buckets"):
        graphtree.graphed(lambda x: x, buckets=[0, 4])
    with pytest.raises(ValueError, match="warmup"):
        graphtree.graphed(lambda x: x, warmup=-1)
    with pytest.raises(ValueError, match="max_rerecords"):
        graphtree.graphed(lambda x: x, max_rerecords=-1)
    with pytest.raises(TypeError, match="tensor"):
        graphtree.mark_static([1, 2])
    with pytest.raises(ValueError, match="format"):
        graphtree.describe(format="svg")
    with pytest.raises(ValueError, match="buckets"):
        graphtree.graphed(lambda x: x).warm_up(torch.ones(2))


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"buckets": 4}, "buckets"),
        ({"buckets": []}, "buckets"),
        ({"buckets": [True]}, "buckets"),
        ({"buckets": [2, 0]}, "buckets"),
        ({"buckets": [1.5]}, "buckets"),
        ({"buckets": "124"}, "buckets"),
        ({"buckets": [1, 2], "bucket_dim": "x"}, "bucket_dim"),
        ({"buckets": [1, 2], "bucket_dim": -1}, "bucket_dim"),
        ({"bucket_dim": True}, "bucket_dim"),
        ({"bucket_dim": 1.0}, "bucket_dim"),
        ({"max_rerecords": "x"}, "max_rerecords"),
        ({"max_rerecords": -1}, "max_rerecords"),
        ({"max_rerecords": False}, "max_rerecords"),
        ({"warmup": 1.0}, "warmup"),
        ({"warmup": None}, "warmup"),
        ({"name": ""}, "name"),
        ({"name": 3}, "name"),
    ],
)
def test_each_option_is_checked_where_it_is_given(options, named):
    with pytest.raises(ValueError, match="must be") as e:
        graphtree.graphed(lambda x: x, **options)
    msg = str(e.value)
    value = next(iter(v for k, v in options.items() if k == named))
    assert msg.startswith(named) and repr(value) in msg and "must be" in msg, msg
    with pytest.raises(ValueError, match=named):  # the decorator form checks at once too
        graphtree.graphed(**options)


def test_good_options_are_taken_as_given():
    g = graphtree.graphed(lambda x: x, buckets=(4, 1, 2), bucket_dim=1, warmup=0, max_rerecords=0, name="f")
    assert g.bucketing.sizes == [1, 2, 4] and g.bucketing.dim == 1 and g.warmup == 0 and g.options.max_rerecords == 0
    with pytest.raises(ValueError, match=r"warm_up\(sizes"):
        g.warm_up(torch.ones(2, 2), sizes=[3])


def test_mark_static_tags_the_tensor():
    t = torch.zeros(2)
    assert graphtree.mark_static(t) is t and t._graphtree_static is True


def test_flatten_round_trips_and_keeps_the_fast_path():
    x = torch.ones(2)
    leaves, spec = flatten((x, 3), {})
    assert spec is None and leaves[0] is x and leaves[1] == 3
    leaves, spec = flatten((x, [x, 2.0]), {"k": x, "s": "a"})
    args, kwargs = unflatten(leaves, spec)
    assert args[0] is x and args[1][0] is x and kwargs == {"k": x, "s": "a"}


def test_signature_rules():
    # CPU tensors never reach a tree: they are the CPU fallback's reason
    with pytest.raises(Unsupported, match="CPU tensor"):
        read_call((torch.ones(2),), {}, None)
    with pytest.raises(Unsupported, match="argument of type object"):
        read_call((object(),), {}, None)
    # a 0-dim CPU tensor (a step count) is keyed by dtype, its value filled in per call (stride None)
    for bucketing in (None, Bucketing([4])):
        call = read_call((torch.tensor(3), torch.tensor(0.5)), {}, bucketing)
        assert call.key == ((torch.Size([]), torch.int64, None), (torch.Size([]), torch.float32, None)), call.key
        assert call.device == -2
        with pytest.raises(Unsupported, match="requires grad"):
            read_call((torch.tensor(0.5, requires_grad=True),), {}, bucketing)
    a = read_call((1, 2.0, True, "s", None), {}, None).key
    b = read_call((1.0, 2.0, True, "s", None), {}, None).key
    assert a != b  # 1 and 1.0 are different recordings
    assert read_call((1,), {}, None).key != read_call((2,), {}, None).key
    assert read_call((1,), {"k": 2}, None).key != read_call((1,), {"k": 3}, None).key


def test_keyword_names_and_containers_are_part_of_the_signature():
    # The same leaves passed another way are another call: f(x, a=y) and f(x, b=y) may do
    # different things, and replaying one's recording for the other would be wrong.
    calls = [((1, 2), {}), ((1,), {"a": 2}), ((1,), {"b": 2}), ((), {"a": 1, "b": 2}), ((1, [2]), {}), (([1, 2],), {})]
    keys = [read_call(args, kwargs, None).key for args, kwargs in calls]
    assert len(set(keys)) == len(calls), keys
    for args, kwargs in calls:  # and each rebuilds the call it read
        assert read_call(args, kwargs, None).arguments() == (args, kwargs)


def test_flat_keyword_calls_skip_the_pytree():
    x = torch.ones(2)
    leaves, spec = flatten((x, 3), {"out": x, "k": None})
    assert list(leaves) == [x, 3, x, None] and spec == (2, ("out", "k"))
    args, kwargs = unflatten(leaves, spec)
    assert args == (x, 3) and kwargs["out"] is x and kwargs == {"out": x, "k": None}


def test_keyword_objects_a_pytree_takes_as_leaves_skip_it_too_and_containers_do_not():
    import collections

    class Cache:  # no pytree registration: a leaf, as transformers' StaticCache is
        pass

    x, cache = torch.ones(2), Cache()
    leaves, spec = flatten((x,), {"past_key_values": cache, "use_cache": True})
    assert list(leaves) == [x, cache, True] and spec == (1, ("past_key_values", "use_cache"))
    assert unflatten(leaves, spec) == ((x,), {"past_key_values": cache, "use_cache": True})
    Pair = collections.namedtuple("Pair", "a b")
    for container in ([x, 1], {"a": x}, Pair(x, 1), collections.OrderedDict(a=x), collections.deque([x])):
        leaves, spec = flatten((x,), {"c": container})
        assert not isinstance(spec, tuple) and any(leaf is x for leaf in list(leaves)[1:]), container  # the pytree
        _, kwargs = unflatten(leaves, spec)
        assert type(kwargs["c"]) is type(container)


def test_buckets_pick_the_next_size():
    b = Bucketing([8, 1, 4, 2])
    assert b.sizes == [1, 2, 4, 8]
    assert [b.bucket_for(n) for n in (1, 3, 4, 5, 8, 9)] == [1, 4, 4, 8, 8, None]
    with pytest.raises(ValueError, match="non-empty"):
        Bucketing([])


def test_output_plan_classifies_outputs():
    x = torch.randn(4, 3)
    y = x * 2
    out = {"y": y, "row": y[1], "x": x, "n": 7, "again": y}
    pool = {y.untyped_storage().data_ptr()}
    plan, leaves = OutputPlan.from_recording(out, [x], lambda p: p in pool, "fn", bucket=4, pad_dim=0)
    kinds = [type(k) for k in plan.kinds]
    # leaves in insertion order: y, row, x, n, again
    assert kinds == [FromPool, FromPool, FromInput, Constant, Repeat]
    assert len(plan.groups) == 1 and plan.groups[0].ptr == y.untyped_storage().data_ptr()  # y and its row: one storage
    assert plan.nbytes == y.untyped_storage().nbytes()
    assert "fn" in plan.groups[0].message and ".clone()" in plan.groups[0].message
    restored = plan.finish(list(leaves), n=2)  # bucketed: leaves with 4 rows are cut to 2
    assert restored["y"].shape == (2, 3) and restored["row"].shape == (3,) and restored["n"] == 7
    assert restored["again"] is restored["y"]


def test_stale_message_names_function_output_and_fix():
    msg = stale_message("decode", [0, 2], "float32 [2, 5]")
    assert "output 0, 2 of `decode`" in msg and ".clone()" in msg and "mark_step" in msg


def test_stats_render_and_dict():
    s = graphtree.stats()
    d = s.as_dict()
    assert set(d) >= {"recordings", "replays", "warmups", "eager", "pool_bytes", "cuda", "note"}
    assert "recordings" in str(s)


def test_private_apis_are_version_gated(monkeypatch):
    from graphtree import _torch
    from graphtree._torch import gate

    monkeypatch.setattr(gate, "VERSION_SUPPORTED", False)
    monkeypatch.setattr(gate, "_warned_version", False)
    with (
        pytest.warns(RuntimeWarning, match="tested with torch 2.11"),
        pytest.raises(_torch.PrivateAPIMissing, match="_no_such_api"),
    ):
        _torch._private("_no_such_api")


# --- modules, methods and objects (issue: the models people run) ----------------------------------
def test_graphed_module_is_the_module_it_wraps():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    g = graphtree.graphed(net)
    assert isinstance(g, torch.nn.Module) and isinstance(g, graphtree.GraphedModule)
    assert list(g.state_dict()) == list(net.state_dict())  # no prefix
    assert all(p is q for p, q in zip(g.parameters(), net.parameters()))
    assert g[0] is net[0] and len(g) == 3 and [n for n, _ in g.named_modules()] == ["", "0", "1", "2"]
    assert g.eval() is g and not net.training and not net[0].training
    g.train()
    assert net.training
    g.load_state_dict({k: torch.zeros_like(v) for k, v in net.state_dict().items()})
    assert net[0].weight.abs().sum() == 0  # loaded into the original
    g.extra = 7  # plain attributes live on the original
    assert net.extra == 7 and g.extra == 7
    g.to(torch.float64)
    assert net[0].weight.dtype == torch.float64
    x = torch.randn(2, 4, dtype=torch.float64)
    assert torch.equal(g(x), net(x))
    assert "graphed(Sequential" in repr(g)


def test_a_graphed_module_calls_graphtree_directly_and_nn_modules_call_where_that_would_do_more(monkeypatch):
    """GraphedModule.__call__ skips nn.Module.__call__'s two frames where they would only call
    forward; a hook on it, a global module hook, m.compile() and a torch.jit trace still get them."""
    net = torch.nn.Linear(4, 3)
    g = graphtree.graphed(net)
    x = torch.randn(2, 4)
    want = net(x)
    module_calls = []
    original = torch.nn.Module.__call__

    def counted(self, *args, **kwargs):
        module_calls.append(type(self).__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", counted)
    assert torch.equal(g(x), want)
    assert module_calls == ["Linear"], "only the wrapped module's own call (the eager run's, on CPU)"
    seen = []
    handle = g.register_forward_hook(lambda m, i, o: seen.append("own") or o * 2)
    assert torch.equal(g(x), want * 2) and seen == ["own"]
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: seen.append(type(m).__name__))
    try:
        g(x)
    finally:
        handle.remove()
    assert seen == ["own", "GraphedModule", "Linear"]
    object.__setattr__(g, "_compiled_call_impl", lambda *a, **k: "compiled")  # (nn.Module.compile's, on g itself)
    assert g(x) == "compiled"
    object.__setattr__(g, "_compiled_call_impl", None)
    module_calls.clear()
    assert torch.equal(g(x), want) and module_calls == ["Linear"]
    module_calls.clear()
    torch.jit.trace(g, x, check_trace=False)  # (nn.Module._call_impl then calls _slow_forward, which records scopes)
    assert module_calls[:1] == ["GraphedModule"], module_calls


class _Scaled(torch.nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = torch.nn.Parameter(torch.tensor(k))

    @graphtree.graphed
    def forward(self, x):
        return x * self.k


@needs_no_cuda
def test_a_decorated_method_runs_eagerly_and_correctly_without_cuda():
    a, b = _Scaled(2.0), _Scaled(3.0)
    x = torch.ones(3)
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(a(x), x * 2) and torch.equal(b(x), x * 3)
    assert graphtree.stats().eager == {"no CUDA": 6}


def test_object_arguments_are_keyed_by_type_and_plain_state():
    from graphtree.tree.object_state import HeldTensors, read_object

    @dataclasses.dataclass
    class State:
        t: torch.Tensor
        n: int
        items: list

    def key(obj):
        return read_object(obj, HeldTensors())

    a = State(torch.zeros(2, 3), 1, [1.0, "x"])
    assert key(a) == key(State(torch.ones(2, 3), 1, [1.0, "x"]))  # values are not keyed: layouts are
    assert key(a) != key(State(torch.zeros(3, 2), 1, [1.0, "x"]))
    assert key(a) != key(State(torch.zeros(2, 3), 2, [1.0, "x"]))
    assert key(a) != key(State(torch.zeros(2, 3), 1, [1.0, "y"]))
    lin = torch.nn.Linear(2, 2)
    k_train = key(lin)
    lin.eval()
    assert key(lin) != k_train  # training flag
    assert key(lin) != key(torch.nn.Linear(2, 2).eval())  # another instance: its own recordings

    class Opaque:
        __slots__ = ()

    with pytest.raises(Unsupported, match="argument of type Opaque"):
        key(Opaque())
    deep: list = []
    for _ in range(10):
        deep = [deep]
    with pytest.raises(Unsupported, match="nest deeper"):
        read_call((State(torch.zeros(1), 0, deep),), {}, None)
    with pytest.raises(Unsupported, match="more than 20000 values"):
        key(State(torch.zeros(1), 0, list(range(30_000))))
    cyclic = State(torch.zeros(1), 0, [])
    cyclic.items.append(cyclic)  # a cycle is keyed, not walked forever
    assert key(cyclic) == key(cyclic) and "seen" in str(key(cyclic))


def test_slots_named_by_one_string_or_private_are_keyed_too():
    """A lone string is one slot (iterated, it was read letter by letter: its value was never
    keyed), and a private ``__slot`` lives under its mangled name (it was skipped)."""
    from graphtree.tree.object_state import HeldTensors, read_object

    class One:
        __slots__ = "step"

        def __init__(self, step: int) -> None:
            self.step = step

    class Private:
        __slots__ = ("__scale",)

        def __init__(self, scale: float) -> None:
            self.__scale = scale

    def key(obj):
        return read_object(obj, HeldTensors())

    assert key(One(1)) == key(One(1)) and key(One(1)) != key(One(2))
    assert key(Private(0.5)) == key(Private(0.5)) and key(Private(0.5)) != key(Private(2.0))


def test_functions_among_the_arguments_are_keyed_by_what_they_run():
    """A function, method, partial or builtin passed to a graphed call keys its recording: before,
    ``f(x, torch.relu)`` and ``f(x, torch.tanh)`` had one key (the type), and the second replayed
    the first's graph."""
    import functools

    from graphtree.tree.object_state import HeldTensors, read_object

    def key(obj):
        return read_object(obj, HeldTensors())

    assert key(torch.relu) != key(torch.tanh) and key(torch.relu) == key(torch.relu)

    def scaled(k):
        return lambda x: x * k

    assert key(scaled(2)) == key(scaled(2))  # the same code and closure: one recording
    assert key(scaled(2)) != key(scaled(3))  # the closure's value decides what it computes
    assert key(lambda x: x) != key(lambda x: x + 1)  # other code
    assert key(functools.partial(torch.add, alpha=2)) != key(functools.partial(torch.add, alpha=3))
    assert key(functools.partial(torch.add, alpha=2)) == key(functools.partial(torch.add, alpha=2))

    class Scale:
        def __init__(self, k: float) -> None:
            self.k = k

        def apply(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.k

    a, b = Scale(2.0), Scale(2.0)
    assert key(a.apply) == key(b.apply)  # a new bound method per access, the same state: one key
    b.k = 3.0
    assert key(a.apply) != key(b.apply)
    t = torch.zeros(3)
    assert key(t.add) != key(torch.zeros(4).add)  # a builtin method: the tensor it is bound to
    assert key(torch.nn.functional) == key(torch.nn.functional) and key(int) != key(float)

    def fact(n: int) -> int:  # refers to itself through its closure: keyed, not walked forever
        return 1 if n < 2 else n * fact(n - 1)

    assert key(fact) == key(fact)


def test_plain_values_inside_objects_are_keyed_with_their_type():
    """1, 1.0 and True are equal in Python, but ``x * cfg.scale`` computes in another dtype for
    each: an object whose value changed type must not replay the other's recording."""
    from graphtree.tree.object_state import HeldTensors, read_object

    @dataclasses.dataclass
    class Cfg:
        scale: object
        dims: list

    def key(obj):
        return read_object(obj, HeldTensors())

    keys = {key(Cfg(1, [2])), key(Cfg(1.0, [2])), key(Cfg(True, [2]))}
    assert len(keys) == 3, keys
    assert key(Cfg(1, [2])) != key(Cfg(1, [2.0])) and key(Cfg(1, [2])) == key(Cfg(1, [2]))


def test_describe_names_every_kind_of_signature_part():
    from graphtree.tree.node import signature

    @dataclasses.dataclass
    class Cache:
        k: torch.Tensor

    call = read_call((3, 2.0, "s", Cache(torch.zeros(1)), torch.nn.Linear(2, 2)), {}, None)

    class FakeNode:  # a signature reads a node's name and key only
        name = ""
        key = (1, (((2, 3), torch.float16, (3, 1)), *call.key, ("training", False)))

    assert signature(FakeNode()) == "(float16[2, 3], 3, 2.0, 's', Cache, Linear, eval)"

    class WithKeywords:
        name = ""
        key = (1, read_call((3,), {"n": 2, "s": None}, None).key)

    assert signature(WithKeywords()) == "(3, n=2, s=None)"


@pytest.mark.parametrize(
    ("error", "said"),
    [
        ("CUDA error: operation not permitted when stream is capturing", "copies to the host (.item()"),
        ("CUDA error: operation failed due to a previous error during capture", "another thread of this process"),
        (  # (seen with DistributedDataParallel made on the default stream, on four H200s)
            "CUDA error: operation would make the legacy stream depend on a capturing blocking stream",
            "Build DistributedDataParallel inside `with torch.cuda.stream(",
        ),
    ],
)
def test_a_failed_capture_is_explained_by_what_its_error_says(error, said):
    from graphtree.tree.capture import OpTracker, explain_capture_error

    tracker = OpTracker()
    tracker.last = "addmm"
    msg = explain_capture_error(RuntimeError(error), tracker, "decode_step")
    assert msg.startswith(f"capture of `decode_step` failed: `addmm` raised RuntimeError: {error}.")
    assert said in msg


def test_the_collector_is_paused_while_a_graph_is_captured_and_restored_after():
    # (the capture itself needs a GPU: tests/gpu/test_tree_gpu.py shows why the pause matters)
    import gc

    from graphtree.tree.recorder import _no_collection

    assert gc.isenabled()
    with _no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError, match="own error"), _no_collection():
        raise ValueError("the function's own error")
    assert gc.isenabled(), "restored when the capture raises"
    gc.disable()
    try:
        with _no_collection():
            pass
        assert not gc.isenabled(), "a collector the user turned off stays off"
    finally:
        gc.enable()


# --- copies (issue 45: what users do to modules) -----------------------------------------------------
def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_a_deep_copy_of_a_graphed_module_is_graphed_anew_over_a_copy_of_the_model():
    import copy

    g = graphtree.graphed(_net(), warmup=2, name="net")
    c = copy.deepcopy(g)  # EMA weights, a snapshot
    assert isinstance(c, graphtree.GraphedModule) and c is not g
    assert c.graphed_callable is not g.graphed_callable and c.graphed_callable.warmup == 2
    assert c.graphed_callable.name == "net" and c.graphed_callable.id != g.graphed_callable.id
    for a, b in zip(g.parameters(), c.parameters()):
        assert a is not b and torch.equal(a, b)
    x = torch.randn(3, 4)
    assert torch.equal(c(x), g(x))
    with torch.no_grad():
        next(c.parameters()).add_(1.0)  # the copy's weights are its own
    assert not torch.equal(c(x), g(x))
    assert list(c.state_dict()) == list(g.state_dict()) == list(_net().state_dict())


def test_a_graphed_module_saved_whole_loads_graphed(tmp_path):
    g = graphtree.graphed(_net(), max_rerecords=3)
    torch.save(g, tmp_path / "model.pt")
    back = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(back, graphtree.GraphedModule) and back.graphed_callable.options.max_rerecords == 3
    x = torch.randn(2, 4)
    assert torch.equal(back(x), g(x))


def test_a_graphed_function_and_a_graphed_method_can_be_copied():
    import copy
    import pickle

    f = graphtree.graphed(torch.sin, name="sin")
    again = pickle.loads(pickle.dumps(f))
    assert again is not f and again.name == "sin" and torch.equal(again(torch.ones(2)), torch.ones(2).sin())
    net = _net()
    m = graphtree.graphed(net.forward)
    m2 = copy.deepcopy(m)  # a method: a copy of its module
    assert m2.fn.__self__ is not net and torch.equal(m2(torch.ones(1, 4)), net(torch.ones(1, 4)))
