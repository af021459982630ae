"""A module that cannot be graphed whole runs with its parts graphed (graphtree.tree.parts), on the
CPU: which submodules are parts, how they are put in place and back, and the size floor. The GPU
half (a detector graphed whole, a module with a data-dependent shape) is tests/gpu/test_parts_gpu.py."""

from __future__ import annotations

import threading
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import graphtree
from graphtree.tree.graphed import GraphedCallable, GraphedPart
from graphtree.tree.parts import MIN_PART_OPS, Parts, graphable_children


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        self.act = nn.ReLU()  # no state: not a part
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])  # looked through
        self.done = graphtree.graphed(nn.Linear(4, 4))  # graphed by the user already: left alone
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act(self.body(x))
        for b in self.blocks:
            x = b(x)
        return self.head(self.done(x))


class _Recorder:
    """A stand-in for a graphed part: counts its calls and runs the part's own forward."""

    graphtree_callable = True
    is_part = True

    def __init__(self, fn: Any, name: str) -> None:
        self.fn, self.name, self.calls, self.small = fn, name, 0, False
        self.verdicts = self  # (what the parts ask of its verdicts: too_small)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(*args, **kwargs)

    def too_small(self) -> bool:
        return self.small

    def parts(self) -> list[str]:
        return [f"{self.name}.inner"] if self.name == "Net.body" else []


def _parts(net: nn.Module) -> tuple[Parts, dict[str, _Recorder]]:
    made: dict[str, _Recorder] = {}

    def make(fn: Any, *, name: str) -> _Recorder:
        made[name] = _Recorder(fn, name)
        return made[name]

    return Parts(net, "Net", make), made


def test_parts_are_the_children_with_state_through_containers_and_not_those_graphed_already() -> None:
    net = _Net()
    names = [name for name, _ in graphable_children(net)]
    assert names == ["body", "blocks.0", "blocks.1", "head"]
    with warnings.catch_warnings():  # (torch 2.13 deprecates TorchScript; models still carry it)
        warnings.simplefilter("ignore", DeprecationWarning)
        net.head = torch.jit.script(nn.Linear(4, 2))  # TorchScript's forward is no attribute to set
    assert [name for name, _ in graphable_children(net)] == ["body", "blocks.0", "blocks.1"]


def test_the_parts_are_in_place_while_the_module_runs_and_put_back_after() -> None:
    net = _Net()
    x = torch.randn(3, 4)
    want = net(x)
    parts, made = _parts(net)
    got = parts.run(net, (x,), {})
    assert torch.equal(got, want)
    assert sorted(made) == ["Net.blocks.0", "Net.blocks.1", "Net.body", "Net.head"]
    assert all(r.calls == 1 for r in made.values()), {n: r.calls for n, r in made.items()}
    # put back: the submodules' forward is their class's again, and calling them reaches no part
    assert "forward" not in net.body.__dict__ and "forward" not in net.head.__dict__
    net(x)
    assert all(r.calls == 1 for r in made.values())
    assert parts.names() == ["Net.body", "Net.body.inner", "Net.blocks.0", "Net.blocks.1", "Net.head"]


def test_a_forward_set_on_the_instance_is_wrapped_and_restored() -> None:
    net = _Net()
    seen = []

    def own(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape)
        return nn.Linear.forward(net.head, x)

    net.head.forward = own  # type: ignore[method-assign]
    parts, made = _parts(net)
    parts.run(net, (torch.randn(2, 4),), {})
    assert made["Net.head"].fn is own and seen == [torch.Size([2, 4])]
    assert net.head.__dict__["forward"] is own


def test_parts_are_put_back_when_the_module_raises_and_too_small_ones_leave_for_good() -> None:
    net = _Net()
    parts, made = _parts(net)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        parts.run(net, (torch.randn(2, 5),), {})
    assert not any("forward" in m.__dict__ for m in (net.body, net.head, *net.blocks))
    made["Net.head"].small = True
    parts.run(net, (torch.randn(2, 4),), {})
    assert "Net.head" not in parts.names() and len(parts.names()) == 4


def test_two_threads_running_the_module_keep_the_parts_until_the_last_one_ends() -> None:
    net = _Net()
    parts, made = _parts(net)
    inside, release = threading.Event(), threading.Event()

    def slow(x: torch.Tensor) -> torch.Tensor:
        inside.set()
        release.wait(10)
        return net(x)

    t = threading.Thread(target=parts.run, args=(slow, (torch.randn(1, 4),), {}))
    t.start()
    assert inside.wait(10)
    parts.run(net, (torch.randn(1, 4),), {})  # ends first: the other call still has its parts
    assert "forward" in net.body.__dict__
    release.set()
    t.join(10)
    assert "forward" not in net.body.__dict__ and made["Net.body"].calls == 2


def test_a_given_up_signature_of_a_module_runs_with_its_parts_and_others_do_not() -> None:
    net = _Net()
    gc = GraphedCallable(net, name="Net")
    x = torch.randn(2, 4)
    call = SimpleNamespace(key=("k",), arguments=lambda: ((x,), {}))
    before = len(gc.parts())
    gc.run_eager(call, "churn")  # not given up (the churn guard's eager run): no parts
    assert before == 0 and gc.parts() == []
    gc.verdicts.give_up(("k",), "uploads host values")
    assert torch.equal(gc.run_eager(call, "uploads host values"), net(x))
    assert gc.parts() == ["Net.body", "Net.blocks.0", "Net.blocks.1", "Net.head"]
    assert graphtree.stats().eager.get("uploads host values", 0) >= 1


def test_a_part_has_a_size_floor_and_a_function_the_user_graphed_has_none() -> None:
    part = GraphedCallable(nn.Linear(2, 2), name="Net.head", min_ops=MIN_PART_OPS)
    assert part.is_part and not part.verdicts.too_small()
    reason = part.verdicts.size_reason(2)
    assert reason is not None and "`Net.head` runs 2 operator(s), fewer than 16" in reason and part.verdicts.too_small()
    # another signature (an early return was the small one) big enough: the part stays
    assert part.verdicts.size_reason(MIN_PART_OPS) is None and not part.verdicts.too_small()
    assert part.verdicts.size_reason(1) is not None and not part.verdicts.too_small()
    user = GraphedCallable(lambda x: x)
    assert not user.is_part and user.verdicts.size_reason(0) is None


def test_parts_false_keeps_the_whole_module_eager_and_the_option_is_checked() -> None:
    net = _Net()
    gc = GraphedCallable(net, name="Net", parts=False)
    gc.verdicts.give_up(("k",), "r")
    gc.run_eager(SimpleNamespace(key=("k",), arguments=lambda: ((torch.randn(1, 4),), {})), "r")
    assert gc.parts() == [] and "forward" not in net.body.__dict__
    with pytest.raises(ValueError, match="parts must be True or False"):
        graphtree.graphed(net, parts="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="parts must be True or False"):
        graphtree.graphed(parts=1)  # type: ignore[arg-type]


class _Decorated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @graphtree.graphed
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_what_is_graphed_compiled_or_hooked_inside_is_no_part() -> None:
    net = _Net()
    net.head.forward = graphtree.graphed(net.head.forward)  # type: ignore[method-assign]  # the user's
    net.extra = _Decorated()  # @graphed on forward in its class: the user's too
    net.blocks[0] = torch.compile(nn.Linear(4, 4))  # torch.compile's module: left as compiled
    seen = []
    net.body[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))  # a replay would skip it
    names = [name for name, _ in graphable_children(net)]
    assert names == ["body.0", "body.2", "blocks.1"], names  # body looked through: its hook stays live


def test_a_submodule_two_levels_share_gets_each_levels_forward_back_in_order() -> None:
    """T5 shares its embedding between the model and its decoder: the decoder's parts must wrap the
    class's forward, not the model's part of it, and give the model's part back when they end."""
    emb = nn.Linear(4, 4)
    dec = nn.Module()
    dec.emb = emb
    top = nn.Module()
    top.emb, top.dec = emb, dec
    outer, outer_made = _parts(top)
    inner, inner_made = _parts(dec)
    during = {}

    def top_forward(x: torch.Tensor) -> torch.Tensor:
        def dec_forward(y: torch.Tensor) -> torch.Tensor:
            return emb(emb(y))

        y = inner.run(dec_forward, (emb(x),), {})
        during["after inner"] = emb.__dict__.get("forward")
        return y

    outer.run(top_forward, (torch.randn(1, 4),), {})
    assert outer.names() == ["Net.emb"]  # reached twice (itself, and through dec): one part
    assert inner_made["Net.emb"].fn.__func__ is nn.Linear.forward  # not the outer part
    assert during["after inner"] is outer_made["Net.emb"]  # the outer part back while the top runs
    assert "forward" not in emb.__dict__  # and nothing once both ended
    assert outer_made["Net.emb"].calls == 1 and inner_made["Net.emb"].calls == 2
    assert sorted(outer_made) == ["Net.emb"]


def test_a_part_runs_eagerly_on_a_call_where_hooks_appeared_below_it() -> None:
    """A hook registered below a part after it was made (a user's feature hook, FlopCounterMode's
    global ones): a part must not replay past it."""
    net = _Net()
    part = GraphedPart(net.body.forward, name="Net.body", min_ops=MIN_PART_OPS)
    x = torch.randn(2, 4)
    before = dict(graphtree.stats().eager)
    seen = []
    handle = net.body[2].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        assert torch.equal(part(x), net.body(x))
    finally:
        handle.remove()
    assert len(seen) == 2  # the hook ran in the part's call too
    grown = {r: n - before.get(r, 0) for r, n in graphtree.stats().eager.items() if n != before.get(r, 0)}
    hooked = [r for r in grown if "hook" in r]
    hook = "test_a_part_runs_eagerly_on_a_call_where_hooks_appeared_below_it.<locals>.<lambda>"
    assert hooked == [f"`Net.body` runs module hooks a replay would not run: `2` holds a forward hook ({hook})"]
    assert grown[hooked[0]] == 1, grown  # its parts (`2` among them, its hook around it) went on to the tree
    part(x)  # without the hook: on to the tree (here, no CUDA)
    assert graphtree.stats().eager.get("no CUDA", 0) >= 1
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:  # a global hook (FlopCounterMode registers some) for one call: that call runs eagerly
        part(x)
        assert any("global module hooks" in r for r in graphtree.stats().eager), graphtree.stats().eager
    finally:
        handle.remove()


def test_two_modules_sharing_a_submodule_in_two_threads_leave_it_as_it_was() -> None:
    emb = nn.Linear(4, 4)
    dec, top = nn.Module(), nn.Module()
    dec.emb = top.emb = emb
    inner, inner_made = _parts(dec)
    outer, outer_made = _parts(top)
    in_a, in_b, b_done = threading.Event(), threading.Event(), threading.Event()

    def a_body() -> None:  # thread A: the decoder's parts in place first, taken off first
        in_a.set()
        in_b.wait(10)

    def b_body() -> None:  # thread B: the model's parts on top, taken off last
        in_b.set()
        b_done.wait(10)

    a = threading.Thread(target=inner.run, args=(a_body, (), {}))
    a.start()
    assert in_a.wait(10)
    b = threading.Thread(target=outer.run, args=(b_body, (), {}))
    b.start()
    a.join(10)
    assert emb.__dict__["forward"] is outer_made["Net.emb"]  # B's part stays while B runs
    b_done.set()
    b.join(10)
    assert "forward" not in emb.__dict__
    assert inner_made["Net.emb"].fn.__func__ is nn.Linear.forward is outer_made["Net.emb"].fn.__func__


def test_one_step_marks_the_outermost_block_and_unwinds_on_an_exception() -> None:
    from graphtree.tree import manager

    with manager.one_step() as outer:
        assert outer is not None  # the trees' path lengths at its start (none on this CPU thread)
        with manager.one_step() as inner:
            assert inner is None  # nested: the outermost module copies what it returns
        with pytest.raises(RuntimeError), manager.one_step():
            raise RuntimeError("boom")
        assert manager._tls.one_step == 1
    assert manager._tls.one_step == 0
    assert manager.step_outputs({}) == set()


def test_a_dropped_module_graphed_in_parts_is_freed_without_the_collector() -> None:
    """Its recordings go at the next step once it is collected (weakref.finalize): a cycle through
    its parts would wait for the cyclic collector."""
    import gc
    import weakref

    gc.disable()
    try:
        gc_ = GraphedCallable(_Net(), name="Net")
        ref = weakref.ref(gc_)
        del gc_
        assert ref() is None
    finally:
        gc.enable()
