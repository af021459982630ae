"""``Profile``: the public object :func:`graphtree.profile.profile` returns.

It owns the :class:`~graphtree.profile._model.ProfileData` that its CUPTI sessions
(``_session.py``) feed, starts and stops them, and answers the queries (aggregating records a
session stashed, at the first query after ``stop()``).
"""

from __future__ import annotations

import time
from typing import Any

from graphtree.profile import _cbids
from graphtree.profile._attribution import Stack
from graphtree.profile._model import GraphStats, KernelRecord, KernelStats, Launch, ProfileData, ProfileOptions
from graphtree.profile._session import Session

__all__ = ["Profile"]


class Profile:
    """A GPU profile: a context manager that runs CUPTI, then the results and their exports.

    Created by :func:`graphtree.profile.profile`; ``start()``/``stop()`` may be called several
    times, and every session adds to the same results.

    Example::

        with graphtree.profile() as prof:
            for _ in range(10):
                step(x)
        print(prof.table())
        prof.export_chrome("trace.json")
        prof.export_pprof("gpu.pb.gz")
    """

    def __init__(self, options: ProfileOptions | None = None, **kwargs: Any) -> None:
        self.options = options or ProfileOptions(**kwargs)
        self.data = ProfileData(
            keep_records=self.options.keep_records,
            max_records=self.options.max_records,
            launch_generation=self.options.launch_generation,
        )
        self._session: Any = None
        self._stopped: Any = None  # a stopped session whose records are not aggregated yet
        self._windows: Any = ()  # the sampler's reports (sampled mode)

    # ----------------------------------------------------------------------------- control
    @property
    def running(self) -> bool:
        """Whether CUPTI is collecting for this profile now."""
        return self._session is not None

    def start(self) -> Profile:
        """Subscribe to CUPTI and start collecting (raises ProfilerBusyError/ProfilerUnavailableError).

        Example::

            prof = graphtree.profile().start(); step(x); prof.stop()
        """
        if self._session is not None:
            return self
        self._drain()  # records of an earlier session first, in order
        session = Session(self.data, self.options)
        session.start()
        self._session = session
        if session.sampler is not None:
            self._windows = session.sampler.windows
        return self

    def step(self) -> None:
        """Mark the end of one step (iteration) of the program: in sampled mode
        (:class:`~graphtree.profile.Sampling`) windows open and close here. Without sampling it
        does nothing, so a loop may always call it.

        Example::

            with graphtree.profile(sample=graphtree.profile.Sampling()) as prof:
                for batch in loader:
                    train_step(batch)
                    prof.step()
        """
        session = self._session
        if session is not None and session.sampler is not None:
            session.sampler.step()

    @property
    def windows(self) -> list[Any]:
        """Reports of the windows of a sampled profile (:class:`~graphtree.profile.Sampling`), oldest first."""
        return list(self._windows)

    def stop(self) -> Profile:
        """Synchronize, flush every record, and release CUPTI (safe to call twice).

        The records are aggregated later, by the first query (:meth:`summary`, :meth:`table`,
        ...): stopping costs the flush and a copy of the records' fields, not their aggregation.
        """
        session, self._session = self._session, None
        if session is not None:
            session.stop()
            if session.pending:
                self._stopped = session
        return self

    def __enter__(self) -> Profile:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ----------------------------------------------------------------------------- results
    def _drain(self) -> None:
        """Aggregate records stashed by the running session (queries while profiling see them
        all) or left by the last ``stop()`` (timed in ``data.stop_timings["aggregate records"]``)."""
        stopped, self._stopped = self._stopped, None
        if stopped is not None:
            t0 = time.perf_counter()
            stopped.drain()
            self.data.stop_timings["aggregate records"] = 1e3 * (time.perf_counter() - t0)
        session = self._session
        if session is not None:
            session.drain()

    @property
    def records(self) -> list[KernelRecord]:
        """Kept GPU records (see :class:`KernelRecord`)."""
        self._drain()
        return self.data.records

    def launches(self) -> list[Launch]:
        """Counted launches (eager kernel launches and graph launches)."""
        self._drain()
        return self.data.launches()

    def graph_launches(self) -> list[Launch]:
        """Counted graph launches, each with the number of kernels it ran (``kernels``)."""
        return [launch for launch in self.launches() if launch.kind == _cbids.GRAPH]

    def kernel_stats(self) -> list[KernelStats]:
        """Aggregated kernels, largest GPU time first."""
        self._drain()
        return self.data.kernel_stats()

    def graph_stats(self) -> list[GraphStats]:
        """Aggregated graphs, largest GPU time first."""
        self._drain()
        return self.data.graph_stats()

    def stack(self, stack_id: int | None) -> Stack:
        """Frames ``(filename, lineno, function)`` of a stack id, outermost first."""
        return self.data.stack(stack_id)

    def summary(self) -> dict[str, Any]:
        """Counts of records, launches, drops (see :meth:`ProfileData.summary`)."""
        self._drain()
        return self.data.summary()

    def table(self, limit: int = 15) -> str:
        """Top kernels and graphs by GPU time, with call sites, as text.

        Example::

            print(prof.table(limit=10))
        """
        from graphtree.profile.exporters import format_table

        return format_table(self, limit=limit)

    def export_chrome(self, path: str) -> str:
        """Write a Chrome/Perfetto trace (JSON ``traceEvents``) to ``path``; returns ``path``."""
        from graphtree.profile.exporters import export_chrome

        return export_chrome(self, path)

    def export_pprof(self, path: str) -> str:
        """Write GPU time per Python stack as a gzip'd pprof protobuf to ``path``; returns ``path``."""
        from graphtree.profile.exporters import export_pprof

        return export_pprof(self, path)

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"<graphtree.profile.Profile records={s['records']} kernel_launches={s['kernel_launches']} "
            f"graph_launches={s['graph_launches']} dropped={s['dropped_records']}"
            f"{' running' if self.running else ''}>"
        )
