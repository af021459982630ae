"""GPU test of ``graphtree bench``: a quick overhead run writes a valid JSON file and a PNG."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.timeout(600)
def test_quick_overhead_run_writes_valid_json_and_png(tmp_path, capsys):
    from graphtree.bench import main
    from graphtree.bench.harness import validate_json

    out = tmp_path / "bench"
    assert main(["--quick", "--scenarios", "overhead", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed

    doc = json.loads((out / "bench.json").read_text())
    validate_json(doc)
    meta = doc["meta"]
    assert meta["device"] == torch.cuda.get_device_name()
    assert meta["torch"] == torch.__version__
    assert meta["scenarios"] == ["overhead"]
    rows = doc["results"]
    # every contender has rows; eager and the hand-written graph must not fail
    for name in meta["contenders"]:
        assert any(r["contender"] == name for r in rows), name
    for name in ("eager", "handwritten", "graphtree"):
        mine = [r for r in rows if r["contender"] == name]
        assert all(r["ok"] for r in mine), [r["error"] for r in mine if not r["ok"]]
        walls = [r for r in mine if r["metric"] == "wall_per_call"]
        assert len(walls) == 3 and all(r["value"] > 0 for r in walls)
        assert all(r["equal_to_eager"] for r in walls)
    assert (out / "table.txt").exists()
    pytest.importorskip("matplotlib", reason="matplotlib missing: no PNG expected")
    png = out / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
