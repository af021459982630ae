"""Module hooks a graphed call would run (graphtree/tree/hooks.py): their Python runs on no replay,
so a call that would run one runs eagerly, with the reason; the check reads two counters per call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphtree
from graphtree.tree import hooks as _hooks
from graphtree.tree.hooks import ModuleHooks


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))


def test_a_hook_below_is_named_and_gone_once_removed() -> None:
    net = _net()
    hooks = ModuleHooks(net)
    assert hooks.reason("net") is None
    handle = net[2][0].register_forward_hook(lambda m, i, o: None)
    reason = hooks.reason("net")
    assert reason is not None and reason.startswith(
        "`net` runs module hooks a replay would not run: `2.0` holds a forward hook"
    )
    handle.remove()
    assert hooks.reason("net") is None
    pre = net[0].register_forward_pre_hook(lambda m, i: None)
    assert "`0` holds a forward pre hook" in (hooks.reason("net") or "")
    pre.remove()
    glob = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert "global module hooks" in (hooks.reason("net") or "")
    finally:
        glob.remove()
    assert hooks.reason("net") is None


def test_the_modules_own_hooks_count_only_where_its_call_runs_inside() -> None:
    net = _net()
    handle = net.register_forward_hook(lambda m, i, o: None)
    assert ModuleHooks(net).reason("net") is None  # its forward graphed: __call__ runs them around it
    reason = ModuleHooks(net, include_self=True).reason("net") or ""
    assert "the module itself holds a forward hook" in reason and "run around its replays" in reason, reason
    handle.remove()


def test_a_submodule_added_later_is_watched() -> None:
    net = _net()
    hooks = ModuleHooks(net)
    assert hooks.reason("net") is None
    extra = nn.Linear(4, 4)
    extra.register_forward_hook(lambda m, i, o: None)
    net.add_module("extra", extra)  # registered: graphtree's registration count moves
    assert "`extra` holds a forward hook" in (hooks.reason("net") or "")


def test_counters_unmoved_the_tables_are_not_read(monkeypatch) -> None:
    net = _net()
    hooks = ModuleHooks(net)
    assert hooks.reason("net") is None
    looked = []
    monkeypatch.setattr(ModuleHooks, "_find", lambda self: looked.append(1))
    for _ in range(5):
        assert hooks.reason("net") is None
    assert looked == []
    net[0].register_forward_hook(lambda m, i, o: None).remove()  # a handle made: looked at once
    hooks.reason("net")
    hooks.reason("net")
    assert looked == [1]


def test_transformers_output_recorders_write_only_into_the_call_and_do_not_count() -> None:
    pytest.importorskip("transformers")
    from transformers.utils.output_capturing import install_output_capuring_hook

    net = _net()
    install_output_capuring_hook(net[2][0], "hidden_states", 0)
    assert net[2][0]._forward_hooks  # the recorder is there, idle outside a collecting call
    assert ModuleHooks(net).reason("net") is None
    net[0].register_forward_hook(lambda m, i, o: None)
    assert "`0` holds a forward hook" in (ModuleHooks(net).reason("net") or "")


def test_a_graphed_module_whose_submodule_holds_a_hook_runs_it_on_every_call() -> None:
    net = _net()
    g = graphtree.graphed(net, parts=False)
    seen = []
    handle = net[2][0].register_forward_hook(lambda m, i, o: seen.append(o.shape))
    x = torch.randn(2, 4)
    before = dict(graphtree.stats().eager)
    for _ in range(3):
        torch.testing.assert_close(g(x), net(x))
    handle.remove()
    assert len(seen) == 6  # three graphed calls and three eager ones
    grown = {r: n - before.get(r, 0) for r, n in graphtree.stats().eager.items() if n != before.get(r, 0)}
    assert [n for r, n in grown.items() if "holds a forward hook" in r] == [3], grown
    g(x)
    assert "no CUDA" in graphtree.stats().eager  # without it: on to the tree (here, no CUDA)


def test_hook_names_fall_back_to_the_hooks_type() -> None:
    class Recorder:
        def __call__(self, m, i, o):
            return None

    assert _hooks._hook_name(Recorder()) == "test_hook_names_fall_back_to_the_hooks_type.<locals>.Recorder"


def test_fsdp2s_hooks_are_named(tmp_path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        sharded = nn.Sequential(nn.Linear(2, 2))
        fully_shard(sharded)
        reason = ModuleHooks(sharded, include_self=True).reason("step") or ""
        assert "FSDPState._pre_forward" in reason and "FSDP2 (`fully_shard`) gathers" in reason, reason
    finally:
        dist.destroy_process_group()


def test_tensor_parallelisms_hooks_do_not_count(tmp_path) -> None:
    # parallelize_module registers forward (pre-)hooks that redistribute inputs and outputs: tensors
    # in, tensors out of the call, as recorded (the four-H200 tensor-parallel decode replayed them)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
        mesh = init_device_mesh("cpu", (1,))
        parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        assert mlp[0]._forward_pre_hooks or mlp[0]._forward_hooks  # (they are there)
        assert ModuleHooks(mlp, include_self=True).reason("mlp") is None
    finally:
        dist.destroy_process_group()


_NET = _net()


def _calls_the_net(x):
    return _NET(x) * 2


def test_the_hooks_of_a_model_the_code_calls_by_name_count_too() -> None:
    # `graphed(step)` where step calls a global model: the model's hooks run inside the call, and a
    # replay would not run them; the module it reached was the graphed function's only
    global _NET
    g = graphtree.graphed(_calls_the_net)
    x = torch.randn(2, 4)
    g(x)
    g.free.part()  # (what the first call's key reads on a GPU: the models the code calls by name)
    seen = []
    handle = _NET[0].register_forward_hook(lambda m, i, o: seen.append(1))
    try:
        before = sum(n for r, n in graphtree.stats().eager.items() if "holds a forward hook" in r)
        torch.testing.assert_close(g(x), _calls_the_net(x))
        after = sum(n for r, n in graphtree.stats().eager.items() if "holds a forward hook" in r)
        assert after == before + 1 and len(seen) == 2, graphtree.stats().eager
    finally:
        handle.remove()
    old, _NET = _NET, _net()  # rebound: the new model is watched, the old one not kept
    g.free.part()
    g(x)
    assert all(h.module is not old for h in g._hooks._named)
    _NET = old
