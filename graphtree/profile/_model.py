"""The in-memory profile: launches, graph nodes, GPU records, aggregates, and what was lost.

:class:`ProfileData` is fed by the CUPTI session (``_session.py``) through a handful of *ingest*
methods whose arguments are plain numbers and strings (so a recorded run can be replayed from JSON
fixtures, see ``tools/profile_fixture.py``):

- ``api_enter`` / ``api_exit``: a launch API call (runtime or driver, kernel or graph launch).
  Calls nest: ``cudaGraphLaunch`` calls ``cuGraphLaunch`` in the same thread; the inner call is
  folded into the outer one (its correlation id becomes an alias), so one launch counts once.
- ``node_created`` / ``node_cloned`` / ``graph_cloned``: CUPTI resource callbacks. A node created
  while a launch call is open on the same thread means that launch was *captured*, not executed:
  it is not counted as a launch, and the node inherits the launch's Python stack.
- ``record``: one GPU activity record (kernel, memcpy, memset).
- ``dropped``: records CUPTI reports as dropped.

:class:`~graphtree.profile._profile.Profile` (``_profile.py``) is the public object around it.

Example::

    >>> data = ProfileData()
    >>> data.api_enter(2, 211, 7, 1, 0, lambda: 0)       # cudaLaunchKernel, correlation 7
    >>> data.api_exit(2, 211, 7, 1, 0)
    >>> data.record(KERNEL, "k", 100, 250, 0, 7, 7, 0, 0, 0)
    >>> data.summary()["kernel_launches"], data.kernel_stats()[0].total_ns
    (1, 150)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from graphtree.profile import _cbids
from graphtree.profile._attribution import DEFAULT_DEPTH, Stack, StackTable
from graphtree.profile._records import Chunk, GraphStats, KernelRecord, KernelStats, Launch, LaunchTable, NodeInfo

__all__ = [
    "KERNEL",
    "KIND_NAMES",
    "MEMCPY",
    "MEMSET",
    "GraphStats",
    "KernelRecord",
    "KernelStats",
    "Launch",
    "ProfileData",
    "ProfileOptions",
]

KERNEL, MEMCPY, MEMSET = 0, 1, 2
KIND_NAMES = ("kernel", "memcpy", "memset")

CaptureFn = Callable[[], int]


@dataclass
class ProfileOptions:
    """Options of :func:`graphtree.profile.profile` (see there).

    Example::

        ProfileOptions(keep_records=False)
    """

    keep_records: bool = True
    max_records: int = 200_000
    memcpy: bool = True
    buffer_size: int = 8 << 20
    flush_period_ms: int = 1000
    stack_depth: int = DEFAULT_DEPTH
    finalize: bool = False
    launch_generation: int = 100_000
    vectorized: bool = True
    # Records stashed as raw numpy columns (~50 bytes each) before they are aggregated: completed
    # buffers are only copied while the program runs, aggregation happens at stop(), on queries,
    # or when this many are pending (0: aggregate every buffer when it completes).
    defer_records: int = 1_000_000
    # Activity buffers straight from libcupti through ctypes (no Python object per record); False:
    # cupti-python's buffer callbacks. Falls back to those by itself when libcupti is not found.
    raw_buffers: bool = True
    # Free activity buffers kept for reuse (memory: (in flight + this) * buffer_size).
    buffer_pool: int = 3
    # Sampled mode (graphtree.profile.Sampling): activity traced only inside windows.
    sample: Any | None = None
    tap: Any | None = field(default=None, repr=False)


class ProfileData:
    """Everything the profiler learned, fed by the ingest methods (see the module docstring).

    Example::

        data = ProfileData(keep_records=False)
        ...  # ingest
        data.kernel_stats()
    """

    def __init__(
        self,
        keep_records: bool = True,
        max_records: int = 200_000,
        launch_generation: int = 100_000,
        api_table: dict[tuple[int, int], tuple[str, str]] | None = None,
    ) -> None:
        self.keep_records = keep_records
        self.max_records = max(0, int(max_records))
        self.lock = threading.RLock()  # records and aggregates (held per completed buffer)
        self._count_lock = threading.Lock()  # launch counters only: launches never wait for a buffer
        self.stacks = StackTable()
        self._api: dict[tuple[int, int], tuple[str, str]] = dict(api_table or _cbids.recorded_api_table())
        self._open: dict[int, list[tuple[int, int, Launch | None]]] = {}
        self._labels: dict[int, str] = {}
        self._launches = LaunchTable(launch_generation)
        self.launch_generation = self._launches.generation
        self._launch_log: list[Launch] = []
        self._nodes: dict[int, NodeInfo] = {}
        self._clones: dict[int, int] = {}
        self._resolved: dict[int, NodeInfo | None] = {}  # node id -> _resolve_node() (cache)
        self._graph_clones: dict[int, int] = {}
        self._stats: dict[tuple[int, str, int, int, bool, str | None], KernelStats] = {}
        self._graphs: dict[int, GraphStats] = {}
        # Kept records, in order: lists of plain tuples (per-record path) or Chunk (numpy columns).
        self._segments: list[Any] = []
        self._kept = 0
        self._records_view: list[KernelRecord] = []
        self._orphan_graph_corrs: set = set()
        self._names: dict[str, str] = {}
        self.sessions: list[list[int]] = []  # [start_ts, stop_ts] of each start()/stop()
        self.api_counts: dict[str, int] = {}
        self.kernel_launches = 0
        self.graph_launches = 0
        self.nested_calls = 0
        self.capture_calls = 0
        self.unmatched_exits = 0
        self.nodes_created = 0
        self.nodes_cloned = 0
        self.records_total = 0
        self.records_by_kind = [0, 0, 0]
        self.records_not_kept = 0
        self.records_without_launch = 0
        self.records_before_profiling = 0
        self.incomplete_records = 0
        self.dropped_records = 0
        self.callback_errors = 0
        self.record_errors = 0
        self.buffers_completed = 0
        self.buffer_seconds = 0.0  # time spent in graphtree's buffer-completed callbacks
        self.max_buffers_in_flight = 0
        self.gpu_ns_total = 0
        self.first_start = 0
        self.last_end = 0
        self.notes: list[str] = []
        self.wall_start_ns = 0
        self.streams: set = set()  # CUPTI stream ids seen (to ask for per-stream dropped counts)
        self.buffer_path = ""  # how activity buffers arrived: "libcupti (path)" or "cupti-python"
        self.buffer_path_reason = ""  # why not libcupti, when it was not
        self.stop_timings: dict[str, float] = {}  # ms per step of the last stop()

    @property
    def launch_puts(self) -> int:
        """Entries ever put in the launch table (launches and their aliases); a record is matched
        to its launch as long as fewer than ``launch_generation`` puts happened since."""
        return self._launches.puts

    # ----------------------------------------------------------------------------- ingest
    def set_api_table(self, table: dict[tuple[int, int], tuple[str, str]]) -> None:
        """Use ``(domain, cbid) -> (api name, "kernel" | "graph")`` read from the live CUPTI."""
        self._api = dict(table)

    def session_start(self, ts: int) -> None:
        """A profiling session began at CUPTI time ``ts`` (ns)."""
        self._open.clear()
        self.sessions.append([ts, 0])
        if not self.wall_start_ns:
            self.wall_start_ns = time.time_ns()

    def session_stop(self, ts: int) -> None:
        """The current profiling session ended at CUPTI time ``ts`` (ns)."""
        if self.sessions:
            self.sessions[-1][1] = ts
        self._open.clear()

    def set_label(self, thread: int, label: str | None) -> None:
        """Nodes captured on ``thread`` from now on carry ``label`` (graphtree's recording name)."""
        if label is None:
            self._labels.pop(thread, None)
        else:
            self._labels[thread] = label

    def api_enter(self, domain: int, cbid: int, corr: int, thread: int, ts: int, capture: CaptureFn) -> None:
        """A subscribed launch API was entered; ``capture()`` returns the caller's stack id.

        Hot path (every launch, in the launching thread): the stack is captured only for the
        outermost call; the nested driver call of a runtime call costs two dict lookups.
        """
        opened = self._open.get(thread)
        if opened:
            if (domain, cbid) not in self._api:
                return
            # Nested in a launch already open on this thread (the runtime call's driver call):
            # the same launch, counted once; its correlation id is an alias of the outer one.
            root = opened[0][2]
            if root is not None and corr != root.correlation_id:
                self._launches.put(corr, root)
                root.aliases = (*root.aliases, corr)
            opened.append((domain, cbid, None))
            self.nested_calls += 1
            return
        entry = self._api.get((domain, cbid))
        if entry is None:
            return
        launch = Launch(corr, entry[0], entry[1], capture(), thread, ts)
        self._launches.put(corr, launch)
        if opened is None:
            self._open[thread] = [(domain, cbid, launch)]
        else:
            opened.append((domain, cbid, launch))

    def api_exit(self, domain: int, cbid: int, corr: int, thread: int, ts: int) -> None:
        """A subscribed launch API returned."""
        if (domain, cbid) not in self._api:
            return
        opened = self._open.get(thread)
        if not opened:
            self.unmatched_exits += 1
            return
        d, c, launch = opened.pop()
        if (d, c) != (domain, cbid):
            self.unmatched_exits += 1
        if not opened:
            del self._open[thread]
        if launch is None:
            return
        launch.t_exit = ts
        if launch.captured:
            self.capture_calls += 1
            return
        launch.counted = True
        with self._count_lock:
            self.api_counts[launch.api] = self.api_counts.get(launch.api, 0) + 1
            if launch.kind == _cbids.GRAPH:
                self.graph_launches += 1
            else:
                self.kernel_launches += 1
            if len(self._launch_log) < self.max_records:
                self._launch_log.append(launch)

    def node_created(self, graph_id: int, node_id: int, node_type: int, thread: int, capture: CaptureFn) -> None:
        """CUPTI created graph node ``node_id`` (during stream capture or an explicit add)."""
        opened = self._open.get(thread)
        root = opened[0][2] if opened else None
        if root is not None:
            root.captured = True  # the launch call was captured into a graph: nothing ran
            sid = root.stack_id
        else:
            sid = capture()
        self._nodes[node_id] = NodeInfo(graph_id, node_type, sid, self._labels.get(thread))
        self._resolved.pop(node_id, None)
        if self._clones:
            self._resolved.clear()  # a clone chain may end at this node
        self.nodes_created += 1

    def node_cloned(self, node_id: int, original_node_id: int) -> None:
        """Node ``node_id`` (of an instantiated or cloned graph) is a copy of ``original_node_id``.

        The clone mapping wins over anything ``node_created`` said about ``node_id``: at
        instantiation CUDA first reports the exec graph's node as *created* (with the stack of the
        instantiate call), then as *cloned* from the captured node; the kernel belongs to the code
        that was captured, so the original's attribution is what the node resolves to.
        """
        if node_id != original_node_id:
            self._clones[node_id] = original_node_id
            self._resolved.clear()
        self.nodes_cloned += 1

    def graph_cloned(self, graph_id: int, original_graph_id: int) -> None:
        """Graph ``graph_id`` is a copy of ``original_graph_id``."""
        if graph_id != original_graph_id:
            self._graph_clones[graph_id] = original_graph_id

    def _resolve_node(self, node_id: int) -> NodeInfo | None:
        """What node ``node_id`` is attributed to: a cloned node resolves through its clone chain
        to the original node (``None`` when the original is unknown: captured before profiling);
        a node that is no clone resolves to what ``node_created`` recorded for it."""
        try:
            return self._resolved[node_id]
        except KeyError:
            pass
        node: NodeInfo | None
        nid = node_id
        seen = 0
        while nid in self._clones and seen < 32:
            nid = self._clones[nid]
            seen += 1
        node = self._nodes.get(nid)
        if len(self._resolved) > 1_000_000:
            self._resolved.clear()
        self._resolved[node_id] = node
        return node

    def _graph(self, gkey: int, label: str | None, before: bool, launch: Launch | None) -> GraphStats:
        g = self._graphs.get(gkey)
        if g is None:
            g = self._graphs[gkey] = GraphStats(gkey, label, before, launch.stack_id if launch else 0)
        elif g.label is None and label is not None:
            g.label = label
        return g

    def record(
        self,
        kind: int,
        name: str,
        start: int,
        end: int,
        device: int,
        stream: int,
        corr: int,
        graph_id: int,
        node_id: int,
        nbytes: int,
    ) -> None:
        """One GPU activity record (``kind`` is KERNEL, MEMCPY or MEMSET): :meth:`record_batch`
        of one, so that one implementation aggregates (callers with many records batch them)."""
        self.record_batch(
            kind, [name], [0], [start], [end], [device], [stream], [corr], [graph_id], [node_id], [nbytes]
        )

    def record_batch(
        self,
        kind: int,
        names: Sequence[str],
        name_idx: Any,
        start: Any,
        end: Any,
        device: Any,
        stream: Any,
        corr: Any,
        graph_id: Any,
        node_id: Any,
        nbytes: Any,
    ) -> None:
        """Many records of one ``kind`` at once (numpy arrays; record i is named
        ``names[name_idx[i]]``). Same result as calling :meth:`record` for each, in order, at a
        fraction of the cost: Python work is per distinct launch / node / aggregate, not per record.
        """
        import numpy as np

        start = np.asarray(start, dtype=np.int64)
        n = int(start.shape[0])
        if n == 0:
            return
        end = np.asarray(end, dtype=np.int64)
        device = np.asarray(device, dtype=np.int64)
        stream = np.asarray(stream, dtype=np.int64)
        corr = np.asarray(corr, dtype=np.int64)
        graph_id = np.asarray(graph_id, dtype=np.int64)
        node_id = np.asarray(node_id, dtype=np.int64)
        nbytes = np.asarray(nbytes, dtype=np.int64)
        name_idx = np.asarray(name_idx, dtype=np.int64)
        canon = []
        for nm in names:
            c = self._names.get(nm)
            if c is None:
                c = self._names.setdefault(nm, nm)
            canon.append(c)

        dur = np.where((end > start) & (start > 0), end - start, 0)  # see record(): no start or end, no time
        self.incomplete_records += int(np.count_nonzero((start == 0) | (end == 0)))

        # launches, one lookup per distinct correlation id
        ucorr, first_idx, corr_inv = _group_runs(np, corr)
        launches = [self._launches.get(c) for c in ucorr.tolist()]
        have = np.fromiter((lz is not None for lz in launches), dtype=bool, count=len(launches))
        lsid = np.fromiter(
            (lz.stack_id if lz is not None else 0 for lz in launches), dtype=np.int64, count=len(launches)
        )

        # graph nodes, one lookup per distinct node id
        unode, node_inv = _factorize(np, node_id)
        labels: list[str | None] = [None]
        label_ids: dict[str | None, int] = {None: 0}
        nk, ns, ng, nl = [], [], [], []
        for nid in unode.tolist():
            info = self._resolve_node(nid) if nid else None
            nk.append(info is not None)
            ns.append(info.stack_id if info is not None else 0)
            ng.append(info.graph_id if info is not None else 0)
            lab = info.label if info is not None else None
            li = label_ids.get(lab)
            if li is None:
                li = label_ids[lab] = len(labels)
                labels.append(lab)
            nl.append(li)
        node_known = np.asarray(nk, dtype=bool)[node_inv]
        is_graph = node_id != 0
        attributed = is_graph & node_known
        before = is_graph & ~node_known
        raw_gkey = graph_id
        if self._graph_clones and before.any():
            ug, ug_inv = _factorize(np, graph_id)
            raw_gkey = np.asarray([self._graph_clones.get(g, g) for g in ug.tolist()], dtype=np.int64)[ug_inv]
        node_gkey = np.asarray(ng, dtype=np.int64)[node_inv]
        gkey = np.where(attributed, np.where(node_gkey != 0, node_gkey, graph_id), np.where(before, raw_gkey, 0))
        sid = np.where(attributed, np.asarray(ns, dtype=np.int64)[node_inv], lsid[corr_inv])
        label = np.where(attributed, np.asarray(nl, dtype=np.int64)[node_inv], 0)
        self.records_before_profiling += int(np.count_nonzero(before))
        no_launch = ~have[corr_inv]
        counted_missing = no_launch & (is_graph | (kind == KERNEL))
        self.records_without_launch += int(np.count_nonzero(counted_missing))

        # graphs: make sure every graph of this batch exists, in record order
        if is_graph.any():
            gi = np.flatnonzero(is_graph)
            ugk, ginv = _factorize(np, gkey[gi])
            gfirst = np.full(len(ugk), gi.shape[0], dtype=np.int64)
            np.minimum.at(gfirst, ginv, np.arange(gi.shape[0]))
            gcount = np.bincount(ginv, minlength=len(ugk))
            gsum = np.bincount(ginv, weights=dur[gi], minlength=len(ugk))
            for j in np.argsort(gfirst, kind="stable").tolist():
                r = int(gi[gfirst[j]])
                gk = int(ugk[j])
                g = self._graphs.get(gk)
                lab = labels[int(label[r])]
                if g is None:
                    launch = launches[int(corr_inv[r])]
                    g = self._graph(gk, lab, bool(before[r]), launch)
                elif g.label is None and lab is not None:
                    g.label = lab
                g.kernels += int(gcount[j])
                g.total_ns += int(round(gsum[j]))  # noqa: RUF046 - numpy 1.x round() gives a float64

        # launches: kernels, GPU time, and the replay counted at a launch's first record
        lcount = np.bincount(corr_inv, minlength=len(ucorr))
        lsum = np.bincount(corr_inv, weights=dur, minlength=len(ucorr))
        for j, launch in enumerate(launches):
            r = int(first_idx[j])
            if launch is not None:
                if is_graph[r] and launch.kernels == 0:
                    gk = int(gkey[r])
                    launch.graph_key = gk
                    g = self._graphs[gk]
                    g.replays += 1
                    g.apis[launch.api] = g.apis.get(launch.api, 0) + 1
                launch.kernels += int(lcount[j])
                launch.gpu_ns += int(round(lsum[j]))  # noqa: RUF046
            elif is_graph[r]:
                cid = int(ucorr[j])
                if cid not in self._orphan_graph_corrs:
                    if len(self._orphan_graph_corrs) > 100_000:
                        self._orphan_graph_corrs.clear()
                    self._orphan_graph_corrs.add(cid)
                    self._graphs[int(gkey[r])].replays += 1

        # aggregates, one Python step per distinct (name, stack, graph, before, label)
        usid, sid_c = _factorize(np, sid)
        ugk, gk_c = _factorize(np, gkey)
        n_s, n_g, n_l = len(usid), len(ugk), len(labels)
        code = (((name_idx * n_s + sid_c.reshape(-1)) * n_g + gk_c.reshape(-1)) * 2 + before) * n_l + label
        ucode, kinv = _factorize(np, code)
        kinv = kinv.reshape(-1)
        m = len(ucode)
        li_, rest = np.divmod(ucode, n_l)[::-1]
        rest, bf_ = np.divmod(rest, 2)
        rest, gkc_ = np.divmod(rest, n_g)
        ni_, sc_ = np.divmod(rest, n_s)
        ukeys = zip(ni_.tolist(), usid[sc_].tolist(), ugk[gkc_].tolist(), bf_.tolist(), li_.tolist())
        kcount = np.bincount(kinv, minlength=m)
        ksum = np.bincount(kinv, weights=dur, minlength=m)
        kmin = np.full(m, np.iinfo(np.int64).max, dtype=np.int64)
        kmax = np.zeros(m, dtype=np.int64)
        np.minimum.at(kmin, kinv, dur)
        np.maximum.at(kmax, kinv, dur)
        kind_name = KIND_NAMES[kind]
        for j, (ni, s_, gk, bf, li) in enumerate(ukeys):
            nm = canon[ni]
            lab = labels[li]
            key = (kind, nm, s_, gk, bool(bf), lab)
            st = self._stats.get(key)
            lo = int(kmin[j])
            if st is None:
                st = self._stats[key] = KernelStats(kind_name, nm, s_, gk, bool(bf), lab)
                st.min_ns = lo
            elif lo < st.min_ns:
                st.min_ns = lo
            hi = int(kmax[j])
            if hi > st.max_ns:
                st.max_ns = hi
            st.count += int(kcount[j])
            st.total_ns += int(round(ksum[j]))  # noqa: RUF046

        if len(self.streams) < 256:
            self.streams.update(_factorize(np, stream)[0].tolist()[:256])
        self.records_total += n
        self.records_by_kind[kind] += n
        self.gpu_ns_total += int(dur.sum())
        nz = start[start != 0]
        if nz.size:
            lo = int(nz.min())
            if self.first_start == 0 or lo < self.first_start:
                self.first_start = lo
        hi = int(end.max())
        if hi > self.last_end:
            self.last_end = hi

        room = (self.max_records - self._kept) if self.keep_records else 0
        take = max(0, min(n, room))
        if take:
            # numpy columns, not Python tuples: no per-record objects for the GC to scan
            cols = [
                a[:take].copy()
                for a in (
                    name_idx,
                    start,
                    end,
                    device,
                    stream,
                    corr,
                    graph_id,
                    node_id,
                    sid,
                    gkey,
                    before,
                    nbytes,
                    label,
                )
            ]
            self._segments.append(Chunk(kind_name, canon, labels, cols))
            self._kept += take
        self.records_not_kept += n - take

    def dropped(self, n: int) -> None:
        """CUPTI dropped ``n`` records (buffers full or not provided in time)."""
        if n > 0:
            self.dropped_records += int(n)

    # ----------------------------------------------------------------------------- queries
    @property
    def records(self) -> list[KernelRecord]:
        """The records kept (all of them unless ``keep_records=False`` or ``max_records`` was hit)."""
        view = self._records_view
        if len(view) != self._kept:
            view.clear()
            for seg in self._segments:
                if isinstance(seg, list):
                    view.extend(KernelRecord._make(t) for t in seg)
                else:
                    view.extend(seg.records())
        return view

    def launches(self) -> list[Launch]:
        """Counted launches in order (at most ``max_records`` of them)."""
        return list(self._launch_log)

    def kernel_stats(self) -> list[KernelStats]:
        """Aggregates, largest total GPU time first (complete even when records were not kept)."""
        with self.lock:
            rows = list(self._stats.values())
        rows.sort(key=lambda s: (-s.total_ns, -s.count, s.name))
        return rows

    def graph_stats(self) -> list[GraphStats]:
        """Per-graph aggregates, largest total GPU time first."""
        with self.lock:
            rows = list(self._graphs.values())
        rows.sort(key=lambda g: (-g.total_ns, g.graph_key))
        return rows

    def stack(self, sid: int | None) -> Stack:
        """The stack with id ``sid`` (outermost frame first)."""
        return self.stacks.get(sid)

    def node(self, node_id: int) -> NodeInfo | None:
        """What is known of a graph node id seen in a record (follows clones)."""
        return self._resolve_node(node_id)

    def summary(self) -> dict[str, Any]:
        """Counts: records, launches, what was dropped, not kept, or not attributed.

        Example::

            >>> ProfileData().summary()["dropped_records"]
            0
        """
        wall = sum(max(0, b - a) for a, b in self.sessions if b)
        return {
            "records": self.records_total,
            "kernels": self.records_by_kind[KERNEL],
            "memcpys": self.records_by_kind[MEMCPY],
            "memsets": self.records_by_kind[MEMSET],
            "gpu_ns": self.gpu_ns_total,
            "records_kept": self._kept,
            "records_not_kept": self.records_not_kept,
            "dropped_records": self.dropped_records,
            "incomplete_records": self.incomplete_records,
            "records_without_launch": self.records_without_launch,
            "records_before_profiling": self.records_before_profiling,
            "kernel_launches": self.kernel_launches,
            "graph_launches": self.graph_launches,
            "api_counts": dict(self.api_counts),
            "nested_calls": self.nested_calls,
            "capture_calls": self.capture_calls,
            "unmatched_exits": self.unmatched_exits,
            "nodes_created": self.nodes_created,
            "nodes_cloned": self.nodes_cloned,
            "graphs": len(self._graphs),
            "stacks": len(self.stacks),
            "launches_evicted": self._launches.evicted,
            "callback_errors": self.callback_errors,
            "record_errors": self.record_errors,
            "buffers_completed": self.buffers_completed,
            "max_buffers_in_flight": self.max_buffers_in_flight,
            "sessions": len(self.sessions),
            "profiled_ns": wall,
        }


def _factorize(np: Any, a: Any) -> tuple[Any, Any]:
    """``np.unique(a, return_inverse=True)`` for int64 ``a``, without sorting when the values
    span a small range (graph node ids, stack ids, aggregate keys: O(n + span) instead of a sort)."""
    n = int(a.shape[0])
    if n == 0:
        return a[:0], np.zeros(0, dtype=np.int64)
    lo, hi = int(a.min()), int(a.max())
    span = hi - lo + 1
    if span > max(1 << 16, 2 * n):
        u, inv = np.unique(a, return_inverse=True)
        return u, inv.reshape(-1)
    rel = a - lo
    present = np.zeros(span, dtype=bool)
    present[rel] = True
    ids = np.cumsum(present) - 1
    return np.flatnonzero(present) + lo, ids[rel]


def _group_runs(np: Any, a: Any) -> tuple[Any, Any, Any]:
    """``np.unique(a, return_index=True, return_inverse=True)`` through runs of equal values:
    a graph replay's records share one correlation id and arrive together, so the sort (when
    one is needed at all) is over runs, not records."""
    n = int(a.shape[0])
    starts = np.concatenate(([0], np.flatnonzero(a[1:] != a[:-1]) + 1))
    vals = a[starts]
    lengths = np.diff(np.concatenate((starts, [n])))
    if vals.shape[0] < 2 or bool((vals[1:] > vals[:-1]).all()):  # increasing: already unique, in order
        return vals, starts, np.repeat(np.arange(vals.shape[0]), lengths)
    u, idx, inv = np.unique(vals, return_index=True, return_inverse=True)
    return u, starts[idx], np.repeat(inv.reshape(-1), lengths)
