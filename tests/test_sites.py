"""graphtree/tree/sites.py on the CPU, with a fake of cuda.bindings' driver: which operation made
which nodes of a graph under capture, and that a failing binding turns it off, never the caller."""

from __future__ import annotations

import types

from graphtree.tree import sites


class _Graph:
    pass


def _fake_driver(counts: list[int], fail_at: int | None = None):
    state = {"calls": 0}
    graph = _Graph()
    ok = "CUDA_SUCCESS"

    def get_capture_info(stream):
        state["calls"] += 1
        if fail_at is not None and state["calls"] == fail_at:
            raise TypeError("bindings of another version")
        return (ok, "ACTIVE", 1, graph, [], 0)

    def get_nodes(g, n):
        assert g is graph and n == 0
        return (ok, None, counts.pop(0))

    return types.SimpleNamespace(
        CUresult=types.SimpleNamespace(CUDA_SUCCESS=ok),
        CUstream=lambda s: s,
        CUgraph=_Graph,
        cuStreamGetCaptureInfo=get_capture_info,
        cuGraphGetNodes=get_nodes,
    )


def _model_op(cs: sites.CaptureSites) -> None:
    cs.after_op(7)  # an operation of the "model": the stack recorded is this caller's


def test_each_operation_gets_the_nodes_it_added_and_its_stack(monkeypatch):
    monkeypatch.setattr(sites, "_driver", _fake_driver([2, 2, 5]))
    cs = sites.CaptureSites()
    assert cs.on
    for _ in range(3):  # adds 2 nodes, none, 3 nodes
        _model_op(cs)
    kept = cs.take()
    assert [(a, b) for a, b, _ in kept] == [(0, 2), (2, 5)]
    assert all(stack[-1][2] == "_model_op" for _, _, stack in kept), kept
    assert cs.take() == []  # a new graph starts from node 0


def _two_ops(cs: sites.CaptureSites) -> None:
    cs.after_op(7)
    cs.after_op(7)


def test_each_operation_is_named_by_its_own_line_again_and_again(monkeypatch):
    """Frames are cached by (code, instruction): the line of each call, not of the first one met."""
    monkeypatch.setattr(sites, "_driver", _fake_driver([1, 2, 3, 4]))
    cs = sites.CaptureSites()
    for _ in range(2):
        _two_ops(cs)
    first = _two_ops.__code__.co_firstlineno
    lines = [stack[-1][1] for _, _, stack in cs.take()]
    assert lines == [first + 1, first + 2, first + 1, first + 2], lines


def test_a_failing_binding_turns_the_bookkeeping_off_not_the_recording(monkeypatch):
    monkeypatch.setattr(sites, "_driver", _fake_driver([1, 2, 3], fail_at=2))
    cs = sites.CaptureSites()
    _model_op(cs)
    _model_op(cs)  # raises inside: swallowed
    _model_op(cs)
    assert not cs.on and sites._driver is False
    assert [(a, b) for a, b, _ in cs.take()] == [(0, 1)]


def test_without_bindings_nothing_is_kept(monkeypatch):
    monkeypatch.setattr(sites, "_driver", False)
    cs = sites.CaptureSites()
    assert not cs.on
    cs.after_op(7)
    assert cs.take() == []


def test_the_environment_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(sites, "_driver", None)
    monkeypatch.setenv("GRAPHTREE_NO_SITES", "1")
    assert sites.CaptureSites().on is False
