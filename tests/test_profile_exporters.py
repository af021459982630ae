"""Exports of graphtree.profile: Chrome trace, pprof (decoded back by a decoder of our own), table."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))

import graphtree
from graphtree.profile.exporters import check_chrome_trace, to_chrome, to_pprof


# ------------------------------------------------------------------------- a small protobuf decoder
def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, int, Any]]:
    """(field number, wire type, value) of one message; length-delimited values stay bytes."""
    out, i = [], 0
    while i < len(buf):
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            v, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            v, i = buf[i : i + n], i + n
        elif wire == 1:
            v, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 5:
            v, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire}")
        out.append((field, wire, v))
    return out


def _packed(v: Any, wire: int) -> list[int]:
    if wire == 0:
        return [v]
    vals, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        vals.append(x)
    return vals


def decode_profile(data: bytes) -> dict[str, Any]:
    msg = _fields(gzip.decompress(data))
    strings = [v.decode() for f, w, v in msg if f == 6]
    sample_types = [{f: v for f, _, v in _fields(v)} for f, w, v in msg if f == 1]
    functions = {}
    for f, _w, v in msg:
        if f == 5:
            d = {ff: vv for ff, _, vv in _fields(v)}
            functions[d[1]] = (strings[d.get(2, 0)], strings[d.get(4, 0)])
    locations = {}
    for f, _w, v in msg:
        if f == 4:
            fs = _fields(v)
            lid = next(vv for ff, _, vv in fs if ff == 1)
            line = {ff: vv for ff, _, vv in _fields(next(vv for ff, _, vv in fs if ff == 4))}
            locations[lid] = (functions[line[1]], line.get(2, 0))
    samples = []
    for f, _w, v in msg:
        if f == 2:
            locs, vals, labels = [], [], {}
            for ff, ww, vv in _fields(v):
                if ff == 1:
                    locs += _packed(vv, ww)
                elif ff == 2:
                    vals += _packed(vv, ww)
                elif ff == 3:
                    lab = {a: b for a, _, b in _fields(vv)}
                    labels[strings[lab[1]]] = strings[lab[2]] if 2 in lab else lab.get(3, 0)
            samples.append({"frames": [locations[i] for i in locs], "values": vals, "labels": labels})
    return {
        "strings": strings,
        "sample_types": [(strings[t.get(1, 0)], strings[t.get(2, 0)]) for t in sample_types],
        "samples": samples,
        "fields": {f for f, _, _ in msg},
    }


# ------------------------------------------------------------------------- a profile to export
def _forward(sim):
    sim.launch_kernel("gemm", duration=3000)
    sim.launch_kernel("relu", duration=1000)


@pytest.fixture
def prof(fake_cupti):
    sim = fake_cupti.SIM
    old = sim.capture(lambda: sim.launch_kernel("old_kernel", duration=700))
    with graphtree.profile() as p:
        sim.launch_kernel("eager_kernel", duration=500)
        sim.memcpy(1 << 20, kind="HTOD")
        exe = sim.capture(lambda: _forward(sim))
        for _ in range(4):
            sim.graph_launch(exe)
        sim.graph_launch(exe, api="cuGraphLaunch", stream=9)
        sim.graph_launch(old)
        sim.memset(64)
    return p


def test_chrome_trace_structure(prof, tmp_path):
    path = prof.export_chrome(str(tmp_path / "trace.json"))
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    assert events
    assert check_chrome_trace(doc) == []
    broken = json.loads(json.dumps(doc))
    broken["traceEvents"][-1]["dur"] = -1.0
    broken["traceEvents"][0]["pid"] = "gpu"
    assert len(check_chrome_trace(broken)) == 2 and check_chrome_trace({}) == ["no traceEvents list"]
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e), e
        assert isinstance(e["name"], str) and e["ph"] in ("X", "M")
        assert e["dur"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int)
    x = [e for e in events if e["ph"] == "X"]
    gpu = [e for e in x if e["pid"] == 0]
    assert len(gpu) == prof.summary()["records"]
    gemm = [e for e in gpu if e["name"] == "gemm"]
    assert len(gemm) == 5 and all(e["dur"] == pytest.approx(3.0) for e in gemm)  # 3000 ns = 3 us
    assert {e["tid"] for e in gemm} == {7, 9}  # one track per stream
    a = gemm[0]["args"]
    assert a["graph_id"] and a["graph_node_id"] and a["call_site"].endswith("_forward")
    assert "test_profile_exporters.py" in a["call_site"]
    old = next(e for e in gpu if e["name"] == "old_kernel")["args"]
    assert old["captured_before_profiling"] is True
    launches = [e for e in x if e["cat"].startswith("launch")]
    assert {e["name"] for e in launches} == {"cudaLaunchKernel", "cudaGraphLaunch", "cuGraphLaunch"}
    assert sorted(e["args"]["kernels"] for e in launches if e["name"] != "cudaLaunchKernel") == [1, 2, 2, 2, 2, 2]
    meta = {(e["name"], e["args"]["name"]) for e in events if e["ph"] == "M"}
    assert ("process_name", "GPU 0") in meta and ("thread_name", "stream 9") in meta
    starts = [e["ts"] for e in gpu]
    assert min(starts) >= 0


def test_pprof_decodes_and_totals_match(prof, tmp_path):
    path = prof.export_pprof(str(tmp_path / "gpu.pb.gz"))
    with open(path, "rb") as f:
        data = f.read()
    assert data[:2] == b"\x1f\x8b"  # gzip
    p = decode_profile(data)
    assert p["strings"][0] == ""
    assert p["sample_types"] == [("gpu_time", "nanoseconds")]
    assert sum(s["values"][0] for s in p["samples"]) == prof.summary()["gpu_ns"]
    keys = [(tuple(s["frames"]),) for s in p["samples"]]
    assert len(keys) == len(set(keys)), "one sample per (python stack, kernel)"
    by_kernel = {}
    for s in p["samples"]:
        (kname, kfile), _ = s["frames"][0]
        assert kfile.startswith("[GPU ")
        by_kernel[kname] = by_kernel.get(kname, 0) + s["values"][0]
    assert by_kernel["gemm"] == 5 * 3000 and by_kernel["relu"] == 5 * 1000
    gemm = next(s for s in p["samples"] if s["frames"][0][0][0] == "gemm")
    (func, file), line = gemm["frames"][1]
    assert func == "_forward" and file.endswith("test_profile_exporters.py") and line > 0
    old = next(s for s in p["samples"] if s["frames"][0][0][0] == "old_kernel")
    assert "captured before profiling" in old["frames"][1][0][0]
    assert old["labels"]["kind"] == "kernel" and old["labels"]["count"] == 1


def test_pprof_encoder_handles_big_and_negative_varints():
    from graphtree.profile.exporters import _varint

    assert _varint(0) == b"\x00" and _varint(300) == b"\xac\x02"
    assert _varint(-1) == b"\xff" * 9 + b"\x01"


def test_table_names_kernels_sites_graphs_and_losses(prof, fake_cupti):
    text = prof.table()
    assert "Top kernels by GPU time" in text and "Top graphs by GPU time" in text
    assert "gemm" in text and "_forward" in text and "test_profile_exporters.py:" in text
    assert "captured before profiling" in text
    assert "cudaGraphLaunchx4" in text and "cuGraphLaunchx1" in text
    assert "dropped" not in text


def test_empty_profile_exports(fake_cupti, tmp_path):
    with graphtree.profile() as p:
        pass
    assert "0 GPU records" in p.table()
    doc = to_chrome(p)
    assert doc["traceEvents"] == []
    assert decode_profile(to_pprof(p))["samples"] == []
