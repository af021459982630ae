"""The README's first snippet, as pasted, on a GPU: one warm-up, one recording, three replays."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_readme import run_snippet


def test_the_first_snippet_runs_as_pasted_on_a_gpu(capsys):
    assert torch.cuda.is_available()
    proc = run_snippet()
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = proc.stdout.strip()
    with capsys.disabled():  # the README shows this line
        print(f"\nREADME snippet on {torch.cuda.get_device_name()}: {printed}", flush=True)
    # what the README says: the first call warms up, the second records and the last three replay
    assert printed.startswith("graphtree: 1 recordings (0 re-recordings"), printed
    assert ", 3 replays, 1 warm-ups; eager runs: none; pool" in printed, printed
