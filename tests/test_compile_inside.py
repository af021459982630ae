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
