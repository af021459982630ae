"""benchmarks/per_call.py --summary: the paired ratios of several processes' JSON, per tag."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

_PATH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "per_call.py")


@pytest.fixture(scope="module")
def per_call():
    spec = importlib.util.spec_from_file_location("per_call_bench", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _write(tmp_path, name: str, ratios: dict[str, float]) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"paired_ratio_to_raw": ratios}))
    return str(path)


def test_summary_takes_each_rows_median_over_processes_per_tag(per_call, tmp_path, capsys) -> None:
    module = per_call.MODULE_GT
    paths = [
        _write(tmp_path, "per_call_after_1.json", {"graphtree": 1.02, module: 1.20}),
        _write(tmp_path, "per_call_after_2.json", {"graphtree": 1.09, module: 1.13}),
        _write(tmp_path, "per_call_after_3.json", {"graphtree": 1.04, module: 1.14}),
        _write(tmp_path, "per_call_before_1.json", {"graphtree": 1.07, module: 1.18}),
    ]
    got = per_call.summary(paths)
    assert set(got) == {"after", "before"}
    assert got["after"]["graphtree"] == {"median": 1.04, "min": 1.02, "max": 1.09, "n": 3}
    assert got["after"][module]["median"] == 1.14
    assert got["before"][module] == {"median": 1.18, "min": 1.18, "max": 1.18, "n": 1}
    assert per_call.main(["--summary", *paths]) == 0
    table = capsys.readouterr().out
    assert "1.14 (1.13-1.20, 3)" in table and "<= 1.15" in table


def test_summary_names_the_file_it_cannot_place(per_call, tmp_path) -> None:
    path = _write(tmp_path, "ratios.json", {"graphtree": 1.0})
    with pytest.raises(ValueError, match=re.escape("ratios.json: expected per_call_<tag>_<round>.json")):
        per_call.summary([path])
