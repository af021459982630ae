"""torch.compile inside a graphed call: graphtree's dispatch modes let dynamo compile it.

Under a dispatch mode whose ``ignore_compile_internals()`` is False, dynamo skips the frame, and
goes on skipping its code after the mode is gone: a model compiled inside a graphed step ran
eagerly, and so did every later ``torch.compile`` of the same class (seen on the H100, torch 2.11:
the train benchmark's reduce-overhead contender fell to eager's time after graphtree's)."""

from __future__ import annotations

import torch
from torch._dynamo.utils import counters

from graphtree import _torch
from graphtree.tree.breaks import Breaks, WarmUpReads
from graphtree.tree.capture import OpTracker


def _double_plus_one(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def test_code_compiled_under_graphtrees_watch_is_compiled_and_stays_compilable() -> None:
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_double_plus_one, backend="eager")
    watch = _torch.StateWatch({})
    try:
        with OpTracker(), watch:  # (as in a warm-up or a capture)
            assert torch.equal(f(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        watch.close()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    g = torch.compile(_double_plus_one, backend="eager")  # the same code, compiled again later
    g(torch.ones(4, 2))
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert Breaks.ignore_compile_internals() and WarmUpReads.ignore_compile_internals()
    torch._dynamo.reset()


def _same(x: torch.Tensor) -> torch.Tensor:
    return x  # (no operator: dynamo traces the frame and makes no graph of it)


def test_a_trace_that_makes_no_graph_is_seen_too() -> None:
    # A warm-up or a capture asks whether dynamo traced during it: each trace reads and sets the
    # generators' states. Counting compiled graphs missed traces that made none, and a graphed HF
    # model whose compiled forward traced so in its recording ran eagerly for good, "calls
    # torch.cuda.get_rng_state" (the generate scenario's one-cache case, H100, torch 2.11).
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_same, backend="eager")
    before = _torch.dynamo_traces()
    graphs = counters["stats"]["unique_graphs"]
    f(torch.ones(3))
    assert counters["stats"]["unique_graphs"] == graphs  # (no graph made)
    assert _torch.dynamo_traces() > before
    now = _torch.dynamo_traces()
    f(torch.ones(3))  # (its cache hit: nothing traced)
    assert _torch.dynamo_traces() == now
    torch._dynamo.reset()
