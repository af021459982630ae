"""The profile's record types: a kernel record, a launch, a graph node, per-kernel and per-graph
aggregates, and the chunked columns and launch table :class:`~graphtree.profile._model.ProfileData`
keeps them in. Plain data, no CUPTI: the model fills them and the exporters read them.

Example::

    KernelRecord(kind="kernel", name="k", start=100, end=250, ...)
"""

from __future__ import annotations

from typing import Any, NamedTuple


class KernelRecord(NamedTuple):
    """One GPU activity (kernel, memcpy or memset), kept while under ``max_records``.

    ``stack_id`` is the Python stack that produced it: for a kernel inside a graph replay, the code
    that was *captured*; for an eager launch, the launching code; for a graph captured before
    profiling (``captured_before_profiling``), the replay call site. ``graph_key`` is the captured
    graph's id (0: not from a graph).

    Example::

        rec = prof.records[0]; print(rec.name, rec.end - rec.start, prof.stack(rec.stack_id))
    """

    kind: str
    name: str
    start: int
    end: int
    device_id: int
    stream_id: int
    correlation_id: int
    graph_id: int
    graph_node_id: int
    stack_id: int
    graph_key: int
    captured_before_profiling: bool
    bytes: int
    label: str | None


class Launch:
    """One launch API call that launched something (captured calls are not launches).

    Example::

        for l in prof.launches():
            print(l.api, l.kind, l.kernels, l.gpu_ns)
    """

    __slots__ = (
        "correlation_id",
        "api",
        "kind",
        "stack_id",
        "thread",
        "t_enter",
        "t_exit",
        "captured",
        "counted",
        "kernels",
        "gpu_ns",
        "graph_key",
        "aliases",
    )

    def __init__(self, correlation_id: int, api: str, kind: str, stack_id: int, thread: int, t_enter: int):
        self.correlation_id = correlation_id
        self.api = api
        self.kind = kind
        self.stack_id = stack_id
        self.thread = thread
        self.t_enter = t_enter
        self.t_exit = 0
        self.captured = False
        self.counted = False
        self.kernels = 0
        self.gpu_ns = 0
        self.graph_key = 0
        self.aliases: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return (
            f"Launch({self.api}, corr={self.correlation_id}, kind={self.kind}, kernels={self.kernels}, "
            f"gpu_ns={self.gpu_ns})"
        )


class NodeInfo(NamedTuple):
    """What is known of a captured graph node: its graph, CUDA node type, stack and label."""

    graph_id: int
    node_type: int
    stack_id: int
    label: str | None


class KernelStats:
    """Aggregate of all records with one (kind, name, stack, graph, before-profiling, label).

    Example::

        top = prof.kernel_stats()[0]; print(top.name, top.count, top.total_ns / top.count)
    """

    __slots__ = (
        "kind",
        "name",
        "stack_id",
        "graph_key",
        "captured_before_profiling",
        "label",
        "count",
        "total_ns",
        "min_ns",
        "max_ns",
    )

    def __init__(self, kind: str, name: str, stack_id: int, graph_key: int, before: bool, label: str | None):
        self.kind = kind
        self.name = name
        self.stack_id = stack_id
        self.graph_key = graph_key
        self.captured_before_profiling = before
        self.label = label
        self.count = 0
        self.total_ns = 0
        self.min_ns = 0
        self.max_ns = 0

    def __repr__(self) -> str:
        return f"KernelStats({self.name!r}, count={self.count}, total_ns={self.total_ns})"


class GraphStats:
    """Per captured graph: replays seen, kernels, GPU time, where it was replayed from.

    Example::

        for g in prof.graph_stats(): print(g.graph_key, g.label, g.replays, g.kernels)
    """

    __slots__ = (
        "graph_key",
        "label",
        "captured_before_profiling",
        "replays",
        "kernels",
        "total_ns",
        "replay_stack_id",
        "apis",
    )

    def __init__(self, graph_key: int, label: str | None, before: bool, replay_stack_id: int):
        self.graph_key = graph_key
        self.label = label
        self.captured_before_profiling = before
        self.replays = 0
        self.kernels = 0
        self.total_ns = 0
        self.replay_stack_id = replay_stack_id
        self.apis: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"GraphStats({self.graph_key}, label={self.label!r}, replays={self.replays}, kernels={self.kernels})"


class Chunk:
    """Kept records of one ``record_batch`` call, as numpy columns."""

    __slots__ = ("kind", "names", "labels", "cols")

    def __init__(self, kind: str, names: list[str], labels: list[str | None], cols: list[Any]) -> None:
        self.kind = kind
        self.names = names
        self.labels = labels
        self.cols = cols

    def records(self) -> list[KernelRecord]:
        ni, start, end, dev, stream, corr, gid, nid, sid, gkey, before, nbytes, label = [c.tolist() for c in self.cols]
        names, labels, kind = self.names, self.labels, self.kind
        return [
            KernelRecord(
                kind,
                names[ni[i]],
                start[i],
                end[i],
                dev[i],
                stream[i],
                corr[i],
                gid[i],
                nid[i],
                sid[i],
                gkey[i],
                bool(before[i]),
                nbytes[i],
                labels[label[i]],
            )
            for i in range(len(start))
        ]


class LaunchTable:
    """Correlation id -> Launch, bounded: two generations of ``generation`` entries each.

    Records reach the profiler a few buffers after their launch; a launch two generations old
    (hundreds of thousands of launches ago) has had all its records delivered long since.
    """

    __slots__ = ("_cur", "_old", "_generation", "evicted", "puts")

    def __init__(self, generation: int) -> None:
        self._cur: dict[int, Launch] = {}
        self._old: dict[int, Launch] = {}
        self._generation = max(16, generation)
        self.evicted = 0
        self.puts = 0  # entries ever put: an entry survives at least ``generation`` later puts

    def put(self, corr: int, launch: Launch) -> None:
        self.puts += 1
        self._cur[corr] = launch
        if len(self._cur) >= self._generation:
            self.evicted += len(self._old)
            self._old = self._cur
            self._cur = {}

    def get(self, corr: int) -> Launch | None:
        launch = self._cur.get(corr)
        if launch is None:
            launch = self._old.get(corr)
        return launch

    def __len__(self) -> int:
        return len(self._cur) + len(self._old)

    @property
    def generation(self) -> int:
        return self._generation
