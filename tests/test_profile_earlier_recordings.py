"""graphtree.profile names the kernels of recordings made before it started by the Python lines
that made them (issue 29), through the node ids CUPTI gives replayed kernels: the executable
graph's id in the high 32 bits, the node's index in the graph in the low 32 (the fake CUPTI
reports ids so, as the H100's driver 580 did in benchmarks/cupti_graph_ids.py)."""

from __future__ import annotations

import types

import pytest

import graphtree
from graphtree.tree import manager

MODEL = (("train.py", 10, "<module>"), ("model.py", 42, "forward"))
HEAD = (("train.py", 10, "<module>"), ("model.py", 57, "head"))


class _Graph:
    """What the profile asks of a recording's graph: its executable graph's handle."""

    def __init__(self, exe) -> None:
        self._exe = exe

    def raw_cuda_graph_exec(self) -> int:
        return self._exe.handle


def _recorded_before(sim, monkeypatch, with_sites: bool):
    def body() -> None:
        sim.launch_kernel("gemm")
        sim.launch_kernel("gelu")
        sim.launch_kernel("lm_head")

    exe = sim.capture(body)  # before profiling: CUPTI saw none of its nodes being made
    sites = [(0, 2, MODEL), (2, 3, HEAD)] if with_sites else []
    node = types.SimpleNamespace(name="step", id="n7", graph_sites=[(_Graph(exe), sites)])
    tree = types.SimpleNamespace(nodes=lambda: [node])
    monkeypatch.setattr(manager, "managers", lambda: [tree])
    return exe


@pytest.mark.parametrize("with_sites", [True, False])
def test_kernels_of_a_recording_made_before_profiling_get_their_lines(fake_cupti, monkeypatch, with_sites):
    sim = fake_cupti.SIM
    exe = _recorded_before(sim, monkeypatch, with_sites)
    with graphtree.profile() as prof:
        for _ in range(2):
            sim.graph_launch(exe)
    rows = {st.name: st for st in prof.kernel_stats()}
    assert {n: r.count for n, r in rows.items()} == {"gemm": 2, "gelu": 2, "lm_head": 2}
    if not with_sites:  # the control: named by the replay, as before this was built
        assert all(r.captured_before_profiling for r in rows.values())
        return
    assert not any(r.captured_before_profiling for r in rows.values()), rows
    assert prof.stack(rows["gemm"].stack_id)[-1] == ("model.py", 42, "forward")
    assert prof.stack(rows["gelu"].stack_id)[-1] == ("model.py", 42, "forward")
    assert prof.stack(rows["lm_head"].stack_id)[-1] == ("model.py", 57, "head")
    assert {r.label for r in rows.values()} == {"graphtree:step/n7"}


def test_a_recording_whose_graph_cannot_be_asked_keeps_todays_naming(fake_cupti, monkeypatch):
    sim = fake_cupti.SIM
    exe = _recorded_before(sim, monkeypatch, with_sites=True)
    node = manager.managers()[0].nodes()[0]
    node.graph_sites = [(types.SimpleNamespace(), node.graph_sites[0][1])]  # no raw_cuda_graph_exec()
    with graphtree.profile() as prof:
        sim.graph_launch(exe)
    assert all(r.captured_before_profiling for r in prof.kernel_stats())
