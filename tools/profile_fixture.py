"""Record the profiler's normalized CUPTI events to JSON, and replay them into a profile.

The session talks to :class:`~graphtree.profile._model.ProfileData` only through its ingest
methods (``api_enter``, ``api_exit``, ``node_created``, ``node_cloned``, ``graph_cloned``,
``record``, ``dropped``, ``set_label``, ``session_start``, ``session_stop``), whose arguments are
plain numbers and strings. :class:`Recorder` sits in between during a real GPU run (``tap=``
option) and logs every call; :func:`replay` feeds a log into a fresh profile. So the CPU tests
build profiles from records that a real GPU produced (``tests/fixtures/*.json``, written by
``python tools/record_profile_fixture.py``).

File format (``"format": "graphtree.profile.fixture/1"``)::

    {"format": ..., "hand_made": false, "meta": {...}, "expect": {...}, "events": [
        ["api_table", [[domain, cbid, api_name, "kernel" | "graph"], ...]],
        ["session_start", ts],
        ["api_enter", domain, cbid, correlation_id, thread, ts, frames_or_null],
        ["api_exit", domain, cbid, correlation_id, thread, ts],
        ["node_created", graph_id, node_id, node_type, thread, frames_or_null],
        ["node_cloned", node_id, original_node_id],
        ["graph_cloned", graph_id, original_graph_id],
        ["set_label", thread, label_or_null],
        ["record", kind, name, start, end, device, stream, correlation_id, graph_id, node_id, bytes],
        ["dropped", n],
        ["session_stop", ts]]}

``frames`` is a list of ``[filename, lineno, function]``, outermost first, present only when the
live profiler captured a stack for that call.

Example::

    rec = Recorder()
    with graphtree.profile(tap=rec.attach) as prof:
        step(x)
    prof.summary()  # records are aggregated, and reach the tap, at the first query after stop()
    rec.save("tests/fixtures/run.json", expect={"graph_launches": 1})
    prof2 = load("tests/fixtures/run.json")      # the same profile, rebuilt on any machine
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from graphtree.profile._model import ProfileData, ProfileOptions
from graphtree.profile._profile import Profile

__graphtree_profile_internal__ = True  # its frames are machinery to graphtree.profile, never a call site

__all__ = ["FORMAT", "Recorder", "load", "replay"]

FORMAT = "graphtree.profile.fixture/1"


class _Tap:
    """Forwards ingest calls to a ProfileData and logs them (see :class:`Recorder`)."""

    def __init__(self, data: ProfileData, log: Callable[[list[Any]], None]) -> None:
        self._data = data
        self._log = log

    def _frames(self, sid: int | None) -> list[list[Any]] | None:
        if sid is None:
            return None
        return [list(f) for f in self._data.stacks.get(sid)]

    def set_api_table(self, table: Any) -> None:
        self._data.set_api_table(table)
        self._log(["api_table", sorted([d, c, name, kind] for (d, c), (name, kind) in table.items())])

    def session_start(self, ts: int) -> None:
        self._data.session_start(ts)
        self._log(["session_start", ts])

    def session_stop(self, ts: int) -> None:
        self._data.session_stop(ts)
        self._log(["session_stop", ts])

    def set_label(self, thread: int, label: str | None) -> None:
        self._data.set_label(thread, label)
        self._log(["set_label", thread, label])

    def api_enter(self, domain: int, cbid: int, corr: int, thread: int, ts: int, capture: Callable[[], int]) -> None:
        got: list[int] = []

        def cap() -> int:
            sid = capture()
            got.append(sid)
            return sid

        self._data.api_enter(domain, cbid, corr, thread, ts, cap)
        self._log(["api_enter", domain, cbid, corr, thread, ts, self._frames(got[0]) if got else None])

    def api_exit(self, domain: int, cbid: int, corr: int, thread: int, ts: int) -> None:
        self._data.api_exit(domain, cbid, corr, thread, ts)
        self._log(["api_exit", domain, cbid, corr, thread, ts])

    def node_created(
        self, graph_id: int, node_id: int, node_type: int, thread: int, capture: Callable[[], int]
    ) -> None:
        got: list[int] = []

        def cap() -> int:
            sid = capture()
            got.append(sid)
            return sid

        self._data.node_created(graph_id, node_id, node_type, thread, cap)
        self._log(["node_created", graph_id, node_id, node_type, thread, self._frames(got[0]) if got else None])

    def node_cloned(self, node_id: int, original_node_id: int) -> None:
        self._data.node_cloned(node_id, original_node_id)
        self._log(["node_cloned", node_id, original_node_id])

    def graph_cloned(self, graph_id: int, original_graph_id: int) -> None:
        self._data.graph_cloned(graph_id, original_graph_id)
        self._log(["graph_cloned", graph_id, original_graph_id])

    def record(self, *args: Any) -> None:
        self._data.record(*args)
        self._log(["record", *args])

    def record_batch(self, kind: int, names: Any, name_idx: Any, *cols: Any) -> None:
        self._data.record_batch(kind, names, name_idx, *cols)
        lists = [list(map(int, c)) for c in cols]
        idx = [int(i) for i in name_idx]
        for r in range(len(idx)):
            self._log(["record", kind, names[idx[r]]] + [c[r] for c in lists])

    def dropped(self, n: int) -> None:
        self._data.dropped(n)
        self._log(["dropped", n])


class Recorder:
    """Collects the ingest calls of one or more sessions; pass ``tap=recorder.attach``.

    Example::

        rec = Recorder()
        with graphtree.profile(tap=rec.attach) as prof:
            step(x)
        prof.summary()  # aggregates the records, which reach the tap
        rec.save("run.json")
    """

    def __init__(self) -> None:
        self.events: list[list[Any]] = []
        self._lock = threading.Lock()

    def _log(self, event: list[Any]) -> None:
        with self._lock:
            self.events.append(event)

    def attach(self, data: ProfileData) -> _Tap:
        """The sink the session should feed (a forwarding, logging proxy of ``data``)."""
        return _Tap(data, self._log)

    def to_json(
        self,
        *,
        hand_made: bool = False,
        meta: dict[str, Any] | None = None,
        expect: dict[str, Any] | None = None,
        note: str = "",
    ) -> dict[str, Any]:
        """The fixture document (see the module docstring)."""
        with self._lock:
            events = list(self.events)
        return {
            "format": FORMAT,
            "hand_made": hand_made,
            "note": note,
            "meta": meta or {},
            "expect": expect or {},
            "events": events,
        }

    def save(self, path: str, **kwargs: Any) -> str:
        """Write :meth:`to_json` to ``path``; returns ``path``."""
        with open(path, "w") as f:
            json.dump(self.to_json(**kwargs), f, indent=None, separators=(",", ":"))
            f.write("\n")
        return path


def _capture(data: ProfileData, frames: Any) -> Callable[[], int]:
    """The ``capture`` callback of a replayed event: interns its logged ``frames`` when called."""
    return lambda: data.stacks.intern_list(frames)


def replay(events: list[list[Any]], data: ProfileData) -> ProfileData:
    """Feed logged events into ``data`` exactly as the live session would; returns ``data``.

    Example::

        data = replay(doc["events"], ProfileData())
    """
    pending: list[list[Any]] = []  # consecutive record events, aggregated as one batch per kind

    def flush() -> None:
        by_kind: dict[int, list[list[Any]]] = {}
        for ev in pending:
            by_kind.setdefault(ev[1], []).append(ev)
        for kind, evs in by_kind.items():
            names = sorted({ev[2] for ev in evs})
            index = {n: i for i, n in enumerate(names)}
            columns = list(zip(*(ev[3:11] for ev in evs)))
            data.record_batch(kind, names, [index[ev[2]] for ev in evs], *columns)
        pending.clear()

    for ev in events:
        op = ev[0]
        if op == "record":
            pending.append(ev)
            continue
        if pending:
            flush()
        if op == "api_enter":
            data.api_enter(ev[1], ev[2], ev[3], ev[4], ev[5], _capture(data, ev[6]))
        elif op == "api_exit":
            data.api_exit(ev[1], ev[2], ev[3], ev[4], ev[5])
        elif op == "node_created":
            data.node_created(ev[1], ev[2], ev[3], ev[4], _capture(data, ev[5]))
        elif op == "node_cloned":
            data.node_cloned(ev[1], ev[2])
        elif op == "graph_cloned":
            data.graph_cloned(ev[1], ev[2])
        elif op == "set_label":
            data.set_label(ev[1], ev[2])
        elif op == "api_table":
            data.set_api_table({(d, c): (name, kind) for d, c, name, kind in ev[1]})
        elif op == "dropped":
            data.dropped(ev[1])
        elif op == "session_start":
            data.session_start(ev[1])
        elif op == "session_stop":
            data.session_stop(ev[1])
        else:
            raise ValueError(f"unknown fixture event {op!r}")
    if pending:
        flush()
    return data


def load(path: str, **options: Any) -> Profile:
    """Rebuild a :class:`Profile` from a fixture file (``options`` as for ``profile()``).

    Example::

        prof = load("tests/fixtures/profile_graph_replay.json")
        print(prof.table())
    """
    with open(path) as f:
        doc = json.load(f)
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file")
    prof = Profile(ProfileOptions(**options))
    replay(doc["events"], prof.data)
    return prof
