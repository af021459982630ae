"""torch.compile inside a graphed call (issue 46, item 2): a helper compiled on the graphed call's
first call is recorded once compiled, not run eagerly for good with the compiler's host syncs
given as the function's ("`TensorBase.matmul` synchronizes with the host", on an H200 before)."""

from __future__ import annotations

import torch

import graphtree

DEV = "cuda"


def test_a_helper_compiled_inside_the_first_graphed_call_is_recorded_after_its_compile():
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(64, 64, device=DEV)

    @torch.compile  # inductor's kernels, no CUDA graphs of its own (mode="default")
    def helper(x):
        return torch.relu(x @ w) * 2

    def f(x):
        return helper(x) + 1

    g = graphtree.graphed(f)
    for _ in range(6):
        graphtree.mark_step()
        x = torch.randn(8, 64, device=DEV)
        torch.testing.assert_close(g(x), f(x))
    s = graphtree.stats()
    assert not s.eager, s
    assert s.recordings == 1 and s.replays >= 3, s  # warmed up twice: compiling, then compiled
    torch._dynamo.reset()
