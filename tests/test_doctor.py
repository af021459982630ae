"""CPU tests of ``graphtree.debug.doctor``: it always reports, and picks the right hint."""

from __future__ import annotations

import importlib
import json
import os
import stat
import sys
import types
from pathlib import Path

import pytest
import torch

from graphtree.debug import DoctorReport, doctor

# ``graphtree.debug.doctor`` the attribute is the function; the module is reached by name.
doctor_mod = importlib.import_module("graphtree.debug.doctor")

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA verdict")


def test_report_has_core_rows() -> None:
    r = doctor()
    assert isinstance(r, DoctorReport)
    labels = [label for label, _ in r.lines]
    assert len(labels) == len(set(labels)), labels
    for label in (
        "graphtree",
        "Python",
        "torch",
        "torch build",
        "CUDA available",
        "driver",
        "CUDA runtime",
        "CUPTI (python)",
        "compute-sanitizer",
    ):
        assert label in labels
    assert r.get("torch") == str(torch.__version__)
    assert r.get("CUDA available") == ("yes" if torch.cuda.is_available() else "no")
    assert r.get("missing", "dflt") == "dflt"
    assert all(isinstance(v, str) for _, v in r.lines)
    assert not any(v.startswith("error:") for _, v in r.lines), r.lines


@needs_no_cuda
def test_verdict_on_machine_without_cuda() -> None:
    r = doctor()
    assert r.ok is False
    assert "cannot run" in r.verdict
    assert "eagerly" in r.verdict
    if torch.version.cuda is None:
        assert "CPU build" in r.verdict
        assert "--index-url" in r.verdict
        assert r.get("torch build", "").startswith("CPU build")


def test_json_round_trip_and_render() -> None:
    r = doctor()
    d = r.as_dict()
    assert json.loads(json.dumps(d)) == d
    assert set(d) == {"ok", "verdict", "lines"}
    assert d["lines"] == [list(row) for row in r.lines]
    text = r.render()
    assert r.verdict in text
    for label, value in r.lines:
        assert label in text and value in text


def test_failing_probe_becomes_error_row(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom() -> list[tuple[str, str]]:
        raise RuntimeError("boom")

    monkeypatch.setattr(doctor_mod, "_probe_driver", boom)
    monkeypatch.setattr(doctor_mod, "_probe_gpus", lambda: 1 / 0)
    r = doctor()
    assert r.get("driver") == "error: RuntimeError: boom"
    assert r.get("GPUs", "").startswith("error: ZeroDivisionError")
    assert r.get("torch") == str(torch.__version__)  # the rest still reports
    assert r.verdict


def test_torch_cuda_raising_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*a: object, **k: object) -> None:
        raise RuntimeError("driver exploded")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    r = doctor()
    assert r.ok is False
    assert "error: RuntimeError: driver exploded" in r.get("CUDA available", "")
    assert "cannot run" in r.verdict


def test_verdict_itself_failing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor_mod, "_verdict", lambda rows: 1 / 0)
    r = doctor()
    assert r.ok is False and "ZeroDivisionError" in r.verdict


def test_verdict_old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.10.1+cu128")
    ok, verdict = doctor_mod._verdict([])
    assert not ok
    assert "older than 2.11" in verdict and "torch>=2.11" in verdict


def test_verdict_cuda_build_without_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ok, verdict = doctor_mod._verdict([("driver", "unknown")])
    assert not ok
    assert "no CUDA driver or device visible" in verdict and "nvidia-smi" in verdict
    assert "CPU build" not in verdict

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    ok, verdict = doctor_mod._verdict([])
    assert not ok and "CUDA_VISIBLE_DEVICES" in verdict


def test_verdict_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.13.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    ok, verdict = doctor_mod._verdict([])
    assert not ok
    assert "torch 2.13.0+cpu is a CPU build" in verdict and "cu130" in verdict


def test_verdict_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: "Fake GPU 80GB")
    ok, verdict = doctor_mod._verdict([])
    assert ok
    assert verdict == "CUDA graphs can run here (Fake GPU 80GB)"


def test_cupti_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupti", None)  # makes `import cupti` raise ImportError
    monkeypatch.setattr(doctor_mod.importlib.metadata, "version", _no_dist)
    assert doctor_mod._probe_cupti() == [("CUPTI (python)", "not installed: pip install 'graphtree[profile]'")]

    monkeypatch.setitem(sys.modules, "cupti", types.ModuleType("cupti"))
    monkeypatch.setattr(doctor_mod.importlib.metadata, "version", lambda name: "13.0.1")
    [(_label, value)] = doctor_mod._probe_cupti()
    assert value == "importable (cupti-python 13.0.1)"


def _no_dist(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def _fake_tool(directory: Path, name: str, stdout: str) -> Path:
    """An executable shell script printing ``stdout`` (line by line, shell builtins only: PATH may be bare)."""
    path = directory / name
    lines = "".join(f"printf '%s\\n' '{line}'\n" for line in stdout.splitlines() or [""])
    path.write_text(f"#!/bin/sh\n{lines}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.mark.skipif(os.name != "posix", reason="uses a shell script as a fake tool")
def test_driver_from_nvidia_smi_and_sanitizer_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_tool(tmp_path, "nvidia-smi", "580.65.06")
    sanitizer = _fake_tool(tmp_path, "compute-sanitizer", "")
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delattr(torch.cuda, "driver_version", raising=False)
    assert doctor_mod._probe_driver() == [("driver", "580.65.06 (nvidia-smi)")]
    assert doctor_mod._probe_sanitizer() == [("compute-sanitizer", str(sanitizer))]

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(doctor_mod, "_SANITIZER_DIRS", (str(tmp_path / "empty"),))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    assert doctor_mod._probe_driver() == [("driver", "unknown")]
    assert doctor_mod._probe_sanitizer()[0][1].startswith("not found")


def test_driver_prefers_torch_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "driver_version", lambda: 13000, raising=False)
    assert doctor_mod._probe_driver() == [("driver", "supports CUDA 13.0")]
    monkeypatch.setattr(torch.cuda, "driver_version", lambda: "580.65.06", raising=False)
    assert doctor_mod._probe_driver() == [("driver", "580.65.06")]


def _rows(monkeypatch: pytest.MonkeyPatch, folder: Path, cuda: str | None) -> dict[str, str]:
    monkeypatch.setenv("PATH", str(folder))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    return dict(doctor().lines)


def test_driver_older_than_torchs_cuda_and_a_foreign_nvcc_are_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _fake_tool(tmp_path, "nvidia-smi", "| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |")
    _fake_tool(tmp_path, "nvcc", "Cuda compilation tools, release 11.8, V11.8.89")
    rows = _rows(monkeypatch, tmp_path, "13.0")
    assert "12.4: OLDER than torch's CUDA 13.0" in rows["driver supports CUDA"]
    assert "Fix:" in rows["driver supports CUDA"]
    assert rows["nvcc (toolkit)"].startswith("11.8 at ") and "MISMATCH with torch's CUDA 13.0" in rows["nvcc (toolkit)"]


def test_matching_versions_are_fine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_tool(tmp_path, "nvidia-smi", "CUDA Version: 13.0")
    _fake_tool(tmp_path, "nvcc", "Cuda compilation tools, release 13.0, V13.0.48")
    _fake_tool(tmp_path, "cuda-gdb", "NVIDIA (R) CUDA Debugger\n13.0 release\nPortions Copyright (C) 2007-2025")
    rows = _rows(monkeypatch, tmp_path, "13.0")
    assert rows["driver supports CUDA"] == "13.0 (torch's CUDA 13.0: fine)"
    assert rows["nvcc (toolkit)"].endswith(": fine")
    assert "13.0 release" in rows["cuda-gdb"] and "newer than the driver" not in rows["cuda-gdb"]
    assert rows["compute-sanitizer version"].startswith("not found: it comes with the CUDA toolkit")


def test_the_cuda_gdb_wrappers_exec_line_is_not_taken_for_its_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # what /usr/local/cuda/bin/cuda-gdb --version printed on the H100 machine (CUDA 13.0)
    out = "exec: /usr/local/cuda/bin/cuda-gdb-python3.12-tui --version\nNVIDIA (R) CUDA Debugger\n13.0 release"
    _fake_tool(tmp_path, "nvidia-smi", "CUDA Version: 13.0")
    _fake_tool(tmp_path, "cuda-gdb", out)
    rows = _rows(monkeypatch, tmp_path, "13.0")
    assert rows["cuda-gdb"].startswith("13.0 release"), rows["cuda-gdb"]


def test_a_debugger_newer_than_the_driver_is_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_tool(tmp_path, "nvidia-smi", "CUDA Version: 12.2")
    _fake_tool(tmp_path, "cuda-gdb", "NVIDIA (R) CUDA Debugger\n13.0 release")
    rows = _rows(monkeypatch, tmp_path, "12.1")
    assert "newer than the driver's 12.2" in rows["cuda-gdb"]


def test_cudnn_loaded_against_built(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from graphtree import _torch

    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 80902)
    monkeypatch.setattr(_torch, "cudnn_compiled_version", lambda: 91002)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    rows = _rows(monkeypatch, tmp_path, "13.0")
    assert "80902 loaded, torch was built with 91002: MISMATCH" in rows["cuDNN"]
    assert rows["NCCL"] == "2.27.3"
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 91002)
    assert _rows(monkeypatch, tmp_path, "13.0")["cuDNN"] == "91002 loaded (torch built with 91002)"


def test_json_carries_the_new_rows() -> None:
    doc = json.loads(json.dumps(doctor().as_dict()))
    text = json.dumps(doc)
    for label in ("driver supports CUDA", "nvcc (toolkit)", "cuDNN", "NCCL", "cuda-gdb"):
        assert label in text


def test_a_process_that_keeps_no_bytecode_is_told_what_it_costs_and_the_fix(tmp_path) -> None:
    import os
    import subprocess
    import sys

    code = "from graphtree.debug.doctor import _probe_bytecode; print(_probe_bytecode()[0][1])"
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(tmp_path / "empty")}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert off.startswith("not cached (PYTHONDONTWRITEBYTECODE is set)") and "PYTHONPYCACHEPREFIX" in off, off
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "cache")
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)  # writes the cache
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert on.strip() == "torch's is cached", on


def test_the_collectives_row_names_an_environment_that_keeps_them_out(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    d = doctor_mod
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    monkeypatch.delenv("NCCL_GRAPH_MIXING_SUPPORT", raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert d._probe_collectives() == [("collectives in graphs", "NCCL available; environment ok")]
    monkeypatch.setenv("TORCH_NCCL_BLOCKING_WAIT", "1")
    ((_label, value),) = d._probe_collectives()
    assert value.startswith("refused here: TORCH_NCCL_BLOCKING_WAIT") and "unset it" in value
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert "no NCCL" in d._probe_collectives()[0][1]
