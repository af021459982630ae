"""CPU tests of ``graphtree bench``'s entry point, configuration and plot (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

import graphtree.bench as bench
from graphtree.bench import plot, scenarios
from graphtree.bench.harness import Result, summarize, to_json, validate_json


def _doc():
    rows = []
    for case, eager, graph in (("1 kernel", 2.7e-5, 9e-6), ("64 kernels", 3.1e-4, 1.2e-5)):
        for name, v in (("eager", eager), ("graphtree", graph)):
            for metric in ("cpu_per_call", "wall_per_call", "gpu_time"):
                rows.append(
                    Result("overhead", case, name, metric, v, "s", equal_to_eager=True, stats=summarize([v, v * 1.1]))
                )
    rows.append(
        Result(
            "overhead", "1 kernel", "compile-cudagraphs", "setup", None, "", ok=False, error="RuntimeError: simulated"
        )
    )
    rows.append(Result("decode", "batch 1", "eager", "time_per_token", 4e-3, "s"))
    rows.append(Result("decode", "batch 1", "graphtree", "time_per_token", 1e-3, "s", equal_to_eager=True))
    rows.append(Result("decode", "batch 1", "compile-cudagraphs", "time_per_token", 1.2e-3, "s", equal_to_eager=True))
    meta = {
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "cuda": "13.0",
        "python": "3.12.3",
        "date": "2025-06-01T12:00:00+00:00",
        "graphtree": "0.1.0",
        "command": "graphtree bench",
        "duration_s": 300.0,
        "scenarios": ["overhead", "decode"],
        "contenders": ["eager", "compile-cudagraphs", "graphtree"],
    }
    return to_json(rows, meta)


def test_main_without_cuda_exits_2_with_a_plain_message(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = bench.main(["--quick", "--scenarios", "overhead", "--out", str(tmp_path / "r")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "need a CUDA GPU" in err
    assert "Traceback" not in err
    assert not (tmp_path / "r").exists()


def test_main_rejects_unknown_scenario_and_contender(capsys):
    assert bench.main(["--scenarios", "overhead,warp"]) == 2
    assert "unknown scenario warp" in capsys.readouterr().err
    assert bench.main(["--contenders", "eager,jax"]) == 2
    assert "unknown contender jax" in capsys.readouterr().err


def test_main_help_and_usage_errors_return_codes(capsys):
    assert bench.main(["--help"]) == 0
    assert "--scenarios" in capsys.readouterr().out
    assert bench.main(["--budget", "soon"]) == 2


def test_module_entry_point_exists():
    import importlib

    mod = importlib.import_module("graphtree.bench.__main__")
    assert mod.main is bench.main


def test_scenario_and_contender_names_agree():
    from graphtree.bench.contenders import ALL_CONTENDERS

    assert bench._SCENARIOS == scenarios.SCENARIOS and bench._RANK_SCENARIOS == scenarios.RANK_SCENARIOS
    every = set(scenarios.SCENARIOS + scenarios.RANK_SCENARIOS)
    assert every == set(scenarios.RUNNERS) == set(scenarios.BUDGET_WEIGHTS)
    assert bench._CONTENDERS == ALL_CONTENDERS


def test_split_keeps_canonical_order():
    assert bench._split("memory, overhead", bench._SCENARIOS, "scenario") == ["overhead", "memory"]
    with pytest.raises(ValueError, match="unknown scenario"):
        bench._split("", bench._SCENARIOS, "scenario")


def test_config_quick_is_smaller_and_serializable():
    full = scenarios.BenchConfig.make()
    quick = scenarios.BenchConfig.make(quick=True, contenders=["eager", "graphtree"], budget_s=60)
    assert full.gpt.n_layer == 12 and full.gpt.d_model == 768
    assert full.decode_batches == (1, 8, 32)
    assert full.mem_buckets == (1, 8, 32)
    assert full.capture_buckets == 32 and full.kernels == (1, 16, 64)
    assert quick.gpt.n_layer < full.gpt.n_layer
    assert quick.decode_steps < full.decode_steps
    assert quick.contenders == ("eager", "graphtree") and quick.budget_s == 60
    json.dumps(full.describe())
    json.dumps(quick.describe())


def test_from_json_prints_table_and_plots(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(_doc()))
    assert bench.main(["--from-json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "FAILED: RuntimeError: simulated" in out
    assert "graphtree" in out and "correctness:" in out
    png = tmp_path / "bench.png"
    assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_json_rejects_invalid_file(tmp_path, capsys):
    path = tmp_path / "bench.json"
    doc = _doc()
    del doc["meta"]["torch"]
    path.write_text(json.dumps(doc))
    assert bench.main(["--from-json", str(path)]) == 2
    assert "meta lacks 'torch'" in capsys.readouterr().err


def test_plot_title_and_panel_data():
    doc = _doc()
    validate_json(doc)
    title = plot.title_for(doc["meta"])
    assert "NVIDIA H100 80GB HBM3" in title and "torch 2.11.0+cu130" in title
    cases, names, values = plot.panel_data(doc, "overhead", "wall_per_call")
    assert cases == ["1 kernel", "64 kernels"]
    assert names == ["eager", "compile-cudagraphs", "graphtree"]
    assert values[("1 kernel", "compile-cudagraphs")] is None  # failed
    assert values[("64 kernels", "graphtree")] == pytest.approx(1.2e-5)
    assert ("64 kernels", "compile-cudagraphs") not in values
    cases, names, values = plot.panel_data(doc, "decode", "time_per_token")
    assert cases == ["batch 1"] and values[("batch 1", "eager")] == 4e-3


def test_plot_without_matplotlib_says_so(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    assert plot.plot_results(_doc(), tmp_path / "x.png") is None
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_plot_writes_png_even_with_missing_scenarios(tmp_path):
    pytest.importorskip("matplotlib")
    doc = _doc()
    doc["results"] = [r for r in doc["results"] if r["scenario"] == "overhead"]
    out = plot.plot_results(doc, tmp_path / "sub" / "p.png")
    assert out is not None and out.exists() and out.stat().st_size > 1000


def test_ddp_and_tp_run_alone_under_torchrun_and_say_how_otherwise(monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK"):
        monkeypatch.delenv(var, raising=False)
    assert bench.main(["--scenarios", "ddp,tp"]) == 2
    assert "torchrun --nproc-per-node N -m graphtree bench --scenarios ddp,tp" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "1")
    assert bench.main(["--scenarios", "ddp,overhead"]) == 2
    assert "run the other scenarios without torchrun" in capsys.readouterr().err
    assert bench.main(["--scenarios", "overhead"]) == 2
    assert "runs the ddp and tp scenarios only" in capsys.readouterr().err
