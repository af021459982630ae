"""Hugging Face's compile kept with graphtree on (issue 46, item 1; passed on the H100 in the fifteenth
and sixteenth sessions): ``generate()`` with ``disable_compile=False`` compiles the decode step as HF
decides, without inductor's CUDA graphs, and graphtree graphs the compiled forward; the tokens are
eager's, and the decode steps replay."""

from __future__ import annotations

import pytest
import torch
from _tiny_hf import tiny_model

import graphtree

KW = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False, "cache_implementation": "static"}


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hfs_compiled_decode_step_is_graphed_and_generates_eagers_tokens(kind):
    torch._dynamo.reset()
    model = tiny_model(kind)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]], device="cuda")
    with torch.inference_mode():
        want = model.generate(ids, **KW, disable_compile=True)
        model.forward = graphtree.graphed(model.forward)
        for _ in range(3):  # HF's default CompileConfig: reduce-overhead, made default by graphtree
            assert torch.equal(model.generate(ids, **KW, disable_compile=False), want)
    twin = model._compiled_call
    assert getattr(twin, "graphtree_callable", False), twin
    assert model.forward.compiled_twins.configs[-1].mode == "default"
    s = graphtree.stats()
    assert s.replays >= 11 * 2, s  # the later generates' decode steps replay (12 tokens: 11 decode steps)
    torch._dynamo.reset()
