"""The OpInfo sweep's classification (benchmarks/conformance/opinfo_sweep.py, issue 44) on the CPU:
each outcome from a pair of callables that behave so, and a small sweep of real operators (on the
CPU graphtree runs every call eagerly, so every sample is ``eager``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "conformance" / "opinfo_sweep.py"
spec = importlib.util.spec_from_file_location("opinfo_sweep", SCRIPT)
assert spec is not None and spec.loader is not None
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def _classify(graphed, eager=torch.sin, replayed=0, seeded=False):
    counter = iter(range(0, 100, replayed)) if replayed else iter([0] * 100)
    calls = [((torch.arange(4.0) + k,), {}) for k in range(4)]
    return sweep.classify(graphed, eager, calls, seeded, lambda: next(counter), lambda: ["no CUDA"])


def test_each_outcome_is_told_apart():
    assert _classify(torch.sin)["outcome"] == "eager"
    assert _classify(torch.sin)["reason"] == "no CUDA"
    assert _classify(torch.sin, replayed=3)["outcome"] == "replayed"  # (3 more replays after than before)
    wrong = _classify(lambda x: torch.sin(x) + (x > 5))  # right on the first calls, then not
    assert wrong["outcome"] == "wrong" and wrong["reason"].startswith("call 3")

    def raises(x):
        raise RuntimeError("boom")

    crash = _classify(raises)
    assert crash["outcome"] == "crash" and "boom" in crash["reason"]
    assert _classify(raises, eager=raises)["outcome"] == "error_as_eager"
    assert _classify(torch.sin, eager=raises)["outcome"] == "wrong"  # eager raises, graphtree did not
    assert _classify(lambda x: torch.rand(3), eager=lambda x: torch.rand(3), seeded=True)["outcome"] == "eager"
    assert _classify(lambda x: torch.rand(3), eager=lambda x: torch.rand(3))["outcome"] == "wrong"


def test_nan_equals_nan_and_structure_counts():
    nan = torch.tensor([float("nan"), 1.0])
    assert sweep.same((nan, 2), (nan.clone(), 2)) is None
    assert sweep.same([nan], (nan,)) is not None
    assert sweep.same(torch.ones(2), torch.ones(2, dtype=torch.float64)) is not None


def test_a_small_sweep_writes_the_summary(tmp_path):
    pytest.importorskip("expecttest")  # (op_db imports it)
    out = tmp_path / "conformance.json"
    args = ["--device", "cpu", "--ops", "add,nn.functional.dropout", "--max-samples", "2", "--workers", "2"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--modes", "plain,inplace", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["ops"] == 2 and res["samples"] > 0 and res["wrong"] == 0 and res["crash"] == 0
    assert res["eager"] == res["samples"] and res["in_place"]["samples"] > 0  # the CPU runs everything eagerly
    assert set(res["reasons"]) == {"no CUDA"}
