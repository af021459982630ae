"""``graphtree doctor --speed`` on the GPU: every figure measured, sane, and the command under a minute."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from graphtree.debug.speed import speed_test

ROOT = Path(__file__).resolve().parents[2]


def test_quick_speed_test_measures_every_figure():
    r = speed_test(progress=False, quick=True)
    got = {f.name: f.value for f in r.figures}
    assert set(got) == {"matmul_bf16", "matmul_fp32", "copy_d2d", "h2d", "d2h", "launch", "graph_per_kernel"}
    assert got["matmul_bf16"] > 1 and got["matmul_fp32"] > 0.5, got  # TFLOP/s
    assert got["copy_d2d"] > 50 and got["h2d"] > 1 and got["d2h"] > 1, got  # GB/s
    assert 0 < got["graph_per_kernel"] < got["launch"] < 1000, got  # µs: a replay beats launching
    assert r.verdict.startswith("verdict:")


def test_the_command_reports_in_under_a_minute():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "graphtree", "doctor", "--speed", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
        cwd=str(ROOT),
        check=False,
    )
    seconds = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    speed = doc["speed"]
    print(json.dumps(speed, indent=1))  # the figures, for the closing note (pytest -s)
    assert len(speed["figures"]) == 7 and speed["verdict"].startswith("verdict:")
    assert seconds < 60, seconds
