"""compute-sanitizer re-runs (graphtree.debug.sanitizer), on the CPU: the parser against reports
recorded on a GPU (tests/fixtures/sanitizer/README.md), the command, and a missing tool."""

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

from graphtree.debug import write_dump
from graphtree.debug.sanitizer import TOOLS, parse_report, render, sanitizer_command

FIXTURES = Path(__file__).parent / "fixtures" / "sanitizer"


def _read(name: str) -> str:
    return gzip.decompress((FIXTURES / f"{name}.gz").read_bytes()).decode()


def test_an_out_of_bounds_write_is_grouped_by_kernel_with_its_python_line():
    report = parse_report(_read("memcheck-write.xml"), _read("memcheck-write.log"))
    first, launch = report.groups
    assert first.count == 32 and first.text == "Invalid __global__ write of size 4 bytes is out of bounds"
    assert first.kernel == "_write_past_end" and first.source == "_faults.py:22"
    assert first.python.endswith("tests/gpu/_faults.py:28 in scribble")  # not triton's launcher
    assert first.first.thread == "(0,0,0)" and first.first.address.startswith("0x")
    assert launch.kernel == "" and "cuLaunchKernelEx" in launch.text
    assert report.total == 33 and report.noise == [] and report.summary_total == 33
    text = render(report)
    assert "32 x Invalid __global__ write" in text and "kernel _write_past_end (at _faults.py:22)" in text
    assert "launched from" in text and "_faults.py:28 in scribble" in text


def test_a_device_side_assert_names_the_python_line_and_says_the_kernel_is_not_named():
    report = parse_report(_read("memcheck-assert.xml"), _read("memcheck-assert.log"))
    asserts = [g for g in report.groups if g.text == "Warp assert"]
    assert len(asserts) == 1 and asserts[0].count == 4
    assert all(g.python.endswith("_faults.py:15 in lookup") for g in report.groups)
    assert "not named by the sanitizer" in render(report)


def test_a_clean_run_has_no_findings():
    report = parse_report(_read("memcheck-conv.xml"), _read("memcheck-conv.log"))
    assert (report.groups, report.noise, report.total, report.summary_total) == ([], [], 0, 0)
    assert render(report).startswith("compute-sanitizer memcheck: 0 findings")


def test_findings_inside_cudnn_or_cublas_are_set_aside_as_noise():
    # the recorded report, with one record's launch moved into cuBLAS (the noise the filter is for)
    xml = _read("memcheck-write.xml")
    start = xml.index("<record>")
    end = xml.index("</record>", start)
    record = xml[start:end].replace("__triton_launcher", "libcublasLt.so.13", 1)
    report = parse_report(xml[:start] + record + xml[end:])
    assert [g.count for g in report.noise] == [1] and report.groups[0].count == 31
    assert "1 inside cuDNN/cuBLAS set aside as noise (--all shows them)" in render(report)
    assert render(report, show_noise=True).count("Invalid __global__ write") == 2


@pytest.mark.parametrize("text", ["", "<html/>", "not xml at all"])
def test_what_is_not_a_report_is_refused(text):
    with pytest.raises(ValueError, match="not a compute-sanitizer XML report"):
        parse_report(text)


def test_the_command_checks_the_named_kernel_only_and_saves_xml(tmp_path):
    cmd = sanitizer_command(tmp_path / "d.gtdump", "racecheck", tmp_path / "r.xml", kernel="attn")
    assert cmd[:6] == ["compute-sanitizer", "--tool", "racecheck", "--xml", "--save", str(tmp_path / "r.xml")]
    assert cmd[cmd.index("--kernel-name") + 1] == "kns=attn"
    assert cmd[-5:] == [sys.executable, "-m", "graphtree.debug.rerun", "--inner", str(tmp_path / "d.gtdump")]
    assert set(TOOLS) == {"memcheck", "racecheck", "initcheck", "synccheck"}
    with pytest.raises(ValueError, match="one of memcheck"):
        sanitizer_command("d", "helgrind", "r.xml")


def double(x):
    return x * 2


def test_a_missing_sanitizer_exits_4_with_the_install_hint(tmp_path):
    import torch

    dump = write_dump(tmp_path / "d.gtdump", double, (torch.ones(2),), {})
    env = {"PATH": str(tmp_path), "CUDA_HOME": str(tmp_path / "none"), "PYTHONPATH": ":".join(sys.path)}
    cmd = [sys.executable, "-m", "graphtree", "debug", "rerun", str(dump), "--sanitizer", "memcheck"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "compute-sanitizer is not installed" in proc.stderr


@pytest.mark.parametrize("extra", [["--kernel", "k"], ["--all"], ["--sanitizer", "memcheck", "--cuda-gdb"]])
def test_options_that_do_not_go_together_are_refused(tmp_path, extra):
    import torch

    dump = write_dump(tmp_path / "d.gtdump", double, (torch.ones(2),), {})
    from graphtree.debug.rerun import main

    assert main(["rerun", str(dump), *extra]) == 2


FAKE_SANITIZER = """#!{python}
# Stands in for compute-sanitizer: writes a report recorded on the GPU where --save says, prints its
# text output, and exits as the real one did.
import gzip, sys
args = sys.argv[1:]
report = args[args.index("--save") + 1]
with open(report, "wb") as f:
    f.write(gzip.decompress(open({xml!r}, "rb").read()))
sys.stdout.write(gzip.decompress(open({log!r}, "rb").read()).decode())
sys.exit(0)
"""


def test_a_sanitizer_rerun_parses_the_report_beside_the_dump_and_exits_1(tmp_path):
    import torch

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "compute-sanitizer"
    fake.write_text(
        FAKE_SANITIZER.format(
            python=sys.executable,
            xml=str(FIXTURES / "memcheck-write.xml.gz"),
            log=str(FIXTURES / "memcheck-write.log.gz"),
        )
    )
    fake.chmod(0o755)
    dump = write_dump(tmp_path / "d.gtdump", double, (torch.ones(2),), {})
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)}
    cmd = [sys.executable, "-m", "graphtree", "debug", "rerun", str(dump), "--sanitizer", "memcheck"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # 1: the sanitizer found errors
    assert "32 x Invalid __global__ write of size 4 bytes is out of bounds" in proc.stdout
    assert "kernel _write_past_end (at _faults.py:22)" in proc.stdout
    assert (tmp_path / "d.gtdump.memcheck.xml").is_file() and (tmp_path / "d.gtdump.memcheck.log").is_file()
    assert "compute-sanitizer memcheck" in proc.stderr  # the progress line (tqdm writes to stderr)
