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
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from graphtree.profile import _cbids
from graphtree.profile._aggregate import KERNEL, KIND_NAMES, MEMCPY, MEMSET, Aggregates
from graphtree.profile._attribution import DEFAULT_DEPTH, Stack, StackTable
from graphtree.profile._launches import CaptureFn, LaunchCalls
from graphtree.profile._nodes import GraphNodes
from graphtree.profile._records import GraphStats, KernelRecord, KernelStats, Launch, NodeInfo

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
    """Everything the profiler learned, fed by the ingest methods (see the module docstring): the
    launch calls (``_launches.LaunchCalls``), the graph nodes (``_nodes.GraphNodes``), the records
    and their aggregates (``_aggregate.Aggregates``), and what the session noted on the way.

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
        self.stacks = StackTable()
        api = dict(api_table or _cbids.recorded_api_table())
        self._calls = LaunchCalls(api, self.max_records, launch_generation)
        self.launch_generation = self._calls.table.generation
        self._nodes = GraphNodes()
        self._agg = Aggregates(self._calls, self._nodes, keep_records, self.max_records)
        self.sessions: list[list[int]] = []  # [start_ts, stop_ts] of each start()/stop()
        self.dropped_records = 0
        self.callback_errors = 0
        self.record_errors = 0
        self.buffers_completed = 0
        self.buffer_seconds = 0.0  # time spent in graphtree's buffer-completed callbacks
        self.max_buffers_in_flight = 0
        self.notes: list[str] = []
        self.wall_start_ns = 0
        self.buffer_path = ""  # how activity buffers arrived: "libcupti (path)" or "cupti-python"
        self.buffer_path_reason = ""  # why not libcupti, when it was not
        self.stop_timings: dict[str, float] = {}  # ms per step of the last stop()

    @property
    def launch_puts(self) -> int:
        """Entries ever put in the launch table (launches and their aliases); a record is matched
        to its launch as long as fewer than ``launch_generation`` puts happened since."""
        return self._calls.table.puts

    @property
    def streams(self) -> set[int]:
        """CUPTI stream ids seen in records (to ask for per-stream dropped counts)."""
        return self._agg.streams

    @property
    def first_start(self) -> int:
        """The earliest start of a record (CUPTI ns), 0 before any."""
        return self._agg.first_start

    @property
    def records_total(self) -> int:
        """Records ingested, kept or not."""
        return self._agg.records_total

    # ----------------------------------------------------------------------------- ingest
    def set_api_table(self, table: dict[tuple[int, int], tuple[str, str]]) -> None:
        """Use ``(domain, cbid) -> (api name, "kernel" | "graph")`` read from the live CUPTI."""
        self._calls.api = dict(table)

    def session_start(self, ts: int) -> None:
        """A profiling session began at CUPTI time ``ts`` (ns)."""
        self._calls.clear_open()
        self.sessions.append([ts, 0])
        if not self.wall_start_ns:
            self.wall_start_ns = time.time_ns()

    def session_stop(self, ts: int) -> None:
        """The current profiling session ended at CUPTI time ``ts`` (ns)."""
        if self.sessions:
            self.sessions[-1][1] = ts
        self._calls.clear_open()

    def set_label(self, thread: int, label: str | None) -> None:
        """Nodes captured on ``thread`` from now on carry ``label`` (graphtree's recording name)."""
        self._calls.set_label(thread, label)

    def api_enter(self, domain: int, cbid: int, corr: int, thread: int, ts: int, capture: CaptureFn) -> None:
        """A subscribed launch API was entered; ``capture()`` returns the caller's stack id (hot
        path: see ``LaunchCalls.enter``)."""
        self._calls.enter(domain, cbid, corr, thread, ts, capture)

    def api_exit(self, domain: int, cbid: int, corr: int, thread: int, ts: int) -> None:
        """A subscribed launch API returned."""
        self._calls.exit(domain, cbid, corr, thread, ts)

    def node_created(self, graph_id: int, node_id: int, node_type: int, thread: int, capture: CaptureFn) -> None:
        """CUPTI created graph node ``node_id`` (during stream capture or an explicit add). A launch
        call open on the same thread was captured, not run: the node takes its stack."""
        root = self._calls.open_root(thread)
        if root is not None:
            root.captured = True  # the launch call was captured into a graph: nothing ran
            sid = root.stack_id
        else:
            sid = capture()
        self._nodes.created(graph_id, node_id, node_type, sid, self._calls.label(thread))

    def node_cloned(self, node_id: int, original_node_id: int) -> None:
        """Node ``node_id`` (of an instantiated or cloned graph) is a copy of ``original_node_id``:
        it is attributed to the code that was captured (see ``_nodes.py``)."""
        self._nodes.cloned(node_id, original_node_id)

    def graph_cloned(self, graph_id: int, original_graph_id: int) -> None:
        """Graph ``graph_id`` is a copy of ``original_graph_id``."""
        self._nodes.graph_cloned(graph_id, original_graph_id)

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
        self._agg.add(kind, names, name_idx, start, end, device, stream, corr, graph_id, node_id, nbytes)

    def dropped(self, n: int) -> None:
        """CUPTI dropped ``n`` records (buffers full or not provided in time)."""
        if n > 0:
            self.dropped_records += int(n)

    # ----------------------------------------------------------------------------- queries
    @property
    def records(self) -> list[KernelRecord]:
        """The records kept (all of them unless ``keep_records=False`` or ``max_records`` was hit)."""
        return self._agg.records()

    def launches(self) -> list[Launch]:
        """Counted launches in order (at most ``max_records`` of them)."""
        return list(self._calls.log)

    def kernel_stats(self) -> list[KernelStats]:
        """Aggregates, largest total GPU time first (complete even when records were not kept)."""
        with self.lock:
            return self._agg.kernel_rows()

    def graph_stats(self) -> list[GraphStats]:
        """Per-graph aggregates, largest total GPU time first."""
        with self.lock:
            return self._agg.graph_rows()

    def stack(self, sid: int | None) -> Stack:
        """The stack with id ``sid`` (outermost frame first)."""
        return self.stacks.get(sid)

    def node(self, node_id: int) -> NodeInfo | None:
        """What is known of a graph node id seen in a record (follows clones)."""
        return self._nodes.resolve(node_id)

    def summary(self) -> dict[str, Any]:
        """Counts: records, launches, what was dropped, not kept, or not attributed.

        Example::

            >>> ProfileData().summary()["dropped_records"]
            0
        """
        wall = sum(max(0, b - a) for a, b in self.sessions if b)
        agg, calls = self._agg, self._calls
        return {
            "records": agg.records_total,
            "kernels": agg.records_by_kind[KERNEL],
            "memcpys": agg.records_by_kind[MEMCPY],
            "memsets": agg.records_by_kind[MEMSET],
            "gpu_ns": agg.gpu_ns_total,
            "records_kept": agg.kept,
            "records_not_kept": agg.records_not_kept,
            "dropped_records": self.dropped_records,
            "incomplete_records": agg.incomplete_records,
            "records_without_launch": agg.records_without_launch,
            "records_before_profiling": agg.records_before_profiling,
            "kernel_launches": calls.kernel_launches,
            "graph_launches": calls.graph_launches,
            "api_counts": dict(calls.api_counts),
            "nested_calls": calls.nested_calls,
            "capture_calls": calls.capture_calls,
            "unmatched_exits": calls.unmatched_exits,
            "nodes_created": self._nodes.created_count,
            "nodes_cloned": self._nodes.cloned_count,
            "graphs": agg.graph_count,
            "stacks": len(self.stacks),
            "launches_evicted": calls.table.evicted,
            "callback_errors": self.callback_errors,
            "record_errors": self.record_errors,
            "buffers_completed": self.buffers_completed,
            "max_buffers_in_flight": self.max_buffers_in_flight,
            "sessions": len(self.sessions),
            "profiled_ns": wall,
        }
