"""Faults that surface late, where graphtree is not on the stack (issue 45, item 5), on a GPU.

A function of an importable module, graphed with ``debug=dir``, does embedding lookups whose index
is out of range on its 4th to 6th calls; the device-side assert surfaces at the caller's own
``torch.cuda.synchronize()``, ``.item()``, ``.cpu()`` or ``print(tensor)``, inside the caller's
``try``. Before the fix no dump was written and the error carried no note (the excepthook only saw
errors nobody caught). Now the dumps of the last call and the one before are written where the
error is raised, named on stderr and in notes on the error the caller catches; ``graphtree debug
rerun`` of the last call's dump names the kernel and the faulting line. The same for a graphed
Hugging Face Llama fed a token id past its vocabulary. Each faulting process is a subprocess with a
timeout: a device-side assert ends its CUDA context.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _subprocesses import TINY_LLAMA_DEBUGGED, repo_env, rerun

pytestmark = pytest.mark.own_process  # all it checks runs in subprocesses (gpu_session.sh: `own`, `files`)

MODULE = textwrap.dedent(
    """
    import torch

    table = torch.randn(10, 4, device="cuda")

    def lookup(ids):
        return torch.nn.functional.embedding(ids, table) * 2  # the faulting line
    """
)

SCRIPT = textwrap.dedent(
    """
    import sys, torch, graphtree
    import faulty

    step = graphtree.graphed(faulty.lookup, debug=sys.argv[1])
    good = torch.zeros(4, dtype=torch.long, device="cuda")
    bad = torch.full((4,), 1000, dtype=torch.long, device="cuda")
    outs = []
    try:
        for i in range(6):
            graphtree.mark_step()
            outs.append(step(good if i < 3 else bad))  # calls 4 to 6 index past the table
        print("SURFACE")
        {surface}
    except Exception as e:
        print("CAUGHT", type(e).__name__)
        for note in getattr(e, "__notes__", []):
            print("NOTE", note)
    """
)

SURFACES = {
    "synchronize": "torch.cuda.synchronize()",
    "item": "outs[-1].sum().item()",
    "cpu": "outs[-1].cpu()",
    "print": "print(outs[-1])",
}

HF = TINY_LLAMA_DEBUGGED + textwrap.dedent(
    """\
    with torch.inference_mode():
        for i in range(4):
            graphtree.mark_step()
            logits = model(input_ids=ids if i < 3 else ids + 1000, use_cache=False).logits
        try:
            torch.cuda.synchronize()
        except Exception as e:
            print("CAUGHT", type(e).__name__)
            for note in getattr(e, "__notes__", []):
                print("NOTE", note)
    """
)


def _run(script: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], list[Path]]:
    job = tmp_path / "job"
    job.mkdir()
    (job / "faulty.py").write_text(MODULE)
    (job / "script.py").write_text(script)
    proc = subprocess.run(
        [sys.executable, "script.py", str(tmp_path / "dumps")],
        cwd=job,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    dumps = sorted((tmp_path / "dumps").glob("*.gtdump"), key=lambda p: "-before" in p.name)
    return proc, dumps


@pytest.mark.parametrize("surface", sorted(SURFACES))
def test_a_fault_caught_by_the_caller_leaves_dumps_named_in_its_notes(surface, tmp_path):
    proc, dumps = _run(SCRIPT.format(surface=SURFACES[surface]), tmp_path)
    out = proc.stdout + proc.stderr[-3000:]
    assert "CAUGHT" in proc.stdout, out  # the caller's own except clause got the CUDA error
    assert "SURFACE" in proc.stdout, out  # where the issue met it: not in a graphed call, at the caller's line
    assert len(dumps) == 2, out  # the last call and the one before
    notes = [line for line in proc.stdout.splitlines() if line.startswith("NOTE")]
    for dump in dumps:
        assert any(str(dump) in n for n in notes), out  # named in the error the caller caught
        assert str(dump) in proc.stderr, out  # and on stderr
    if surface != "synchronize":
        return
    (tmp_path / "elsewhere").mkdir()
    again, _ = rerun(dumps[0], tmp_path / "elsewhere", timeout=300)
    assert again.returncode == 1, again.stdout + again.stderr[-3000:]  # reproduced
    assert "faulty.py" in again.stdout and "# the faulting line" in again.stdout, again.stdout
    assert "kernel:" in again.stdout and "not named" not in again.stdout, again.stdout


def test_a_hugging_face_model_fed_a_bad_token_leaves_its_dumps_in_the_callers_error(tmp_path):
    pytest.importorskip("transformers")
    proc, dumps = _run(HF, tmp_path)
    out = proc.stdout + proc.stderr[-3000:]
    assert "CAUGHT" in proc.stdout and dumps, out
    assert any(str(dumps[0]) in line for line in proc.stdout.splitlines() if line.startswith("NOTE")), out
