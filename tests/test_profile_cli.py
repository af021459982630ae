"""``graphtree profile -o trace.json [--pprof gpu.pb.gz] -- python script.py args`` (fake CUPTI)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))

from graphtree.profile.cli import _split_command, main

SCRIPT = textwrap.dedent(
    """
    import sys
    from cupti import cupti          # the fake, installed by the test
    SIM = cupti.SIM

    def model_step():
        SIM.launch_kernel("cli_kernel")

    def main():
        exe = SIM.capture(model_step)
        for _ in range(3):
            SIM.graph_launch(exe)
        print("argv", sys.argv[1:])
        code = int(sys.argv[2]) if len(sys.argv) > 2 else 0
        sys.exit(code)

    if __name__ == "__main__":
        main()
    """
)


def _script(tmp_path):
    p = tmp_path / "train.py"
    p.write_text(SCRIPT)
    return p


def test_cli_profiles_a_script_and_writes_outputs(fake_cupti, tmp_path, capsys):
    script = _script(tmp_path)
    trace, pb = tmp_path / "trace.json", tmp_path / "gpu.pb.gz"
    rc = main(["-o", str(trace), "--pprof", str(pb), "--", "python", str(script), "--flag"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "argv ['--flag']" in out
    assert "cli_kernel" in err and "train.py:" in err and "model_step" in err
    with open(trace) as f:
        doc = json.load(f)
    assert sum(1 for e in doc["traceEvents"] if e["name"] == "cli_kernel") == 3
    assert pb.stat().st_size > 0
    assert "wrote Chrome trace" in err


def test_cli_returns_the_script_exit_status(fake_cupti, tmp_path, capsys):
    script = _script(tmp_path)
    assert main(["--no-table", "--", sys.executable, str(script), "x", "3"]) == 3


def test_cli_accepts_the_profile_subcommand_name_and_module_mode(fake_cupti, tmp_path, capsys, monkeypatch):
    (tmp_path / "gt_cli_mod.py").write_text(SCRIPT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["profile", "--", "python", "-m", "gt_cli_mod"]) == 0
    assert "cli_kernel" in capsys.readouterr().err


def test_cli_reports_a_busy_profiler(fake_cupti, tmp_path, capsys):
    fake_cupti.SIM.other_subscriber = "ncu"
    rc = main(["--", "python", str(_script(tmp_path))])
    assert rc == 2 and "'ncu'" in capsys.readouterr().err


def test_cli_usage_errors(fake_cupti, tmp_path, capsys):
    assert main(["-o", "t.json"]) == 2
    assert main(["--", "python", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err


def test_split_command():
    assert _split_command(["--", "python3", "-u", "a.py", "x"]) == ("path", "a.py", ["x"])
    assert _split_command(["python", "-m", "pkg.mod", "--y"]) == ("module", "pkg.mod", ["--y"])
    assert _split_command(["b.py"]) == ("path", "b.py", [])
    assert _split_command(["python", "-c", "print(1)", "z"]) == ("code", "print(1)", ["z"])


def test_graphtree_cli_dispatches_to_profile(fake_cupti, tmp_path, capsys):
    from graphtree.cli import main as graphtree_main

    assert graphtree_main(["profile", "--no-table", "--", "python", str(_script(tmp_path))]) == 0
