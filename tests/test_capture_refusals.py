"""What makes a call run eagerly rather than be recorded, decided on the CPU-visible side (issue 44):
a call that reads or sets the CUDA generator's state, and an operation torch refuses only while a
capture is under way."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from graphtree import _torch
from graphtree.tree import refusals


def test_a_watch_notes_the_cuda_generator_state_read_or_set_and_puts_torch_cuda_back():
    own = {name: getattr(torch.cuda, name) for name in ("manual_seed", "get_rng_state", "set_rng_state")}
    watch = _torch.StateWatch({})
    with watch:
        torch.manual_seed(3)  # (torch.manual_seed seeds the CUDA generators through torch.cuda)
    assert watch.generator_state == "torch.cuda.manual_seed_all"
    assert all(getattr(torch.cuda, name) is fn for name, fn in own.items())
    reason = refusals.unsafe_reason("f", watch)
    assert reason is not None and "torch.cuda.manual_seed_all" in reason and "`f`" in reason

    quiet = _torch.StateWatch({})
    with quiet:
        torch.randn(3) + 1
    assert quiet.generator_state == "" and refusals.unsafe_reason("f", quiet) is None


def test_a_generator_state_read_while_dynamo_compiled_is_the_compilers_not_the_functions():
    # dynamo reads the CUDA generator's state around each trace (convert_frame.preserve_global_state):
    # a helper compiled on a graphed call's first call ran eagerly for good with this reason (H100,
    # test_compile_inside_gpu.py and test_hf_compile_gpu.py); such a warm-up is warmed up again instead
    watch = _torch.StateWatch({})
    with watch:
        torch.cuda.seed_all()
    assert watch.generator_state == "torch.cuda.seed_all"
    assert refusals.unsafe_reason("f", watch, compiled=True) is None
    assert "torch.cuda.seed_all" in (refusals.unsafe_reason("f", watch, compiled=False) or "")


def test_checkpoint_of_cpu_tensors_is_not_noted_and_a_seeding_is():
    # torch.utils.checkpoint stashes the CUDA generators' state only for CUDA inputs (the GPU test
    # test_graph_checkpoint_preserve_rng_state covers those): its CPU path is not noted.
    x = torch.ones(3, requires_grad=True)
    watch = _torch.StateWatch({})
    with watch:
        checkpoint(torch.sin, x, use_reentrant=False, preserve_rng_state=True).sum().backward()
    assert watch.generator_state == ""
    with watch:
        torch.cuda.seed_all()  # (lazy on a build without CUDA: queued, not run)
    assert watch.generator_state == "torch.cuda.seed_all"


def test_an_error_torch_raises_only_during_a_capture_is_told_apart():
    refused = RuntimeError(
        "Cannot copy between CPU and CUDA tensors during CUDA graph capture unless the CPU tensor is pinned."
    )
    assert refusals.refused_in_capture(refused)
    assert refusals.refused_in_capture(RuntimeError("operation not permitted when stream is capturing"))
    assert not refusals.refused_in_capture(RuntimeError("shape mismatch"))
    assert not refusals.refused_in_capture(ValueError("during CUDA graph capture"))
    assert not refusals.refused_in_capture(None)
