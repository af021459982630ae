"""A churning callable's early eager run on the CPU (``_eager_now`` in tree/graphed.py,
tree/churn.py): once a graphed callable churns, a call of tensors it never met runs eagerly before
the Python path reads, keys and takes it to its tree; anything the Python path must see (tensors
met before, numbers, keywords, grad to build, a closure's tensor) still goes there. The native
signature is the stand-in of ``tests/fakes/gt_fast_hit.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gt_fast_hit import stand_in_helpers

import graphtree
from graphtree import _native
from graphtree.tree import ambient, launch_order, placement
from graphtree.tree import graphed as graphed_mod
from graphtree.tree import manager as manager_mod
from graphtree.tree.churn import LIMIT

REASON = "meets a new signature on almost every call"


class _Tree:
    """What reached ``TreeManager.call``: the calls' first tensors' shapes (the call is not run:
    warming up needs CUDA); and how often ``LaunchOrder.follow`` ordered a stream."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[int, ...]] = []
        self.follows = 0
        real = launch_order.LaunchOrder.follow

        def call(tree: Any, gc: Any, call: Any) -> Any:
            self.calls.append(tuple(call.leaves[0].shape))
            return "taken to the tree"

        def follow(order: Any) -> None:
            self.follows += 1
            real(order)

        monkeypatch.setattr(manager_mod.TreeManager, "call", call)
        monkeypatch.setattr(launch_order.LaunchOrder, "follow", follow)


@pytest.fixture
def tree(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Tree]:
    fake = stand_in_helpers(ambient=ambient._python_state)
    monkeypatch.setattr(_native, "loaded", fake)
    monkeypatch.setattr(ambient, "_checked", fake)
    monkeypatch.setattr(graphed_mod, "_cuda_ok", True)
    monkeypatch.setattr(placement, "_current_stream", abs)
    before = set(manager_mod.managers())
    _fresh()
    yield _Tree(monkeypatch)
    _fresh()
    for t in set(manager_mod.managers()) - before:  # (graphtree.reset() would synchronize a CUDA device)
        manager_mod._all_managers.discard(t)


def _fresh() -> None:
    """This thread without trees, its steps automatic (as tests/test_fast_hit.py leaves it)."""
    getattr(manager_mod._tls, "managers", {}).clear()
    manager_mod._tls.__dict__.pop("user_steps", None)


def _churn_eager_runs() -> int:
    return sum(n for r, n in graphtree.stats().eager.items() if REASON in r)


def _churning(fn: Any) -> Any:
    """``fn`` graphed, as after ``LIMIT`` warm-ups of new signatures in a row without a recording."""
    g = graphtree.graphed(fn)
    g.churn.streak = LIMIT
    return g


def test_new_tensors_of_a_churning_callable_run_eagerly_without_its_tree(tree):
    g = _churning(lambda x: x * 2 + 1)
    before = _churn_eager_runs()
    with torch.inference_mode():
        for n in range(1, 6):
            x = torch.randn(n, 3)
            assert torch.equal(g(x), x * 2 + 1)
    assert tree.calls == [], "each call is new: none reaches the tree"
    assert tree.follows == 5, "each call's stream is ordered after the tree's last call, as the tree orders it"
    assert _churn_eager_runs() - before == 5, graphtree.stats().eager


def test_tensors_met_before_go_to_the_tree_which_warms_them_up(tree):
    g = _churning(lambda x: x + 1)
    x = torch.randn(4, 3)
    with torch.inference_mode():
        g(x)
        assert g(x) == "taken to the tree"  # met: shapes may be settling
        assert g(torch.randn(4, 3)) == "taken to the tree"  # (the same shapes, other values)
    assert tree.calls == [(4, 3), (4, 3)]
    key = ("the key of", (4, 3))  # the tree then asks the rule: met tensors are not skipped
    assert g.churn.skip(key, ((((4, 3), torch.float32, (3, 1)),), 0)) is False


def test_a_callable_not_churning_takes_every_call_to_its_tree(tree):
    g = graphtree.graphed(lambda x: x + 1)
    g.churn.streak = LIMIT - 1
    with torch.inference_mode():
        for n in range(1, 4):
            g(torch.randn(n, 3))
    assert tree.calls == [(1, 3), (2, 3), (3, 3)]


HELD = torch.ones(3)


@pytest.mark.parametrize("what", ["a float", "a keyword", "grad to build", "a closure's tensor"])
def test_calls_the_python_path_must_read_are_not_run_early(tree, what):
    held = torch.ones(3)
    fns = {
        "a float": lambda x, t=0.5: x * t,
        "a keyword": lambda x, t=0.5: x * t,
        "grad to build": lambda x: x * 2,
        "a closure's tensor": lambda x: x * held,
    }
    g = _churning(fns[what])
    before = _churn_eager_runs()
    x = torch.randn(2, 3, requires_grad=what == "grad to build")
    with torch.inference_mode(what != "grad to build"):
        if what == "a float":
            g(x, 0.7)
        elif what == "a keyword":
            g(x, t=0.7)
        else:
            g(x)
    assert _churn_eager_runs() == before, f"{what}: not run early"
    # (with grad to build, the Python path's autograd rule runs it: these CPU tensors reach no tree)
    assert tree.calls == ([] if what == "grad to build" else [(2, 3)]), f"{what}: the Python path reads it"


def test_a_call_names_its_tensors_only_when_it_is_of_plain_tensors_alone():
    """``Call.tensors``: what ``Churn.skip`` notes beside the key, as the native signature reads a
    call (``(parts, device)``); None for anything the early run leaves to the Python path."""
    from graphtree.tree.inputs import Call

    x, y = torch.randn(2, 3), torch.randn(4)
    parts = (((2, 3), torch.float32, (3, 1)), ((4,), torch.float32, (1,)))
    key = (*parts, ("ambient state",))

    def call(leaves: tuple[Any, ...], key: tuple[Any, ...], device: int = 0, spec: Any = None) -> Call:
        return Call(leaves, spec, key, device, False, -1, -1, (), len(leaves))

    assert call((x, y), key).tensors() == (parts, 0)
    assert call((x, y), key, device=-2).tensors() is None  # (no CUDA tensor)
    assert call((x, y), key, spec="kwargs").tensors() is None  # (keywords)
    assert call((x, 0.5), (parts[0], (float, 0.5), ("ambient state",))).tensors() is None  # (a number)
    p = torch.nn.Parameter(torch.randn(4))
    assert call((x, p), key).tensors() is None  # (a parameter: the native signature leaves it too)
    lazy = (parts[0], ((4,), torch.float32, (1,), 1))  # (a lazy view's four items)
    assert call((x, y), (*lazy, ("ambient state",))).tensors() is None
