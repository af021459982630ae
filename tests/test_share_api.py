"""graphtree.share's public API where it cannot run: clear errors, nothing half-made (CPU)."""

import pytest
import torch

import graphtree.share as share
from graphtree.share._control import ControlBlock, Membership


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_both_sides_say_so():
    with pytest.raises(share.ShareUnavailableError, match="needs a CUDA GPU"):
        share.Publisher("nothing-here")
    with pytest.raises(share.ShareUnavailableError, match="needs a CUDA GPU"):
        share.attach("nothing-here")


def test_a_missing_cuda_core_names_the_install(monkeypatch):
    import sys

    from graphtree.share import _memory

    monkeypatch.setitem(sys.modules, "cuda.core", None)  # "import cuda.core" raises ImportError
    with pytest.raises(share.ShareUnavailableError, match="pip install cuda-core"):
        _memory.cuda_core()


def test_the_public_names_are_few():
    assert sorted(share.__all__) == ["Attached", "Publisher", "RefusedError", "ShareUnavailableError", "attach"]


def _attached(tensors, block=None):
    return share.Attached("/run/x.sock", tensors, {}, Membership(block or ControlBlock.create(), 0))


def test_attached_checks_names_shapes_and_dtypes():
    shared = _attached({"x": torch.zeros(2, 3), "h": torch.zeros(1, dtype=torch.float16)})
    assert sorted(shared) == ["h", "x"] and len(shared) == 2
    assert shared.get("x", shape=(2, 3), dtype=torch.float32) is shared["x"]
    with pytest.raises(KeyError, match=r"publishes no tensor 'y' \(it publishes: h, x\)"):
        shared["y"]
    with pytest.raises(ValueError, match=r"has shape \(2, 3\), not the \(6,\) expected"):
        shared.get("x", shape=(6,))
    with pytest.raises(ValueError, match=r"has dtype torch\.float16, not the torch\.float32 expected"):
        shared.get("h", dtype=torch.float32)
    with pytest.raises(TypeError):
        shared.get("x", None)  # not dict.get: no default, shape is keyword-only


def test_closing_an_attached_frees_its_consumer_slot_and_says_so():
    block = ControlBlock.create()
    mine = ControlBlock(__import__("os").dup(block.fd))
    with block.locked():
        block.set(block.pid_cell(0), 4242)
    shared = _attached({"x": torch.zeros(1)}, mine)
    with shared, pytest.raises(KeyError, match=r"publishes no channel 'logits' \(it publishes: none\)"):
        shared.channel("logits")
    assert block.get(block.pid_cell(0)) == 0, "the producer sees the consumer gone"
    with pytest.raises(KeyError, match="this consumer is closed"):
        shared.channel("logits")
    shared.close()  # idempotent
    assert torch.equal(shared["x"], torch.zeros(1)), "tensors taken stay usable"


def test_a_producer_gpu_this_process_cannot_see_is_named(monkeypatch):
    from types import SimpleNamespace

    from graphtree.share import consumer

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=f"GPU-{i}"))
    assert consumer._device_with_uuid("GPU-1") == 1  # device numbers differ between processes: found by uuid
    with pytest.raises(share.ShareUnavailableError, match=r"uuid GPU-7\) is not visible.*CUDA_VISIBLE_DEVICES"):
        consumer._device_with_uuid("GPU-7")
