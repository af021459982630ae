"""Profiles rebuilt from recorded CUPTI events (tests/fixtures/profile_*.json).

``profile_graph_replay.json`` is meant to come from a real GPU run
(``python tools/record_profile_fixture.py tests/fixtures/profile_graph_replay.json``); until
then it is a hand-made stand-in (``"hand_made": true``) produced by tests/fakes/make_profile_fixture.py.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))
from gt_profile_testkit import fixture_files, load_fixture
from profile_fixture import FORMAT, load, replay
from record_profile_fixture import check_expectations

from graphtree.profile._model import ProfileData

FILES = fixture_files()


def test_there_is_a_fixture():
    assert any(p.name == "profile_graph_replay.json" for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_fixture_rebuilds_the_expected_profile(path):
    doc = load_fixture(path)
    assert doc["format"] == FORMAT
    if doc.get("hand_made"):
        warnings.warn(f"{path.name} is hand-made; record a real one on a GPU ({doc.get('note', '')})", stacklevel=1)
    prof = load(str(path))
    assert check_expectations(prof, doc["expect"]) == []


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_fixture_exports(path, tmp_path):
    prof = load(str(path))
    with open(prof.export_chrome(str(tmp_path / "t.json"))) as f:
        trace = json.load(f)
    assert all(e["dur"] >= 0 for e in trace["traceEvents"])
    assert (tmp_path / "t.json").stat().st_size > 0
    prof.export_pprof(str(tmp_path / "g.pb.gz"))
    assert "Top kernels by GPU time" in prof.table()


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_aggregate_only_replay_has_the_same_aggregates(path):
    events = load_fixture(path)["events"]
    full, agg = replay(events, ProfileData()), replay(events, ProfileData(keep_records=False))
    assert [(s.name, s.count, s.total_ns) for s in full.kernel_stats()] == [
        (s.name, s.count, s.total_ns) for s in agg.kernel_stats()
    ]
    assert agg.summary()["records_kept"] == 0


def test_hand_made_generator_matches_the_recorder_format():
    import make_profile_fixture

    doc = make_profile_fixture.build()
    assert doc["hand_made"] is True and doc["format"] == FORMAT
    prof = ProfileData()
    replay(doc["events"], prof)
    from graphtree.profile import Profile

    p = Profile()
    p.data = prof
    assert check_expectations(p, doc["expect"]) == []
