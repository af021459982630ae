"""Dumps of the code people write (issue 30), on a GPU: a graphed function of a script whose fault
surfaces at the user's own ``torch.cuda.synchronize()``, and a graphed Hugging Face model fed a
token id past its vocabulary. Each writes its dump; ``graphtree debug rerun`` re-runs it from
another folder (exit 1, naming the line) and ``--sanitizer memcheck`` reports it (exit 1). Every
faulting process is a subprocess with a timeout: a sticky CUDA error ends its context."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _subprocesses import TINY_LLAMA_DEBUGGED, repo_env, rerun

pytestmark = pytest.mark.own_process  # all it checks runs in subprocesses (gpu_session.sh: `own`, `files`)

LATE_FAULT = textwrap.dedent(
    """
    import sys, torch, graphtree
    table = torch.randn(10, 4, device="cuda")

    def lookup(ids):
        return table[ids] * 2  # the faulting line

    step = graphtree.graphed(lookup, debug=sys.argv[1])
    good = torch.zeros(4, dtype=torch.long, device="cuda")
    for _ in range(3):  # warm-up, record, replay
        graphtree.mark_step()
        step(good)
    torch.cuda.synchronize()
    graphtree.mark_step()
    step(torch.full((4,), 1000, dtype=torch.long, device="cuda"))  # a replay that faults, asynchronously
    torch.cuda.synchronize()  # the user's own sync: the fault surfaces here, outside graphtree
    print("NO ERROR")
    """
)

HF_MODEL = TINY_LLAMA_DEBUGGED + textwrap.dedent(
    """\
    with torch.inference_mode():
        for _ in range(3):
            graphtree.mark_step()
            model(input_ids=ids, use_cache=False)
        torch.cuda.synchronize()
        graphtree.mark_step()
        model(input_ids=ids + 1000, use_cache=False)  # token ids past the vocabulary
        torch.cuda.synchronize()
    print("NO ERROR")
    """
)


def _fault_and_rerun(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path, list[str]]:
    (tmp_path / "job").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "job" / "script.py").write_text(script)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "script.py", str(tmp_path / "dumps")],
        cwd=tmp_path / "job",
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    times = [f"faulting run {time.perf_counter() - t0:.1f} s"]
    assert "NO ERROR" not in proc.stdout, proc.stdout
    dumps = sorted((tmp_path / "dumps").glob("*.gtdump"), key=lambda p: "-before" in p.name)
    assert dumps, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    return proc, dumps[0], times


def test_a_fault_surfacing_at_the_users_synchronize_is_dumped_and_reruns(tmp_path, capsys):
    proc, dump, times = _fault_and_rerun(LATE_FAULT, tmp_path)
    assert "surfaced outside the graphed calls" in proc.stderr, proc.stderr[-4000:]
    again, took = rerun(dump, tmp_path / "elsewhere")
    times.append(f"rerun {took:.1f} s")
    assert again.returncode == 1, again.stdout + again.stderr[-3000:]
    assert "script.py" in again.stdout and "return table[ids] * 2  # the faulting line" in again.stdout, again.stdout
    checked, took = rerun(dump, tmp_path / "elsewhere", "--sanitizer", "memcheck")
    times.append(f"memcheck {took:.1f} s")
    assert checked.returncode == 1, checked.stdout + checked.stderr[-3000:]
    with capsys.disabled():
        print(f"\nDUMP late fault: {', '.join(times)}", flush=True)


def test_a_graphed_hugging_face_model_fed_a_bad_token_is_dumped_with_its_weights_and_reruns(tmp_path, capsys):
    pytest.importorskip("transformers")
    _, dump, times = _fault_and_rerun(HF_MODEL, tmp_path)
    again, took = rerun(dump, tmp_path / "elsewhere")
    times.append(f"rerun {took:.1f} s")
    assert again.returncode == 1, again.stdout + again.stderr[-3000:]  # was 2: "cannot be imported"
    assert "reproduced" in again.stdout, again.stdout
    checked, took = rerun(dump, tmp_path / "elsewhere", "--sanitizer", "memcheck")
    times.append(f"memcheck {took:.1f} s")
    assert checked.returncode == 1, checked.stdout + checked.stderr[-3000:]
    with capsys.disabled():
        print(f"\nDUMP hf model: {', '.join(times)}", flush=True)
