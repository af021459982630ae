"""CPU tests of the ``graphtree`` command line, run in-process through :func:`graphtree.cli.main`."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from graphtree.cli import main
from graphtree.demo import NO_GPU

REPO = Path(__file__).resolve().parents[1]
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")


def test_doctor_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "graphtree doctor" in out
    assert "torch:" in out and str(torch.__version__) in out
    expected = "CUDA graphs can run here" if torch.cuda.is_available() else "CUDA graphs cannot run here"
    assert expected in out


def test_doctor_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"ok", "verdict", "lines"}
    assert ["torch", str(torch.__version__)] in data["lines"]
    assert data["ok"] is torch.cuda.is_available()


@needs_no_cuda
def test_demo_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == NO_GPU  # said plainly, first
    assert "tokens match: yes" in out
    assert "device:  cpu" in out
    assert str(torch.__version__) in out
    assert "CPU: graphs not available, eager only" in out
    assert "speedup" not in out and "ms/step" not in out  # no ratio of two eager runs to disbelieve
    assert "recordings:" in out and "replays:" in out and "eager runs:" in out


def test_demo_reports_mismatch(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import graphtree

    def bad_graphed(fn, **kwargs):  # type: ignore[no-untyped-def]
        def step(tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            logits = fn(tokens, pos).clone()
            logits[:, 0] = float("inf")  # always picks token 0
            return logits

        return step

    monkeypatch.setattr(graphtree, "graphed", bad_graphed)
    assert (
        main(
            ["demo", "--steps", "2", "--layers", "1", "--d-model", "16", "--heads", "2", "--vocab", "64", "--seed", "3"]
        )
        == 1
    )
    assert "tokens match: no" in capsys.readouterr().out


def test_demo_rejects_bad_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--d-model", "30", "--heads", "4", "--steps", "1"]) == 2
    assert "divisible" in capsys.readouterr().err
    assert main(["demo", "--steps", "0"]) == 2


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    import graphtree

    try:
        expected = metadata.version("graphtree")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        expected = graphtree.__version__
    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out == f"graphtree {expected} (torch {torch.__version__}, Python {sys.version.split()[0]})"


def test_version_without_installed_metadata(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from importlib import metadata

    import graphtree

    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"graphtree {graphtree.__version__} (torch {torch.__version__}")


def test_version_matches_pyproject() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    import graphtree

    pyproject = REPO / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("no pyproject.toml beside the tests")
    with pyproject.open("rb") as f:
        assert tomllib.load(f)["project"]["version"] == graphtree.__version__


def test_no_command_and_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["no-such-command"]) == 2
    assert main(["--help"]) == 0
    assert "doctor" in capsys.readouterr().out


@pytest.mark.parametrize("name,module", [("bench", "graphtree.bench"), ("profile", "graphtree.profile.cli")])
def test_passthrough_keeps_arguments(monkeypatch: pytest.MonkeyPatch, name: str, module: str) -> None:
    seen: list[list[str]] = []
    fake = types.ModuleType(module)
    fake.main = lambda argv: seen.append(list(argv)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, fake)
    rest = ["-o", "trace.json", "--", "python", "script.py", "--steps", "3", "--help"]
    assert main([name, *rest]) == 7
    assert seen == [rest]


def test_passthrough_system_exit_and_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("graphtree.bench")

    def exits(argv: list[str]) -> None:
        raise SystemExit(3)

    fake.main = exits  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "graphtree.bench", fake)
    assert main(["bench"]) == 3
    fake.main = lambda argv: None  # type: ignore[attr-defined]
    assert main(["bench", "x"]) == 0


@pytest.mark.parametrize("name,module", [("bench", "graphtree.bench"), ("profile", "graphtree.profile.cli")])
def test_passthrough_missing_package(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str, module: str
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    assert main([name, "--anything"]) == 2
    err = capsys.readouterr().err
    assert f"graphtree {name} is not available" in err


@pytest.mark.parametrize("name", ["bench", "profile"])
def test_real_passthrough_help_does_not_crash(name: str) -> None:
    # whether or not the package exists yet, --help must come back as a status, not an exception
    rc = main([name, "--help"])
    assert isinstance(rc, int)


def test_python_dash_m() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "graphtree", "doctor", "--json"],
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "verdict" in json.loads(proc.stdout)
