"""torch.compile inside a graphed call (issue 46, item 2): a helper compiled on the graphed call's
first call is recorded once compiled, not run eagerly for good with the compiler's host syncs
given as the function's ("`TensorBase.matmul` synchronizes with the host", on an H200 before),
and a recompile (a new shape, a changed global the helper reads) is never replayed stale."""

from __future__ import annotations

import pytest
import torch

import graphtree

DEV = "cuda"
SCALE = 2.0  # read by the compiled helper below (the test rebinds it)


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_a_helper_compiled_inside_the_first_graphed_call_is_recorded_after_its_compile(mode):
    torch._dynamo.reset()
    torch.manual_seed(0)
    w = torch.randn(64, 64, device=DEV)

    @torch.compile(mode=mode)  # inductor's kernels, no CUDA graphs of its own
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


def _scaled(x):
    return torch.relu(x) * SCALE


def test_a_recompile_for_a_new_shape_or_a_changed_global_is_never_replayed_stale():
    global SCALE
    torch._dynamo.reset()
    helper = torch.compile(_scaled)  # dynamo guards on SCALE: a new value recompiles

    def f(x):
        return helper(x) - 1

    g = graphtree.graphed(f)
    try:
        # each signature four times (two warm-ups, the recording, a replay), then the first one again
        for value, n in [(2.0, 8)] * 4 + [(3.0, 8)] * 4 + [(3.0, 16)] * 4 + [(2.0, 8)]:
            SCALE = value
            graphtree.mark_step()
            x = torch.randn(n, 64, device=DEV)
            want = f(x)  # (eager: the compiled helper as dynamo runs it now, recompiled for the new value)
            assert torch.equal(g(x), want), (value, n)
            torch.testing.assert_close(want, torch.relu(x) * value - 1)
    finally:
        SCALE = 2.0
        torch._dynamo.reset()
    s = graphtree.stats()
    assert not s.eager and s.recordings == 3 and s.replays == 4, s  # (2.0, 8), (3.0, 8), (3.0, 16)


def test_a_compiled_part_traced_again_during_the_recording_is_warmed_up_and_recorded_not_given_up():
    # Dynamo traces inside the capture when a compiled part's guards fail there (HF's compiled
    # forward with one StaticCache reused across generate() calls; here torch._dynamo.reset()
    # between the warm-ups and the recording). The trace reads and sets the CUDA generator's state:
    # graphtree gave that signature up for good, "calls torch.cuda.get_rng_state", and the generate
    # scenario's one-cache case ran HF's compiled forward eagerly, 2.2x HF's default per token (H100).
    from graphtree.tree.refusals import COMPILED_IN_CAPTURE

    torch._dynamo.reset()
    helper = torch.compile(_scaled, backend="eager")  # (dynamo's trace alone: no compiler in the capture)

    def f(x):
        return helper(x) + 1

    g = graphtree.graphed(f, name="f")
    x = torch.randn(8, 64, device=DEV)
    try:
        for i in range(8):
            if i == 2:  # the warm-ups are done: the next call records, and dynamo traces in it again
                torch._dynamo.reset()
            graphtree.mark_step()
            assert torch.equal(g(x), torch.relu(x) * SCALE + 1), i
    finally:
        torch._dynamo.reset()
    s = graphtree.stats()
    assert s.eager == {COMPILED_IN_CAPTURE.format(name="f"): 1}, s  # (that one call, with the reason)
    assert s.recordings == 1 and s.replays >= 3, s
