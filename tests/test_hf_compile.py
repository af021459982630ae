"""graphtree.tree.hf_compile on the CPU (issue 46, item 1): a graphed model's ``generate()`` with HF's
compile on gets the model's forward compiled without inductor's CUDA graphs and graphed, as
``_compiled_call``; with graphtree's default (``disable_compile``) nothing is compiled. On the CPU
graphtree runs every call eagerly: the tokens, the config and the wiring are what is checked here."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from _tiny_hf import tiny_model  # (tests/gpu's, on sys.path: tests/conftest.py)

import graphtree
from graphtree.tree.hf_compile import without_cudagraphs

transformers = pytest.importorskip("transformers")
CompileConfig = transformers.generation.configuration_utils.CompileConfig


def _model() -> torch.nn.Module:
    return tiny_model("llama", device="cpu")


def _compile_everywhere(**fields) -> CompileConfig:
    config = CompileConfig(backend="eager", **fields)  # (dynamo traces, no inductor compile time)
    config._compile_all_devices = True  # (generate() compiles on CUDA only unless told so)
    return config


KW = {"max_new_tokens": 5, "do_sample": False, "cache_implementation": "static"}


def test_the_mode_loses_inductors_cuda_graphs_and_keeps_the_rest():
    mapped = without_cudagraphs(_compile_everywhere(fullgraph=True))
    assert mapped.mode == "default" and mapped.fullgraph and mapped._compile_all_devices
    assert without_cudagraphs(CompileConfig(mode="max-autotune")).mode == "max-autotune-no-cudagraphs"
    off = without_cudagraphs(CompileConfig(mode=None, options={"triton.cudagraphs": True, "x": 1}))
    assert off.options == {"triton.cudagraphs": False, "x": 1}


def test_generate_with_hfs_compile_gets_the_forward_compiled_and_graphed_and_eagers_tokens():
    model = _model()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        want = model.generate(ids, **KW, disable_compile=True)
        model.forward = graphtree.graphed(model.forward)
        assert model.generation_config.disable_compile is True  # graphtree's default: no compile
        assert torch.equal(model.generate(ids, **KW), want)
        assert not hasattr(model, "_compiled_call")
        config = _compile_everywhere()
        got = model.generate(ids, **KW, disable_compile=False, compile_config=config)
    assert torch.equal(got, want)
    twin = model._compiled_call
    assert getattr(twin, "graphtree_callable", False) and twin.name.endswith("(compiled)"), twin
    assert model.forward.compiled_twins.configs[0].mode == "default"
    again = model.get_compiled_call(config)
    assert again is twin  # an unchanged config compiles nothing again


def test_a_model_whose_forward_is_not_graphed_gets_hfs_own_compiled_call():
    graphed_one, plain = _model(), _model()
    graphed_one.forward = graphtree.graphed(graphed_one.forward)  # (installs the class's wrapper)
    call = plain.get_compiled_call(_compile_everywhere())
    assert not getattr(call, "graphtree_callable", False)
    assert plain._compiled_call is call


def test_a_model_with_its_forward_graphed_can_be_deep_copied_and_pickled():
    # (EMA weights, snapshots, torch.save(model): the copy's graphed forward used to be rebuilt before
    # the copy's __dict__ was filled, and raised AttributeError '_forward_hooks'; built at first use now)
    import inspect

    model = _model()
    ids = torch.tensor([[1, 2, 3, 4]])
    model.forward = graphtree.graphed(model.forward)
    with torch.inference_mode():
        want = model.generate(ids, **KW)
        for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
            assert "attention_mask" in inspect.signature(twin.forward).parameters
            assert twin.forward.compiled_twins is not model.forward.compiled_twins
            assert twin.forward.fn.__self__ is twin  # the copy's graphed forward is the copy's
            assert torch.equal(twin.generate(ids, **KW), want)
