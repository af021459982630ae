"""GPU activity records and their aggregates (:class:`Aggregates`, a part of ``ProfileData``): each
record attributed to its launch (``_launches.py``) or its graph node (``_nodes.py``), summed per
kernel name, Python stack, graph and recording, per graph and per launch, and kept as numpy columns
while there is room.

Records come in batches of one kind (numpy columns, as CUPTI's buffers are parsed): Python work is
per distinct launch, node and aggregate, not per record.

Example::

    >>> from graphtree.profile._launches import LaunchCalls
    >>> from graphtree.profile._nodes import GraphNodes
    >>> agg = Aggregates(LaunchCalls({}, 10, 100), GraphNodes(), keep_records=True, max_records=10)
    >>> agg.add(0, ["k"], [0], [100], [250], [0], [7], [7], [0], [0], [0])
    >>> agg.kernel_rows()[0].total_ns, agg.records_total
    (150, 1)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from graphtree.profile._launches import LaunchCalls
from graphtree.profile._nodes import GraphNodes
from graphtree.profile._records import Chunk, GraphStats, KernelRecord, KernelStats, Launch

KERNEL, MEMCPY, MEMSET = 0, 1, 2
KIND_NAMES = ("kernel", "memcpy", "memset")


@dataclass
class _Attribution:
    """A batch's records attributed: per distinct correlation id its launch, per record its graph
    key, stack id and label (index into ``labels``), whether it is a graph's and whether its node
    was captured before profiling began."""

    ucorr: Any  # distinct correlation ids, their first record and each record's index among them
    first_idx: Any
    corr_inv: Any
    launches: list[Launch | None]
    have: Any  # per distinct correlation id: its launch is known
    labels: list[str | None]
    is_graph: Any
    before: Any
    gkey: Any
    sid: Any
    label: Any


class Aggregates:
    """Records kept and aggregated. ``launches`` and ``nodes`` attribute them; ``keep_records``
    and ``max_records`` bound what :meth:`records` keeps (aggregates are complete regardless)."""

    def __init__(self, launches: LaunchCalls, nodes: GraphNodes, keep_records: bool, max_records: int) -> None:
        self._launches = launches
        self._nodes = nodes
        self.keep_records = keep_records
        self.max_records = max_records
        self._names: dict[str, str] = {}  # one string object per kernel name
        self._stats: dict[tuple[int, str, int, int, bool, str | None], KernelStats] = {}
        self._graphs: dict[int, GraphStats] = {}
        self._segments: list[Any] = []  # kept records, in order: lists of plain tuples or Chunks (numpy columns)
        self.kept = 0
        self._records_view: list[KernelRecord] = []
        self._orphan_graph_corrs: set[int] = set()
        self.streams: set[int] = set()  # CUPTI stream ids seen (to ask for per-stream dropped counts)
        self.records_total = 0
        self.records_by_kind = [0, 0, 0]
        self.records_not_kept = 0
        self.records_without_launch = 0
        self.records_before_profiling = 0
        self.incomplete_records = 0
        self.gpu_ns_total = 0
        self.first_start = 0
        self.last_end = 0

    def add(
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
        """Records of one ``kind`` (numpy arrays or sequences; record i is named ``names[name_idx[i]]``)."""
        import numpy as np

        start = np.asarray(start, dtype=np.int64)
        n = int(start.shape[0])
        if n == 0:
            return
        end, device, stream, corr, graph_id, node_id, nbytes, name_idx = (
            np.asarray(a, dtype=np.int64) for a in (end, device, stream, corr, graph_id, node_id, nbytes, name_idx)
        )
        canon = [self._names.setdefault(nm, nm) for nm in names]
        dur = np.where((end > start) & (start > 0), end - start, 0)  # no start or end: no time
        self.incomplete_records += int(np.count_nonzero((start == 0) | (end == 0)))
        a = _attribute(np, self._launches, self._nodes, kind, corr, node_id, graph_id)
        self.records_before_profiling += int(np.count_nonzero(a.before))
        no_launch = ~a.have[a.corr_inv]
        self.records_without_launch += int(np.count_nonzero(no_launch & (a.is_graph | (kind == KERNEL))))
        self._add_graphs(np, a, dur)
        self._add_launches(np, a, dur)
        self._add_stats(np, kind, canon, name_idx, a, dur)
        self._add_totals(np, kind, start, end, stream, dur)
        room = (self.max_records - self.kept) if self.keep_records else 0
        take = max(0, min(n, room))
        if take:  # numpy columns, not Python tuples: no per-record objects for the GC to scan
            cols = [name_idx, start, end, device, stream, corr, graph_id, node_id, a.sid, a.gkey, a.before]
            cols += [nbytes, a.label]
            self._segments.append(Chunk(KIND_NAMES[kind], canon, a.labels, [c[:take].copy() for c in cols]))
            self.kept += take
        self.records_not_kept += n - take

    def _graph(self, gkey: int, label: str | None, before: bool, launch: Launch | None) -> GraphStats:
        g = self._graphs.get(gkey)
        if g is None:
            g = self._graphs[gkey] = GraphStats(gkey, label, before, launch.stack_id if launch else 0)
        elif g.label is None and label is not None:
            g.label = label
        return g

    def _add_graphs(self, np: Any, a: _Attribution, dur: Any) -> None:
        """Every graph of the batch exists, in record order, with its kernels and GPU time."""
        if not a.is_graph.any():
            return
        gi = np.flatnonzero(a.is_graph)
        ugk, ginv = _factorize(np, a.gkey[gi])
        gfirst = np.full(len(ugk), gi.shape[0], dtype=np.int64)
        np.minimum.at(gfirst, ginv, np.arange(gi.shape[0]))
        gcount = np.bincount(ginv, minlength=len(ugk))
        gsum = np.bincount(ginv, weights=dur[gi], minlength=len(ugk))
        for j in np.argsort(gfirst, kind="stable").tolist():
            r = int(gi[gfirst[j]])
            g = self._graph(int(ugk[j]), a.labels[int(a.label[r])], bool(a.before[r]), a.launches[int(a.corr_inv[r])])
            g.kernels += int(gcount[j])
            g.total_ns += int(round(gsum[j]))  # noqa: RUF046 - numpy 1.x round() gives a float64

    def _add_launches(self, np: Any, a: _Attribution, dur: Any) -> None:
        """Each launch's kernels and GPU time; a graph's replay counted at its launch's first record."""
        lcount = np.bincount(a.corr_inv, minlength=len(a.ucorr))
        lsum = np.bincount(a.corr_inv, weights=dur, minlength=len(a.ucorr))
        for j, launch in enumerate(a.launches):
            r = int(a.first_idx[j])
            if launch is not None:
                if a.is_graph[r] and launch.kernels == 0:
                    gk = int(a.gkey[r])
                    launch.graph_key = gk
                    g = self._graphs[gk]
                    g.replays += 1
                    g.apis[launch.api] = g.apis.get(launch.api, 0) + 1
                launch.kernels += int(lcount[j])
                launch.gpu_ns += int(round(lsum[j]))  # noqa: RUF046
            elif a.is_graph[r]:
                cid = int(a.ucorr[j])
                if cid not in self._orphan_graph_corrs:
                    if len(self._orphan_graph_corrs) > 100_000:
                        self._orphan_graph_corrs.clear()
                    self._orphan_graph_corrs.add(cid)
                    self._graphs[int(a.gkey[r])].replays += 1

    def _add_stats(self, np: Any, kind: int, canon: list[str], name_idx: Any, a: _Attribution, dur: Any) -> None:
        """The aggregates: one Python step per distinct (name, stack, graph, before, label)."""
        keys, kcount, ksum, kmin, kmax = _stat_groups(np, name_idx, a, dur)
        kind_name = KIND_NAMES[kind]
        for j, (ni, s_, gk, bf, li) in enumerate(keys):
            nm, lab = canon[ni], a.labels[li]
            key = (kind, nm, s_, gk, bool(bf), lab)
            st = self._stats.get(key)
            lo = int(kmin[j])
            if st is None:
                st = self._stats[key] = KernelStats(kind_name, nm, s_, gk, bool(bf), lab)
                st.min_ns = lo
            elif lo < st.min_ns:
                st.min_ns = lo
            st.max_ns = max(st.max_ns, int(kmax[j]))
            st.count += int(kcount[j])
            st.total_ns += int(round(ksum[j]))  # noqa: RUF046

    def _add_totals(self, np: Any, kind: int, start: Any, end: Any, stream: Any, dur: Any) -> None:
        n = int(start.shape[0])
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
        self.last_end = max(self.last_end, int(end.max()))

    def records(self) -> list[KernelRecord]:
        """The records kept, in order."""
        view = self._records_view
        if len(view) != self.kept:
            view.clear()
            for seg in self._segments:
                if isinstance(seg, list):
                    view.extend(KernelRecord._make(t) for t in seg)
                else:
                    view.extend(seg.records())
        return view

    def kernel_rows(self) -> list[KernelStats]:
        """Aggregates, largest total GPU time first."""
        rows = list(self._stats.values())
        rows.sort(key=lambda s: (-s.total_ns, -s.count, s.name))
        return rows

    def graph_rows(self) -> list[GraphStats]:
        """Per-graph aggregates, largest total GPU time first."""
        rows = list(self._graphs.values())
        rows.sort(key=lambda g: (-g.total_ns, g.graph_key))
        return rows

    @property
    def graph_count(self) -> int:
        return len(self._graphs)


def _attribute(
    np: Any, launches: LaunchCalls, nodes: GraphNodes, kind: int, corr: Any, node_id: Any, graph_id: Any
) -> _Attribution:
    """Each record's launch (one lookup per distinct correlation id) and node (one per distinct
    node id): its graph, stack and label, and whether its node was captured before profiling."""
    ucorr, first_idx, corr_inv = _group_runs(np, corr)
    found = [launches.get(c) for c in ucorr.tolist()]
    have = np.fromiter((lz is not None for lz in found), dtype=bool, count=len(found))
    lsid = np.fromiter((lz.stack_id if lz is not None else 0 for lz in found), dtype=np.int64, count=len(found))
    unode, node_inv = _factorize(np, node_id)
    labels: list[str | None] = [None]
    label_ids: dict[str | None, int] = {None: 0}
    nk, ns, ng, nl = [], [], [], []
    for nid in unode.tolist():
        info = nodes.resolve(nid) if nid else None
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
    if nodes.any_graph_cloned and before.any():
        ug, ug_inv = _factorize(np, graph_id)
        raw_gkey = np.asarray([nodes.graph_origin(g) for g in ug.tolist()], dtype=np.int64)[ug_inv]
    node_gkey = np.asarray(ng, dtype=np.int64)[node_inv]
    gkey = np.where(attributed, np.where(node_gkey != 0, node_gkey, graph_id), np.where(before, raw_gkey, 0))
    sid = np.where(attributed, np.asarray(ns, dtype=np.int64)[node_inv], lsid[corr_inv])
    label = np.where(attributed, np.asarray(nl, dtype=np.int64)[node_inv], 0)
    return _Attribution(ucorr, first_idx, corr_inv, found, have, labels, is_graph, before, gkey, sid, label)


def _stat_groups(np: Any, name_idx: Any, a: _Attribution, dur: Any) -> tuple[list[tuple[Any, ...]], Any, Any, Any, Any]:
    """The distinct (name index, stack, graph key, before, label index) of a batch, with each one's
    record count, GPU time and shortest and longest record."""
    usid, sid_c = _factorize(np, a.sid)
    ugk, gk_c = _factorize(np, a.gkey)
    n_s, n_g, n_l = len(usid), len(ugk), len(a.labels)
    code = (((name_idx * n_s + sid_c.reshape(-1)) * n_g + gk_c.reshape(-1)) * 2 + a.before) * n_l + a.label
    ucode, kinv = _factorize(np, code)
    kinv = kinv.reshape(-1)
    m = len(ucode)
    li_, rest = np.divmod(ucode, n_l)[::-1]
    rest, bf_ = np.divmod(rest, 2)
    rest, gkc_ = np.divmod(rest, n_g)
    ni_, sc_ = np.divmod(rest, n_s)
    keys = list(zip(ni_.tolist(), usid[sc_].tolist(), ugk[gkc_].tolist(), bf_.tolist(), li_.tolist()))
    kmin = np.full(m, np.iinfo(np.int64).max, dtype=np.int64)
    kmax = np.zeros(m, dtype=np.int64)
    np.minimum.at(kmin, kinv, dur)
    np.maximum.at(kmax, kinv, dur)
    return keys, np.bincount(kinv, minlength=m), np.bincount(kinv, weights=dur, minlength=m), kmin, kmax


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
