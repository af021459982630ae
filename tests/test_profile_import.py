"""graphtree.profile imports without CUPTI, and says how to install it when it is needed."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import graphtree


def test_import_needs_no_cupti():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["cupti"] = None          # as if cupti-python were not installed
        import graphtree, graphtree.profile
        from graphtree.profile import profile, Profile, ProfilerBusyError, ProfilerUnavailableError
        import graphtree.profile.exporters, graphtree.profile.cli
        assert "cupti.cupti" not in sys.modules
        p = graphtree.profile()
        assert isinstance(p, Profile)
        try:
            p.start()
        except ProfilerUnavailableError as e:
            assert "pip install 'graphtree[profile]'" in str(e), e
            print("OK")
        """
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=str(root)
    )
    assert out.returncode == 0 and out.stdout.strip() == "OK", out.stderr


def test_graphtree_profile_stays_callable_after_the_submodule_import(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupti", None)
    import graphtree.profile as mod

    assert callable(graphtree.profile)
    prof = graphtree.profile(keep_records=False)
    assert isinstance(prof, mod.Profile) and prof.options.keep_records is False
    with pytest.raises(mod.ProfilerUnavailableError, match=r"pip install 'graphtree\[profile\]'"), graphtree.profile():
        pass


def test_without_cupti_the_error_says_whether_the_gpu_is_missing_too(monkeypatch):
    import torch

    from graphtree.profile import _session

    monkeypatch.setitem(sys.modules, "cupti", None)
    monkeypatch.setitem(sys.modules, "cupti.cupti", None)
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(_session.ProfilerUnavailableError) as info:
        _session.load_cupti()
    assert "needs a CUDA GPU and NVIDIA's CUPTI Python bindings; this machine has neither" in str(info.value)
    assert "a build without CUDA" in str(info.value)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(_session.ProfilerUnavailableError) as info:
        _session.load_cupti()
    assert "needs NVIDIA's CUPTI Python bindings." in str(info.value) and "GPU" not in str(info.value)


def test_errors_are_runtime_errors():
    from graphtree.profile import ProfilerBusyError, ProfilerError, ProfilerUnavailableError

    assert issubclass(ProfilerBusyError, ProfilerError) and issubclass(ProfilerUnavailableError, ProfilerError)
    assert issubclass(ProfilerError, RuntimeError)
