"""Records stashed as compact numpy columns while the program runs, aggregated later
(:class:`Stash`, a part of a session's ``ActivityBuffers``).

A completed activity buffer is only copied (a few vectorized copies per buffer) while CUPTI's thread
holds the GIL; aggregation runs at ``stop()``, on queries, or when ``options.defer_records`` records
or half a launch-table generation of launches are pending, so that memory stays bounded and every
record still finds its launch.

Example::

    stash = Stash(data, options, sink=data)
    stash.parser = parser                    # what reads the stashed columns (``_parse.py``)
    stash.add(parser.stash(activities))      # a completed buffer
    stash.drain()                            # aggregated into the sink, in arrival order
"""

from __future__ import annotations

from typing import Any

from graphtree.profile._model import ProfileData, ProfileOptions


class Stash:
    """Stashed ``(kind code, columns)`` items of completed buffers, not yet aggregated. ``parser``
    (set once the buffer path is chosen) resolves their kernel names and batches them."""

    def __init__(self, data: ProfileData, options: ProfileOptions, sink: Any) -> None:
        self._data = data
        self._options = options
        self._sink = sink
        self.parser: Any = None  # a _FastParser or _RawParser (kept after a layout mismatch)
        self._items: list[tuple[int, Any]] = []
        self.records = 0  # records stashed now
        self._since = 0  # data.launch_puts when the oldest stashed buffer arrived

    @property
    def pending(self) -> bool:
        """Whether records are stashed and not aggregated yet."""
        return bool(self._items)

    def add(self, items: list[tuple[int, Any]]) -> None:
        """A completed buffer's items; aggregates everything stashed once too much waits."""
        data = self._data
        with data.lock:
            data.buffers_completed += 1
            if not self._items:
                self._since = data.launch_puts
            self._items.extend(items)
            self.records += sum(int(a.shape[0]) for _, a in items)
            if (
                self.records >= self._options.defer_records
                or data.launch_puts - self._since >= data.launch_generation // 2
            ):
                self.drain()

    def resolve_names(self) -> None:
        """Read the kernel names (pointers into CUPTI's memory) while CUPTI is still attached."""
        if self.parser is not None:
            with self._data.lock:
                self.parser.resolve_names(self._items)

    def drain(self) -> None:
        """Aggregate every stashed record now (records keep their arrival order)."""
        data = self._data
        with data.lock:
            if not self._items:
                return
            items, self._items = self._items, []
            self.records = 0
            parser = self.parser
            if parser is None:  # pragma: no cover - nothing is stashed without a parser
                return
            try:
                for batch in parser.batches(items):
                    self._sink.record_batch(*batch)
            except Exception as e:
                data.record_errors += sum(int(a.shape[0]) for _, a in items)
                data.notes.append(f"records lost while aggregating ({type(e).__name__}: {e})")
