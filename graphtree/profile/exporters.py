"""Exports of a :class:`~graphtree.profile.Profile`: text table, Chrome trace, pprof.

- :func:`format_table`: top kernels and graphs by GPU time with their Python call sites.
- :func:`to_chrome` / :func:`export_chrome`: a Chrome trace-event JSON document
  (``{"traceEvents": [...]}``) that loads in Perfetto and chrome://tracing. GPU records are ``"X"``
  events on ``pid`` = device, ``tid`` = CUDA stream; launch calls are ``"X"`` events on the host
  process, one ``tid`` per Python thread. ``ts``/``dur`` are microseconds from the first session's
  start. Kernel ``args`` carry the graph id, node id, correlation id, call site and stack.
- :func:`to_pprof` / :func:`export_pprof`: a gzip'd ``perftools.profiles.Profile`` protobuf (the
  format of pprof, Parca, Pyroscope) written by the small encoder below, no protobuf package
  needed. Sample type ``gpu_time``/``nanoseconds``; one sample per (Python stack, kernel), whose
  leaf frame is the kernel and whose value is its total GPU time.

Example::

    print(format_table(prof))
    export_chrome(prof, "trace.json")
    export_pprof(prof, "gpu.pb.gz")
"""

from __future__ import annotations

import gzip
import json
import os
import time
from collections.abc import Iterable
from typing import Any

from graphtree.profile._attribution import Frame, format_frame

__all__ = ["export_chrome", "export_pprof", "format_table", "to_chrome", "to_pprof"]

HOST_PID = 1_000_000  # the CPU side in Chrome traces (GPU pids are device ids)
_BEFORE = "captured before profiling"


# --------------------------------------------------------------------------------- helpers
def _stack_strings(prof: Any, sid: int, limit: int = 24) -> list[str]:
    frames = prof.stack(sid)
    return [format_frame(f) for f in frames[-limit:]]


def _site(prof: Any, sid: int) -> str:
    frames = prof.stack(sid)
    return format_frame(frames[-1]) if frames else "<no Python frames>"


def _ms(ns: int) -> str:
    return f"{ns / 1e6:,.3f}"


def _short(name: str, width: int) -> str:
    """Kernel names differ at the end as often as at the start: keep both."""
    if len(name) <= width:
        return name
    head = (width - 1) // 2
    return name[:head] + "…" + name[len(name) - (width - 1 - head) :]


# --------------------------------------------------------------------------------- table
def format_table(prof: Any, limit: int = 15) -> str:
    """Top kernels and graphs by GPU time, with call sites, and what was lost.

    Example::

        print(format_table(prof, limit=10))
    """
    s = prof.summary()
    lines: list[str] = []
    total = s["gpu_ns"] or 1
    lines.append(
        f"graphtree.profile: {s['records']:,} GPU records ({s['kernels']:,} kernels, {s['memcpys']:,} memcpy, "
        f"{s['memsets']:,} memset), GPU time {_ms(s['gpu_ns'])} ms; launches: {s['kernel_launches']:,} kernel, "
        f"{s['graph_launches']:,} graph"
    )
    rows = prof.kernel_stats()
    if rows:
        lines.append("")
        lines.append("Top kernels by GPU time")
        lines.append(f"{'GPU ms':>12} {'%':>6} {'calls':>9} {'avg us':>10}  {'kernel':<48} call site")
        for st in rows[:limit]:
            where = _site(prof, st.stack_id)
            if st.graph_key:
                tag = f"[graph {st.graph_key}"
                if st.label:
                    tag += f" {st.label}"
                if st.captured_before_profiling:
                    tag += f", {_BEFORE}; replayed at"
                where = f"{tag}] {where}"
            lines.append(
                f"{_ms(st.total_ns):>12} {100.0 * st.total_ns / total:>5.1f}% {st.count:>9,} "
                f"{st.total_ns / max(1, st.count) / 1e3:>10.2f}  {_short(st.name, 48):<48} {where}"
            )
        if len(rows) > limit:
            lines.append(f"{'':>12} ... {len(rows) - limit} more rows")
    graphs = prof.graph_stats()
    if graphs:
        lines.append("")
        lines.append("Top graphs by GPU time")
        lines.append(f"{'GPU ms':>12} {'%':>6} {'replays':>8} {'kernels':>9}  {'graph':<40} replayed from")
        for g in graphs[:limit]:
            name = (
                f"{g.graph_key}"
                + (f" {g.label}" if g.label else "")
                + (f" ({_BEFORE})" if g.captured_before_profiling else "")
            )
            apis = ",".join(f"{a}x{n}" for a, n in sorted(g.apis.items()))
            lines.append(
                f"{_ms(g.total_ns):>12} {100.0 * g.total_ns / total:>5.1f}% {g.replays:>8,} {g.kernels:>9,}  "
                f"{_short(name, 40):<40} {_site(prof, g.replay_stack_id)}" + (f" via {apis}" if apis else "")
            )
    notes = []
    if s["dropped_records"]:
        notes.append(f"CUPTI dropped {s['dropped_records']:,} records (not counted above)")
    if s["records_not_kept"]:
        notes.append(
            f"{s['records_not_kept']:,} records were aggregated but not kept individually "
            f"(keep_records=False or max_records reached): the Chrome trace lacks them"
        )
    if s["records_before_profiling"]:
        notes.append(
            f"{s['records_before_profiling']:,} records come from graphs {_BEFORE}: timed and named, "
            "attributed to their replay call site"
        )
    if s["records_without_launch"]:
        notes.append(f"{s['records_without_launch']:,} kernel records had no launch callback")
    if s["incomplete_records"]:
        notes.append(f"{s['incomplete_records']:,} records had no timestamps")
    if s["callback_errors"] or s["record_errors"]:
        notes.append(f"errors inside callbacks: {s['callback_errors']} callback, {s['record_errors']} record")
    for n in getattr(prof.data, "notes", []):
        notes.append(n)
    if notes:
        lines.append("")
        lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines)


# --------------------------------------------------------------------------------- chrome
def _t0(prof: Any) -> int:
    data = prof.data
    cands = [s[0] for s in data.sessions if s[0]]
    if data.first_start:
        cands.append(data.first_start)
    return min(cands) if cands else 0


def to_chrome(prof: Any) -> dict[str, Any]:
    """The Chrome trace-event document of ``prof`` (records kept and launches).

    Example::

        doc = to_chrome(prof); assert all(e["dur"] >= 0 for e in doc["traceEvents"])
    """
    t0 = _t0(prof)
    events: list[dict[str, Any]] = []
    stack_cache: dict[int, tuple[str, list[str]]] = {}

    def stack_of(sid: int) -> tuple[str, list[str]]:
        got = stack_cache.get(sid)
        if got is None:
            got = stack_cache[sid] = (_site(prof, sid), _stack_strings(prof, sid))
        return got

    streams: dict[tuple[int, int], None] = {}
    for rec in prof.records:
        site, stack = stack_of(rec.stack_id)
        args: dict[str, Any] = {"correlation_id": rec.correlation_id, "kind": rec.kind, "call_site": site}
        if rec.graph_node_id or rec.graph_id:
            args["graph_id"] = rec.graph_id
            args["graph_node_id"] = rec.graph_node_id
            args["captured_graph"] = rec.graph_key
            if rec.captured_before_profiling:
                args["captured_before_profiling"] = True
        if rec.label:
            args["graphtree"] = rec.label
        if rec.bytes:
            args["bytes"] = rec.bytes
        args["stack"] = stack
        start = rec.start - t0 if rec.start else 0
        events.append(
            {
                "name": rec.name,
                "cat": rec.kind,
                "ph": "X",
                "ts": start / 1e3,
                "dur": max(0, rec.end - rec.start) / 1e3,
                "pid": int(rec.device_id),
                "tid": int(rec.stream_id),
                "args": args,
            }
        )
        streams[(int(rec.device_id), int(rec.stream_id))] = None
    threads: dict[int, int] = {}
    for launch in prof.launches():
        tid = threads.setdefault(launch.thread, len(threads) + 1)
        site, stack = stack_of(launch.stack_id)
        t_enter = launch.t_enter - t0 if launch.t_enter else 0
        dur = max(0, launch.t_exit - launch.t_enter) if launch.t_exit else 0
        events.append(
            {
                "name": launch.api,
                "cat": f"launch:{launch.kind}",
                "ph": "X",
                "ts": t_enter / 1e3,
                "dur": dur / 1e3,
                "pid": HOST_PID,
                "tid": tid,
                "args": {
                    "correlation_id": launch.correlation_id,
                    "kernels": launch.kernels,
                    "gpu_ns": launch.gpu_ns,
                    "call_site": site,
                    "stack": stack,
                },
            }
        )
    meta: list[dict[str, Any]] = []

    def m(name: str, pid: int, tid: int, value: str) -> None:
        meta.append({"name": name, "ph": "M", "ts": 0, "dur": 0, "pid": pid, "tid": tid, "args": {"name": value}})

    for dev in sorted({d for d, _ in streams}):
        m("process_name", dev, 0, f"GPU {dev}")
    for dev, stream in sorted(streams):
        m("thread_name", dev, stream, f"stream {stream}")
    if threads:
        m("process_name", HOST_PID, 0, "host (launch calls)")
        for ident, tid in threads.items():
            m("thread_name", HOST_PID, tid, f"Python thread {ident}")
    return {
        "traceEvents": meta + events,
        "displayTimeUnit": "ns",
        "otherData": {"producer": "graphtree.profile", "summary": _jsonable(prof.summary())},
    }


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(d, default=str))


def check_chrome_trace(doc: Any) -> list[str]:
    """Problems that would stop Perfetto or ``chrome://tracing`` from loading ``doc`` (none: ``[]``).

    Checks the Trace Event Format as :func:`to_chrome` writes it: a ``traceEvents`` list of
    complete (``"X"``) and metadata (``"M"``) events with a string name, integer pid and tid,
    a timestamp and duration in microseconds that are finite and not negative, and dict args.

    Example::

        assert check_chrome_trace(json.load(open("trace.json"))) == []
    """
    problems: list[str] = []
    events = doc.get("traceEvents") if isinstance(doc, dict) else None
    if not isinstance(events, list):
        return ["no traceEvents list"]
    for i, e in enumerate(events):
        if not isinstance(e, dict):
            problems.append(f"event {i} is not an object")
            continue
        where = f"event {i} ({e.get('name')!r})"
        if not isinstance(e.get("name"), str):
            problems.append(f"{where}: name is not a string")
        if e.get("ph") not in ("X", "M"):
            problems.append(f"{where}: phase {e.get('ph')!r} is not X or M")
        if not isinstance(e.get("pid"), int) or not isinstance(e.get("tid"), int):
            problems.append(f"{where}: pid/tid are not integers")
        if "args" in e and not isinstance(e["args"], dict):
            problems.append(f"{where}: args is not an object")
        if e.get("ph") == "X":
            for key in ("ts", "dur"):
                v = e.get(key)
                if not isinstance(v, (int, float)) or v != v or v < 0 or v == float("inf"):
                    problems.append(f"{where}: {key} {v!r} is not a finite non-negative number")
        elif e.get("ph") == "M" and not isinstance(e.get("args", {}).get("name"), str):
            problems.append(f"{where}: metadata without args.name")
    return problems


def export_chrome(prof: Any, path: str) -> str:
    """Write :func:`to_chrome` as JSON to ``path``; returns ``path``.

    Example::

        export_chrome(prof, "trace.json")   # open in https://ui.perfetto.dev
    """
    doc = to_chrome(prof)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    return path


# --------------------------------------------------------------------------------- pprof
def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 two's complement, as protobuf encodes negative int64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint((field << 3) | wire)


def _int(field: int, value: int) -> bytes:
    """A varint field, omitted when 0 (the proto3 default)."""
    return _key(field, 0) + _varint(value) if value else b""


def _len(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _packed(field: int, values: Iterable[int]) -> bytes:
    payload = b"".join(_varint(v) for v in values)
    return _len(field, payload) if payload else b""


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self.ids: dict[str, int] = {"": 0}

    def __call__(self, s: str) -> int:
        i = self.ids.get(s)
        if i is None:
            i = self.ids[s] = len(self.table)
            self.table.append(s)
        return i


def to_pprof(prof: Any, gzipped: bool = True) -> bytes:
    """Encode GPU time per (Python stack, kernel) as a ``perftools.profiles.Profile``.

    Location ids of a sample are leaf first: the kernel, then (for graphs captured before profiling)
    a ``[CUDA graph ... captured before profiling]`` frame, then the Python frames innermost first.

    Example::

        open("gpu.pb.gz", "wb").write(to_pprof(prof))
    """
    strings = _Strings()
    functions: dict[tuple[str, str], int] = {}
    function_msgs: list[bytes] = []
    locations: dict[tuple[int, int], int] = {}
    location_msgs: list[bytes] = []

    def function_id(name: str, filename: str) -> int:
        key = (name, filename)
        fid = functions.get(key)
        if fid is None:
            fid = functions[key] = len(functions) + 1
            n, fn = strings(name), strings(filename)
            function_msgs.append(_int(1, fid) + _int(2, n) + _int(3, n) + _int(4, fn))
        return fid

    def location_id(fid: int, line: int) -> int:
        key = (fid, line)
        lid = locations.get(key)
        if lid is None:
            lid = locations[key] = len(locations) + 1
            line_msg = _int(1, fid) + _int(2, line)
            location_msgs.append(_int(1, lid) + _int(2, 1) + _len(4, line_msg))
        return lid

    def frame_location(frame: Frame) -> int:
        filename, lineno, function = frame
        return location_id(function_id(function, filename), int(lineno))

    samples: dict[tuple[int, str, str, int], list[int]] = {}
    for st in prof.kernel_stats():
        marker = st.graph_key if st.captured_before_profiling else 0
        key = (st.stack_id, st.name, st.kind, marker)
        acc = samples.get(key)
        if acc is None:
            acc = samples[key] = [0, 0]
        acc[0] += st.total_ns
        acc[1] += st.count

    kind_key, count_key, graph_key = strings("kind"), strings("count"), strings("graph")
    sample_msgs: list[bytes] = []
    for (sid, name, kind, marker), (total_ns, count) in samples.items():
        locs = [location_id(function_id(name, f"[GPU {kind}]"), 0)]
        if marker:
            locs.append(location_id(function_id(f"[CUDA graph {marker} {_BEFORE}]", "[graph]"), 0))
        for frame in reversed(prof.stack(sid)):
            locs.append(frame_location(frame))
        labels = _len(3, _int(1, kind_key) + _int(2, strings(kind)))
        labels += _len(3, _int(1, count_key) + _int(3, count))
        if marker:
            labels += _len(3, _int(1, graph_key) + _int(3, marker))
        sample_msgs.append(_packed(1, locs) + _packed(2, [total_ns]) + labels)

    gpu_time, ns = strings("gpu_time"), strings("nanoseconds")
    s = prof.summary()
    comments = [
        strings("graphtree.profile: GPU time per Python stack and kernel"),
        strings(f"records={s['records']} dropped={s['dropped_records']} not_kept={s['records_not_kept']}"),
    ]
    mapping = _int(1, 1) + _int(5, strings("[python]")) + _int(7, 1) + _int(8, 1) + _int(9, 1)
    # every string is interned above, before the table is written
    out = bytearray()
    out += _len(1, _int(1, gpu_time) + _int(2, ns))
    for msg in sample_msgs:
        out += _len(2, msg)
    out += _len(3, mapping)
    for msg in location_msgs:
        out += _len(4, msg)
    for msg in function_msgs:
        out += _len(5, msg)
    for text in strings.table:
        out += _len(6, text.encode("utf-8"))
    start_wall = getattr(prof.data, "wall_start_ns", 0) or time.time_ns()
    out += _int(9, start_wall)
    out += _int(10, s["profiled_ns"])
    out += _len(11, _int(1, gpu_time) + _int(2, ns))
    out += _int(12, 1)
    out += _packed(13, comments)
    raw = bytes(out)
    return gzip.compress(raw, mtime=0) if gzipped else raw


def export_pprof(prof: Any, path: str) -> str:
    """Write :func:`to_pprof` to ``path``; returns ``path``.

    Example::

        export_pprof(prof, "gpu.pb.gz")   # then: go tool pprof -http=: gpu.pb.gz
    """
    data = to_pprof(prof, gzipped=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return path
