"""``graphtree debug rerun``: a dumped call run again in a fresh process (CPU)."""

import importlib
import subprocess
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
    import threading

    lock = threading.Lock()  # a closure over a lock cannot be kept by value
    r = rerun(write_dump(tmp_path / "l.gtdump", lambda x: lock and x, (torch.ones(1),), {}))
    assert r["status"] == UNUSABLE and "cannot be rebuilt" in r["error"] and "could not be saved" in r["error"], r
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


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from graphtree.debug import dump_on_error
    import helpers  # beside the script: importable where it runs (its folder is on sys.path)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).relu()  # the failing line of the module

    def divide(x, n):
        return x // n  # the failing line of the function

    calls = {
        "function": (divide, (torch.arange(4), torch.zeros((), dtype=torch.long))),
        "lambda": (lambda x: x[10], (torch.arange(3),)),
        "module": (Net(), (torch.ones(2, 5),)),
        "imported": (helpers.halve, (torch.arange(4), torch.zeros((), dtype=torch.long))),
    }
    fn, args = calls[sys.argv[1]]
    try:
        dump_on_error(fn, dir="dumps")(*args)
    except Exception as e:
        print("RAISED", type(e).__name__)
    """
)
WHERE = {
    "function": "return x // n  # the failing line of the function",
    "lambda": '"lambda": (lambda x: x[10], (torch.arange(3),)),',
    "module": "return self.lin(x).relu()  # the failing line of the module",
    "imported": "return x // n  # helpers.py",
}


def _fail_in_a_script_and_rerun_elsewhere(tmp_path, script, *argv, timeout=120):
    """Run ``script`` as ``python script.py *argv`` in ``job/`` (it prints RAISED and leaves one dump
    in ``job/dumps``, within ``timeout`` s), then ``graphtree debug rerun`` that dump from ``elsewhere/``."""
    (tmp_path / "job").mkdir(exist_ok=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "job" / "script.py").write_text(script)
    ran = subprocess.run(
        [sys.executable, "script.py", *argv],
        check=False,
        cwd=tmp_path / "job",
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert "RAISED" in ran.stdout, ran.stderr[-2000:]
    (dump,) = (tmp_path / "job" / "dumps").glob("*.gtdump")
    return subprocess.run(
        [sys.executable, "-m", "graphtree", "debug", "rerun", str(dump)],
        check=False,
        cwd=tmp_path / "elsewhere",
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["function", "lambda", "module", "imported"])
def test_a_scripts_function_lambda_and_module_rerun_from_another_folder(tmp_path, kind):
    # issue 30: a function of the script that was run (__main__), a lambda and an nn.Module of the
    # script could not be re-run ("cannot be imported", "module '__main__' has no attribute"), and
    # a module beside the script could not be imported from another folder (ModuleNotFoundError)
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "helpers.py").write_text("def halve(x, n):\n    return x // n  # helpers.py\n")
    again = _fail_in_a_script_and_rerun_elsewhere(tmp_path, SCRIPT, kind)
    assert again.returncode == REPRODUCED, again.stdout + again.stderr[-2000:]
    file = "helpers.py" if kind == "imported" else "script.py"
    assert f"job/{file}:" in again.stdout and WHERE[kind] in again.stdout, again.stdout


HF_SCRIPT = textwrap.dedent(
    """
    import torch, graphtree
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = graphtree.graphed(LlamaForCausalLM(config).eval(), debug="dumps")
    ids = torch.randint(0, 128, (1, 8))
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
        try:
            model(input_ids=ids + 1000, use_cache=False)  # token ids past the vocabulary
        except IndexError as e:
            print("RAISED", e)
    """
)


def test_a_graphed_hugging_face_model_is_dumped_with_its_weights_and_reruns(tmp_path):
    # issue 30: its dump could not be re-run ("an instance of LlamaForCausalLM: rebuild it")
    pytest.importorskip("transformers")
    again = _fail_in_a_script_and_rerun_elsewhere(tmp_path, HF_SCRIPT, timeout=300)
    assert again.returncode == REPRODUCED, again.stdout + again.stderr[-2000:]
    assert "modeling_llama.py" in again.stdout and "self.embed_tokens(input_ids)" in again.stdout, again.stdout
