"""Planted faults, graphed and eager (issue: debugging): a device-side assert in torch's index
kernel and an out-of-bounds write in a Triton kernel. For each: the dump is written although the
CUDA context is dead, it loads, ``graphtree debug rerun`` names the kernel and the Python line
(exit 1), and ``--sanitizer memcheck`` reports the fault with the kernel and the line (exit 1).
Every faulting process is a subprocess with a timeout: a sticky CUDA error ends its context."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from graphtree.debug import load_dump

pytestmark = pytest.mark.own_process  # all it checks runs in subprocesses (gpu_session.sh: `own`, `files`)

HERE = Path(__file__).resolve().parent
BAD = {"assert": 1000, "write": 4_000_000_000}
KERNEL = {"assert": "index", "write": "_write_past_end"}
LINE = {"assert": "_faults.py:15 in lookup", "write": "_faults.py:28 in scribble"}

PRODUCER = """
import sys, time, torch, graphtree
from graphtree.debug import dump_on_error
import _faults

kind, mode, folder = sys.argv[1:4]
fn = _faults.lookup if kind == "assert" else _faults.scribble
data = torch.randn(64, device="cuda")
n = 4 if kind == "assert" else 1
good = torch.zeros(n, dtype=torch.long, device="cuda")
bad = torch.full((n,), int(sys.argv[4]), dtype=torch.long, device="cuda")
f = graphtree.graphed(fn, debug=folder) if mode == "graphed" else dump_on_error(fn, dir=folder, snapshot=True)
at = "setup"
try:
    for _ in range(3):  # warm-up, record, replay (graphed)
        graphtree.mark_step()
        f(data, good)
    torch.cuda.synchronize()
    graphtree.mark_step()
    at = "bad"
    f(data, bad)  # the fault: CUDA may report it in this call or only at the next one
    time.sleep(0.5)
    graphtree.mark_step()
    at = "next"
    f(data, good)
    at = "sync"
    torch.cuda.synchronize()
    print("NO ERROR")
except Exception as e:
    print("AT", at)
    print("RAISED", type(e).__name__)
    print(str(e).splitlines()[0])
    for note in getattr(e, "__notes__", []):
        print("NOTE", note)
print("STATS", graphtree.stats().replays if mode == "graphed" else "eager")
"""

CASES = [(k, m) for k in ("assert", "write") for m in ("eager", "graphed")]


def _env() -> dict:
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Run each planted fault once (the four at the same time, each in its own process); (producer
    output, the dump holding the bad input) per case."""
    pytest.importorskip("triton")
    folders = {case: tmp_path_factory.mktemp("-".join(case)) for case in CASES}
    procs = {
        (kind, mode): subprocess.Popen(
            [sys.executable, "-c", PRODUCER, kind, mode, str(folders[kind, mode]), str(BAD[kind])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        for kind, mode in CASES
    }
    out = {}
    for (kind, mode), popen in procs.items():
        stdout, stderr = popen.communicate(timeout=300)
        proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
        folder = folders[kind, mode]
        bad = [p for p in sorted(folder.glob("*.gtdump")) if int(load_dump(p).args[1].max()) == BAD[kind]]
        out[kind, mode] = (proc, bad[0] if bad else None, sorted(folder.glob("*.gtdump")))
    return out


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_the_dump_is_written_although_the_context_is_dead_and_loads(dumps, kind, mode):
    proc, bad, every = dumps[kind, mode]
    text = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0 and "RAISED" in proc.stdout, text
    assert bad is not None, (text, every)
    d = load_dump(bad)
    assert d.target == f"_faults:{'lookup' if kind == 'assert' else 'scribble'}"
    assert d.tensors[0]["device"] == "cuda:0" and d.args[0].shape == (64,)
    if mode == "graphed":
        # the fault inside the replay surfaced in a graphed call; the error names the recording
        assert "RAISED GraphReplayError" in proc.stdout, text
        # the bad input is the call that raised's dump when the fault surfaced in it, the -before
        # one when it surfaced at the next call (when CUDA reports it is up to the GPU's timing)
        at = proc.stdout.split("AT ", 1)[1].split()[0]
        assert at in ("bad", "next"), text
        assert bad.name.endswith("-before.gtdump") == (at == "next"), (at, every)
    assert f"NOTE graphtree: a dump of {d.origin}" in proc.stdout, text


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_rerun_names_the_kernel_and_the_python_line(dumps, kind, mode):
    _, bad, _ = dumps[kind, mode]
    assert bad is not None
    cmd = [sys.executable, "-m", "graphtree", "debug", "rerun", str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env(), check=False)
    text = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, text  # 1: reproduced
    kernel_line = next((line for line in proc.stdout.splitlines() if "kernel:" in line), "")
    assert KERNEL[kind] in kernel_line, text
    assert LINE[kind] in proc.stdout, text
    if kind == "assert":
        assert "device-side assertion: " in proc.stdout and "index out of bounds" in proc.stdout, text


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_memcheck_reports_the_fault_with_the_kernel_and_the_line(dumps, kind, mode):
    if shutil.which("compute-sanitizer") is None and not Path("/usr/local/cuda/bin/compute-sanitizer").exists():
        pytest.skip("compute-sanitizer is not installed")
    _, bad, _ = dumps[kind, mode]
    assert bad is not None
    cmd = [sys.executable, "-m", "graphtree", "debug", "rerun", str(bad), "--sanitizer", "memcheck"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), check=False)
    text = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 1, text  # 1: the sanitizer found errors
    assert LINE[kind].split(" in ")[0] in proc.stdout, text
    if kind == "write":
        assert "Invalid __global__ write" in proc.stdout and "kernel _write_past_end" in proc.stdout, text
    keep = os.environ.get("GRAPHTREE_FIXTURE_OUT")
    if keep and mode == "eager":  # the reports committed as fixtures for the CPU parser tests
        for suffix in (".memcheck.xml", ".memcheck.log"):
            shutil.copy(f"{bad}{suffix}", Path(keep) / f"memcheck-{kind}{suffix}")


def test_a_clean_cudnn_and_cublas_call_reports_nothing_under_memcheck(tmp_path):
    """What memcheck says inside cuDNN and cuBLAS is set aside as noise: a clean call exits 0."""
    if shutil.which("compute-sanitizer") is None and not Path("/usr/local/cuda/bin/compute-sanitizer").exists():
        pytest.skip("compute-sanitizer is not installed")
    sys.path.insert(0, str(HERE))
    try:
        import _faults
    finally:
        sys.path.remove(str(HERE))
    import torch

    from graphtree.debug import write_dump

    x, w = torch.randn(2, 8, 16, 16, device="cuda"), torch.randn(8, 8, 3, 3, device="cuda")
    dump = write_dump(tmp_path / "conv.gtdump", _faults.conv, (x, w), {})
    cmd = [sys.executable, "-m", "graphtree", "debug", "rerun", str(dump), "--sanitizer", "memcheck", "--all"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=_env(), check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "compute-sanitizer memcheck: 0 findings" in proc.stdout, proc.stdout
    keep = os.environ.get("GRAPHTREE_FIXTURE_OUT")
    if keep:
        for suffix in (".memcheck.xml", ".memcheck.log"):
            shutil.copy(f"{dump}{suffix}", Path(keep) / f"memcheck-conv{suffix}")
