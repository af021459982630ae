"""A graph the user captured by hand before graphtree records a training step keeps replaying.

Found on the H100 (torch 2.11): after a whole training step captured by hand with
``torch.cuda.graph`` (PyTorch's recipe: warm-up on a side stream), one ``torch.cuda.empty_cache()``
made the hand graph's next replay read freed memory (an illegal address that ends the process);
so did a later ``torch.cuda.graph`` capture, which calls it. graphtree called it before recording
a training step (to give back what the warm-ups cached). Run in a subprocess: the failure ends it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.own_process

SCRIPT = textwrap.dedent(
    """
    import copy, torch
    from graphtree.bench import train
    base, loss_fn, data = train.workload("mlp")
    hand = train.make_step("handwritten", copy.deepcopy(base), loss_fn, data[0])
    for i in range(3):
        hand(*data[i % 4])
    gt = train.make_step("graphtree", copy.deepcopy(base), loss_fn, data[0])
    for i in range(4):  # warm-ups, then the recording
        gt(*data[i % 4])
    import graphtree
    assert graphtree.stats().recordings == 1, graphtree.stats()
    for i in range(10):
        hand(*data[i % 4])
        gt(*data[i % 4])
    torch.cuda.synchronize()
    print("BOTH_REPLAYED")
    """
)


def test_a_hand_captured_training_graph_survives_graphtree_recording_a_step():
    p = subprocess.run([sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0 and "BOTH_REPLAYED" in p.stdout, p.stderr[-3000:]
