"""The README's first snippet runs as pasted (issue 25): on the CPU it runs eagerly and says why;
``tests/gpu/test_readme_gpu.py`` runs it on a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def first_snippet() -> str:
    """The first ```python block of the README."""
    found = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    assert found, "the README has a python snippet"
    return found.group(1)


def run_snippet() -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", first_snippet()], capture_output=True, text=True, timeout=300, check=False
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path (tests/gpu/test_readme_gpu.py on a GPU)")
def test_the_first_snippet_runs_as_pasted_on_the_cpu_and_prints_what_the_readme_says():
    proc = run_snippet()
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.strip()
    assert printed.startswith("graphtree: 0 recordings") and "eager runs: no CUDA: 5" in printed, printed
    said = " ".join(README.read_text().split("On the CPU it prints `")[1].split("`")[0].split())
    assert printed == said, (printed, said)
    assert "running `Sequential` eagerly: no CUDA" in proc.stderr, proc.stderr[-2000:]
