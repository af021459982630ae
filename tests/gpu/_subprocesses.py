"""What the GPU tests that work in subprocesses share: the environment that imports this checkout's
graphtree (the tests' own, wherever they run from), ``graphtree debug rerun`` of a dump, and the head
of a script that graphs a tiny random-weight Llama with ``debug=sys.argv[1]``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])

TINY_LLAMA_DEBUGGED = textwrap.dedent(
    """
    import sys, torch, graphtree
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = graphtree.graphed(LlamaForCausalLM(config).cuda().eval(), debug=sys.argv[1])
    ids = torch.randint(0, 128, (1, 8), device="cuda")
    """
)


def repo_env() -> dict[str, str]:
    """The environment with this checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}


def rerun(dump: Path, cwd: Path, *extra: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], float]:
    """``graphtree debug rerun DUMP *extra`` from ``cwd``, and the seconds it took."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "graphtree", "debug", "rerun", str(dump), *extra],
        cwd=cwd,
        env=repo_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return proc, time.perf_counter() - t0
