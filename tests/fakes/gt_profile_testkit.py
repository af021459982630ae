"""Shared pieces of the graphtree.profile CPU tests: the fake-CUPTI fixture and helpers.

``tests/conftest.py`` puts ``tests/fakes`` on ``sys.path`` and registers the ``fake_cupti``
fixture; test modules import the helpers from here.

Example::

    def test_x(fake_cupti):  # the fixture, by name: no import
        fake_cupti.SIM.launch_kernel("k")
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

FAKES = Path(__file__).resolve().parent
FIXTURES = FAKES.parent / "fixtures"

__graphtree_profile_internal__ = True


@pytest.fixture
def fake_cupti() -> Iterator[Any]:
    """Install the fake as ``cupti``/``cupti.cupti`` for one test; yields the fake ``cupti.cupti``."""
    import fake_cupti as pkg
    from fake_cupti import cupti

    from graphtree.profile import _buffers, _parse, _rawbuf, _session

    saved = {k: sys.modules.get(k) for k in ("cupti", "cupti.cupti")}
    sys.modules["cupti"] = pkg
    sys.modules["cupti.cupti"] = cupti
    cupti.SIM.reset()
    # the raw-buffer path (libcupti through ctypes) talks to the fake's libcupti
    saved_factory = _rawbuf.BACKEND_FACTORY
    _rawbuf.BACKEND_FACTORY = lambda _cupti: cupti.LIBCUPTI
    _buffers._RAW_LAYOUT_BAD = False
    _parse._RawParser._first_done = False
    try:
        yield cupti
    finally:
        s = _session.active_session()
        if s is not None:
            s.stop()
        _rawbuf.BACKEND_FACTORY = saved_factory
        _buffers._RAW_LAYOUT_BAD = False
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def fixture_files() -> list[Path]:
    """Every profile fixture committed under tests/fixtures."""
    return sorted(FIXTURES.glob("profile_*.json"))


def load_fixture(path: os.PathLike) -> dict[str, Any]:
    """The JSON document of a fixture."""
    with open(path) as f:
        return json.load(f)
