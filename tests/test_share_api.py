"""graphtree.share's public API where it cannot run: clear errors, nothing half-made (CPU)."""

import pytest
import torch

import graphtree.share as share


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
