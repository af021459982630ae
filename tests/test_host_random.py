"""A call that draws random numbers on the host (Python's random, NumPy's global generator, torch's
CPU generator) cannot be recorded: a replay would repeat its recording's draw (tree/host_random.py)."""

from __future__ import annotations

import random

import pytest
import torch

from graphtree.tree.host_random import HostRandom


def _numpy_draw():
    return pytest.importorskip("numpy").random.rand()


@pytest.mark.parametrize(
    ("draw", "named"),
    [
        (random.random, "Python's random module"),
        (lambda: torch.rand(()).item(), "torch's CPU generator"),
        (_numpy_draw, "NumPy's global generator"),
    ],
)
def test_a_host_draw_is_named_and_a_call_without_one_is_not(draw, named):
    if "NumPy" in named:
        pytest.importorskip("numpy")  # (imported before the first state is read, as a user's program has it)
    before = HostRandom.now()
    torch.ones(3) * 2  # (no draw)
    assert before.drawn("f") is None
    before = HostRandom.now()
    draw()
    reason = before.drawn("f")
    assert reason is not None and named in reason and "`f`" in reason
