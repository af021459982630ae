"""Shared by the CPU tests: ``tests/fakes`` and ``tools`` on ``sys.path`` and the fake-CUPTI fixture.

``fake_cupti`` (from :mod:`gt_profile_testkit`) is registered here, once, so a test module
asks for it by parameter name without importing it (an import would be redefined by every
test's parameter).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # developer tools: profile fixtures

from gt_profile_testkit import fake_cupti

__all__ = ["fake_cupti"]
