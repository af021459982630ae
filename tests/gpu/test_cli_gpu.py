"""GPU test of ``graphtree demo``: graphed decoding records, replays and matches eager tokens."""

from __future__ import annotations

import pytest
import torch

from graphtree.cli import main
from graphtree.demo import NO_GPU

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_demo_on_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["demo", "--steps", "16", "--layers", "2", "--d-model", "128", "--heads", "4", "--batch", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert NO_GPU not in out
    assert "device:  cuda" in out
    assert "tokens match: yes" in out
    assert "eager only" not in out and "speedup:" in out
    recordings = int(out.split("recordings:")[1].split()[0])
    replays = int(out.split("replays:")[1].split()[0])
    assert recordings >= 1 and replays >= 16 - 3 - recordings, out
