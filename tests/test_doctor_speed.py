"""``graphtree doctor --speed`` without a GPU: peaks, verdict, report, and the CLI's exit status."""

from __future__ import annotations

import json

import pytest
import torch

from graphtree import cli
from graphtree.debug.speed import Figure, SpeedReport, peaks_for, verdict


def test_peaks_match_the_names_torch_reports():
    assert peaks_for("NVIDIA H100 80GB HBM3")["matmul_bf16"] == 989.0
    assert peaks_for("NVIDIA H100 PCIe")["copy_d2d"] == 2000.0  # the more specific entry wins
    assert peaks_for("NVIDIA H200")["copy_d2d"] == 4800.0
    assert peaks_for("NVIDIA A100-SXM4-80GB") is not None and peaks_for("NVIDIA L4") is not None
    assert peaks_for("Tesla T4") is None


def _figures(bf16_share: float) -> list[Figure]:
    p = peaks_for("NVIDIA H100 80GB HBM3")
    return [
        Figure("matmul_bf16", bf16_share * p["matmul_bf16"], "TFLOP/s", p["matmul_bf16"]),
        Figure("copy_d2d", 0.8 * p["copy_d2d"], "GB/s", p["copy_d2d"]),
        Figure("h2d", 0.8 * p["pcie"], "GB/s", p["pcie"]),
        Figure("launch", 5.0, "us"),  # no peak: never called slow
    ]


def test_verdict_names_what_is_slow_and_by_how_much():
    ok, slow = verdict("NVIDIA H100 80GB HBM3", _figures(0.7))
    assert ok == "verdict: as fast as this GPU should be" and slow == []
    bad, slow = verdict("NVIDIA H100 80GB HBM3", _figures(0.2))
    assert slow == ["matmul_bf16"] and "SLOW" in bad and "matmul bf16 at 20 %" in bad
    unknown, slow = verdict("Tesla T4", _figures(0.2))
    assert "no nominal peaks for Tesla T4" in unknown and slow == []


def test_report_renders_and_round_trips_through_json():
    r = SpeedReport(device="NVIDIA H100 80GB HBM3", torch="2.11.0", figures=_figures(0.7), seconds=42.0)
    r.verdict, r.slow = verdict(r.device, r.figures)
    text = r.render()
    assert "matmul bf16" in text and "% of 989 TFLOP/s" in text and text.endswith("as fast as this GPU should be")
    d = json.loads(json.dumps(r.as_dict()))
    assert d["figures"][0]["name"] == "matmul_bf16" and d["figures"][0]["share_of_peak"] == pytest.approx(0.7)
    assert d["figures"][3]["share_of_peak"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_speed_without_a_gpu_says_so_and_exits_2(capsys):
    assert cli.main(["doctor", "--speed"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
