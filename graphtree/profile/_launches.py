"""The launch API calls the profiler saw (:class:`LaunchCalls`, a part of ``ProfileData``): which
launch each correlation id belongs to, which calls were captured into a graph rather than run, and
how many of each API ran.

Calls nest: ``cudaGraphLaunch`` calls ``cuGraphLaunch`` in the same thread; the inner call is folded
into the outer one (its correlation id becomes an alias), so that one launch counts once. A graph
node created while a launch call is open on the same thread means that launch was captured
(:meth:`LaunchCalls.open_root` gives it to the node, see ``_nodes.py``).

Example::

    >>> calls = LaunchCalls({(2, 211): ("cudaLaunchKernel", "kernel")}, max_log=10, generation=100)
    >>> calls.enter(2, 211, 7, 1, 0, lambda: 0)
    >>> calls.exit(2, 211, 7, 1, 0)
    >>> calls.kernel_launches, calls.get(7).api
    (1, 'cudaLaunchKernel')
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from graphtree.profile import _cbids
from graphtree.profile._records import Launch, LaunchTable

CaptureFn = Callable[[], int]


class LaunchCalls:
    """The launch calls seen: their table by correlation id, their log and their counts.

    ``api``: ``(domain, cbid) -> (api name, "kernel" | "graph")``, the calls that launch work;
    ``max_log``: how many counted launches :attr:`log` keeps; ``generation``: see ``LaunchTable``."""

    def __init__(self, api: dict[tuple[int, int], tuple[str, str]], max_log: int, generation: int) -> None:
        self.api = dict(api)
        self.table = LaunchTable(generation)
        self.log: list[Launch] = []  # counted launches, in order (at most max_log)
        self.max_log = max_log
        self._open: dict[int, list[tuple[int, int, Launch | None]]] = {}  # thread -> calls open on it
        self._labels: dict[int, str] = {}  # thread -> graphtree's recording name while it captures
        self._count_lock = threading.Lock()  # launch counters only: launches never wait for a buffer
        self.api_counts: dict[str, int] = {}
        self.kernel_launches = 0
        self.graph_launches = 0
        self.nested_calls = 0
        self.capture_calls = 0
        self.unmatched_exits = 0

    def clear_open(self) -> None:
        """Forget the calls open on every thread (a session starts or stops)."""
        self._open.clear()

    def set_label(self, thread: int, label: str | None) -> None:
        """Nodes captured on ``thread`` from now on carry ``label`` (graphtree's recording name)."""
        if label is None:
            self._labels.pop(thread, None)
        else:
            self._labels[thread] = label

    def label(self, thread: int) -> str | None:
        """The label of nodes captured on ``thread`` now."""
        return self._labels.get(thread)

    def open_root(self, thread: int) -> Launch | None:
        """The outermost launch call open on ``thread``, if any."""
        opened = self._open.get(thread)
        return opened[0][2] if opened else None

    def get(self, corr: int) -> Launch | None:
        """The launch of correlation id ``corr`` (or of a call nested in it), while the table keeps it."""
        return self.table.get(corr)

    def enter(self, domain: int, cbid: int, corr: int, thread: int, ts: int, capture: CaptureFn) -> None:
        """A subscribed launch API was entered; ``capture()`` returns the caller's stack id.

        Hot path (every launch, in the launching thread): the stack is captured only for the
        outermost call; the nested driver call of a runtime call costs two dict lookups.
        """
        opened = self._open.get(thread)
        if opened:
            if (domain, cbid) not in self.api:
                return
            # Nested in a launch already open on this thread (the runtime call's driver call):
            # the same launch, counted once; its correlation id is an alias of the outer one.
            root = opened[0][2]
            if root is not None and corr != root.correlation_id:
                self.table.put(corr, root)
                root.aliases = (*root.aliases, corr)
            opened.append((domain, cbid, None))
            self.nested_calls += 1
            return
        entry = self.api.get((domain, cbid))
        if entry is None:
            return
        launch = Launch(corr, entry[0], entry[1], capture(), thread, ts)
        self.table.put(corr, launch)
        if opened is None:
            self._open[thread] = [(domain, cbid, launch)]
        else:
            opened.append((domain, cbid, launch))

    def exit(self, domain: int, cbid: int, corr: int, thread: int, ts: int) -> None:
        """A subscribed launch API returned."""
        if (domain, cbid) not in self.api:
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
            if len(self.log) < self.max_log:
                self.log.append(launch)
