"""What the README says of ``torch.compile`` inside a graphed function: dynamo does not compile
while a dispatch mode is active (graphtree's warm-ups and captures watch with one), so a recording
holds the function's uncompiled kernels. A canary: if torch starts compiling there, the README's
sentence and issue 27's path to fused kernels change."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphtree.tree.breaks import WarmUpReads


def test_a_compiled_function_runs_uncompiled_under_graphtrees_warm_up_watch() -> None:
    runs = {"compiled": 0}

    def backend(gm: torch.fx.GraphModule, example: Any) -> Any:
        def run(*args: Any) -> Any:
            runs["compiled"] += 1
            return gm(*args)

        return run

    @torch.compile(backend=backend)
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).sin() + 1

    x = torch.randn(8)
    want = f(x)
    assert runs["compiled"] == 1
    watch = WarmUpReads(count_reads=True)  # one of the dispatch modes of a warm-up (tree/recorder.py)
    assert isinstance(watch, TorchDispatchMode)
    with watch:
        got = f(x)
    assert runs["compiled"] == 1  # run, but not through the compiled graph
    assert torch.equal(got, want)
