"""``graphtree debug rerun``: a dumped call run again in a fresh process (CPU)."""

import importlib
import sys
import textwrap

import pytest
import torch

from graphtree.cli import main as cli_main
from graphtree.debug import write_dump
from graphtree.debug.rerun import CRASHED, NOT_REPRODUCED, REPRODUCED, UNUSABLE, rerun

MODULE = textwrap.dedent(
    """
    import os
    import torch

    FAIL = True

    def pick(x, i):
        return x[i] * 2

    def flaky(x):
        if FAIL:
            raise RuntimeError("only in the original process")
        return x

    def dies(x):
        os._exit(7)
    """
)


@pytest.fixture
def mod(tmp_path, monkeypatch):
    (tmp_path / "user_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    sys.modules.pop("user_mod", None)
    import user_mod

    yield user_mod
    sys.modules.pop("user_mod", None)


def _dump(tmp_path, fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - the error being dumped
        err = e
    else:
        err = None
    return write_dump(tmp_path / "d.gtdump", fn, args, {}, err)


def test_the_error_reproduces_at_the_users_line(mod, tmp_path):
    path = _dump(tmp_path, mod.pick, torch.arange(3.0), 10)
    r = rerun(path)
    assert r["status"] == REPRODUCED and r["error"].startswith("IndexError"), r
    assert r["where"]["file"].endswith("user_mod.py") and r["where"]["code"] == "return x[i] * 2"


def test_an_error_that_does_not_come_back_says_so(mod, tmp_path):
    r = rerun(_dump(tmp_path, mod.flaky, torch.ones(2)))
    assert r["status"] == REPRODUCED  # FAIL is True in the module as written
    mod_text = (tmp_path / "user_mod.py").read_text().replace("FAIL = True", "FAIL = False")
    (tmp_path / "user_mod.py").write_text(mod_text)
    assert rerun(tmp_path / "d.gtdump")["status"] == NOT_REPRODUCED


def test_unusable_dumps_and_crashes_are_told_apart(mod, tmp_path):
    r = rerun(write_dump(tmp_path / "l.gtdump", lambda x: x, (torch.ones(1),), {}))
    assert r["status"] == UNUSABLE and "cannot be imported" in r["error"]
    r = rerun(write_dump(tmp_path / "x.gtdump", mod.dies, (1,), {}))  # the process dies mid-call
    assert r["status"] == CRASHED and "exit status 7" in r["error"]


def test_the_command_line(mod, tmp_path, capsys):
    path = _dump(tmp_path, mod.pick, torch.arange(3.0), 10)
    assert cli_main(["debug", "rerun", str(path)]) == REPRODUCED
    out = capsys.readouterr().out
    assert "reproduced: IndexError" in out and "user_mod.py" in out
    assert cli_main(["debug", "rerun", str(tmp_path / "missing.gtdump")]) == UNUSABLE


def test_cuda_gdb_command_reruns_the_dump_and_a_missing_debugger_is_named(mod, tmp_path, capsys, monkeypatch):
    doctor = importlib.import_module("graphtree.debug.doctor")  # the module (graphtree.debug.doctor is also a function)
    monkeypatch.setattr(doctor, "find_cuda_tool", lambda name: None)  # no cuda-gdb, wherever this runs
    path = _dump(tmp_path, mod.pick, torch.arange(3.0), 10)
    assert cli_main(["debug", "rerun", str(path), "--cuda-gdb"]) == 0  # printed, not run
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("cuda-gdb ") and line.endswith(f"-m graphtree.debug.rerun --inner {path}")
    assert "--args" in line and "-ex run" in line
    assert cli_main(["debug", "rerun", str(path), "--cuda-gdb", "--run"]) == 4
    assert "cuda-gdb is not installed: it comes with the CUDA toolkit" in capsys.readouterr().err
    assert cli_main(["debug", "rerun", str(path), "--run"]) == 2  # --run alone is a usage error
