"""The OpInfo sweep's classification (benchmarks/conformance/opinfo_sweep.py, issue 44) on the CPU:
each outcome from a pair of callables that behave so, and a small sweep of real operators (on the
CPU graphtree runs every call eagerly, so every sample is ``eager``)."""

from __future__ import annotations

import importlib.util
import itertools
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
    seeded = _classify(lambda x: torch.rand(3), eager=lambda x: torch.rand(3), seeded=True)
    assert seeded["outcome"] == "eager" and seeded["compared"] == "values"  # the seed makes the draws comparable
    assert _classify(lambda x: torch.rand(3), eager=lambda x: torch.zeros(3))["outcome"] == "wrong"
    # unseeded draws: eager does not reproduce its own values, so only their metadata is compared
    unseeded = _classify(lambda x: torch.rand(3), eager=lambda x: torch.rand(3))
    assert unseeded["outcome"] == "eager" and unseeded["compared"] == "metadata"


def test_eager_that_does_not_reproduce_itself_is_compared_by_metadata():
    draws = itertools.count()

    def fresh(x):  # other values at each call, as an uninitialized output (torch.empty) has
        return torch.full_like(x, float(next(draws)))

    assert _classify(fresh, eager=fresh) == {"outcome": "eager", "reason": "no CUDA", "compared": "metadata"}
    assert _classify(torch.sin)["compared"] == "values"
    # the metadata still counts: shape, dtype, structure
    shape = _classify(lambda x: fresh(x)[:2], eager=fresh)
    assert shape["outcome"] == "wrong" and shape["reason"].startswith("call 0: shape")
    dtype = _classify(lambda x: fresh(x).double(), eager=fresh)
    assert dtype["outcome"] == "wrong" and "dtype" in dtype["reason"]
    assert _classify(lambda x: (fresh(x),), eager=fresh)["outcome"] == "wrong"

    def late(x):  # reproducible on calls 0 and 1, not from call 2 on (x[0] is the call's index)
        return torch.sin(x) + (next(draws) if x[0] >= 2 else 0)

    # the values that differ on call 0 are not held against graphtree: eager turns out not reproducible
    assert _classify(torch.cos, eager=late)["compared"] == "metadata"
    assert _classify(torch.cos, eager=late)["outcome"] == "eager"


def _rec(op, mode, outcome, dtype="float32", sample=0, **more):
    return {"op": op, "variant": "", "dtype": dtype, "mode": mode, "sample": sample, "outcome": outcome,
            "reason": "", **more}  # fmt: skip


def test_summary_counts_raw_pairs_like_for_like_and_the_slowest_operators():
    records = [
        _rec("a", "plain", "replayed", compared="values"),
        _rec("a", "raw", "raw_capturable"),
        _rec("a", "plain", "replayed", sample=1),  # no raw try: not in raw_pairs
        _rec("a", "grad", "replayed"),
        _rec("b", "plain", "eager", compared="metadata"),
        _rec("b", "raw", "raw_capturable"),  # capturable, graphtree ran it eagerly
        _rec("c", "plain", "replayed", dtype="int64"),
        _rec("c", "raw", "raw_not", dtype="int64"),  # replayed, not raw-capturable: not counted
        _rec("c", "inplace", "eager", compared="metadata"),
        *(_rec(f"op{i}", "op", "done", dtype="", sample=-1, seconds=float(i)) for i in range(12)),
    ]
    res = sweep.summarize(records, "cpu", torch.__version__, 1.0)
    assert res["raw_pairs"] == {"raw_capturable": 2, "replayed": 1}
    assert res["replayed"] == 4 and res["raw_capturable"] == 2 and res["raw_tried"] == 3  # (unchanged fields)
    assert res["metadata_only"] == 2
    assert res["ops"] == 3  # (the operators' bookkeeping records are not samples)
    assert list(res["op_seconds"].items()) == [(f"op{i}", float(i)) for i in range(11, 1, -1)]


def test_a_raw_try_that_leaves_the_process_unusable_is_blamed_on_the_raw_step(monkeypatch):
    tries = [({"op": name, "mode": "raw", "sample": 0}, name, ((), {})) for name in ("ok", "poisons", "later")]
    poisoned = []
    monkeypatch.setattr(sweep, "raw_capture", lambda fn, call, seeded: poisoned.append(fn == "poisons") or {
        "outcome": "raw_not", "reason": "RuntimeError: capture failed"})  # fmt: skip
    monkeypatch.setattr(sweep, "_healthy", lambda device: not any(poisoned))
    got = []
    with pytest.raises(sweep.Unusable):
        got.extend(sweep.raw_ceilings(tries, False, "cuda"))
    assert [r["op"] for r in got] == ["ok", "poisons"]  # the try after it is not made
    assert got[1]["outcome"] == "raw_not" and "left the process unusable" in got[1]["reason"]
    assert "capture failed" in got[1]["reason"]


def test_a_worker_left_unusable_by_a_raw_try_is_replaced_without_a_crash(tmp_path):
    pytest.importorskip("expecttest")  # (op_db imports it)
    fake = tmp_path / "worker.py"  # answers its first operator, says it is unusable, exits
    fake.write_text(
        "import json, sys\n"
        "index = int(sys.stdin.readline())\n"
        "print(json.dumps({'op': 'x', 'variant': '', 'dtype': 'float32', 'mode': 'raw', 'sample': 0,"
        " 'outcome': 'raw_not', 'reason': 'the raw capture left the process unusable'}), flush=True)\n"
        "print(f'DONE {index} 1.25 unusable', flush=True)\n"
        "sys.exit(3)\n"
    )
    records, not_run = sweep.sweep([0, 1, 2], [sys.executable, str(fake)], workers=1, timeout=60)
    assert not_run == 0
    assert not [r for r in records if r["outcome"] == "crash"]  # each operator ran on a fresh worker
    assert [r["seconds"] for r in records if r["mode"] == "op"] == [1.25] * 3


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
    assert res["metadata_only"] == 0 and res["raw_pairs"] == {"raw_capturable": 0, "replayed": 0}
    assert set(res["op_seconds"]) == {"add", "nn.functional.dropout"}


def test_a_view_input_that_requires_grad_is_twinned_as_a_view_and_its_leaf_gets_the_gradient():
    import torch

    leaf = torch.randn(2, 3, 4, requires_grad=True)
    view = leaf.transpose(1, 2)  # (OpInfo's attention samples: make(shape).transpose(1, 2))
    twin = sweep._copy((view,))[0]
    assert not twin.is_leaf and twin._base.is_leaf and twin._base.requires_grad
    assert twin.shape == view.shape and twin.stride() == view.stride() and torch.equal(twin, view)
    assert sweep._grad_leaves((view, view, twin)) == [leaf, twin._base]
    got = sweep._with_grads(True)(view * 2, (view,))
    want = sweep._with_grads(True)(twin * 2, (twin,))
    assert sweep.same(got, want) is None
    assert got[1][0].shape == leaf.shape


def test_a_leaf_viewing_another_leafs_memory_gets_memory_of_its_own_on_both_sides():
    # OpInfo's attention samples are such leaves (make(shape).transpose(1, 2)): autograd routes their
    # gradients elsewhere, so that the graphed side's gradients were None against its twin's (10 WRONG
    # samples of the sweep on an H100, with graphtree running those calls eagerly).
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == "torch.ops.aten._flash_attention_forward")
    sample = next(iter(op.sample_inputs_func(op, "cpu", torch.float32, True)))
    odd = sample.input
    assert odd.is_leaf and odd._base is not None and odd.requires_grad
    assert torch.autograd.grad((odd * 2).sum(), [odd], allow_unused=True)[0] is None  # what the sweep met
    (own, *_), kwargs = sweep._own_leaves(((odd, *sample.args), dict(sample.kwargs)))
    assert own.is_leaf and own._base is None and own.requires_grad and kwargs == sample.kwargs
    assert own.shape == odd.shape and own.stride() == odd.stride() and torch.equal(own, odd)
    got = sweep._with_grads(True)(own * 2, (own,))
    twin = sweep._copy((own,))
    want = sweep._with_grads(True)(twin[0] * 2, twin)
    assert sweep.same(got, want) is None and torch.equal(got[1][0], torch.full_like(own, 2.0))
    plain = torch.randn(3, requires_grad=True)
    assert sweep._own_leaves(((plain,), {}))[0][0] is plain  # an ordinary leaf is left as it is


def test_a_result_equal_within_tolerance_but_not_bit_for_bit_is_counted_inexact_not_wrong():
    # the oracle beyond OpInfo's tolerances: a float16 product whose scalar was rounded to half first
    # (graphtree's 0-dim CPU tensor bug, which the tolerance-based sweep did not see)
    def rounded(x):
        return torch.sin(x) * (1 + 2**-20)  # within float32's tolerance, other bits

    off = _classify(rounded)
    assert off["outcome"] == "eager" and off["exact"] is False and off["inexact"].startswith("call 0")
    assert _classify(torch.sin)["exact"] is True
    records = [
        {"op": "sin", "variant": "", "dtype": "float32", "sample": 0, "mode": "plain", **_classify(torch.sin)},
        {"op": "mul", "variant": "", "dtype": "float16", "sample": 0, "mode": "plain", **off},
    ]
    res = sweep.summarize(records, "cpu", torch.__version__, 1.0)
    assert res["exact"] == 1 and res["inexact"] == 1 and res["inexact_cases"][0]["op"] == "mul"
