"""Shared by the CPU tests: ``tests/fakes``, ``tools`` and the GPU tests' helpers (``tests/gpu``: the
tiny Hugging Face models of ``_tiny_hf``) on ``sys.path``, and the fake-CUPTI fixture.

``fake_cupti`` (from :mod:`gt_profile_testkit`) is registered here, once, so a test module
asks for it by parameter name without importing it (an import would be redefined by every
test's parameter).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tools: profile fixtures
sys.path.append(str(Path(__file__).resolve().parent / "gpu"))  # (after the rest: its helpers only)

from gt_profile_testkit import fake_cupti

__all__ = ["fake_cupti"]
