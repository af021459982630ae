"""Sampled profiling: CUPTI's activity tracing on only inside short windows, so a server can keep it on.

What a profile costs is almost all CUPTI's activity tracing (5-8 % of a decode loop on H100 and
H200); the launch and graph-node callbacks cost about nothing (``callback_floor`` of
``benchmarks/profile_overhead.py``: within ±0.1 %). So in sampled mode the callbacks stay on the
whole time - every graph node captured meanwhile keeps its Python line, every launch is counted -
and the activity kinds are on for ``window_steps`` steps out of every ``every_steps``. The
program marks its steps with ``prof.step()``, as with ``torch.profiler``'s schedules.

Windows open and close only at a step boundary with the GPU idle (one synchronize per window
edge): turning CUPTI's kernel activity on and off from a background thread while graph replays
were in flight was measured on an H100 (2026-11-23) to leave half of a window's records without
timestamps, to give kernels durations of 450 ms (a start from one window, an end from the next),
and to spoil the timings of a full profile started afterwards in the same process.

At the end of a window the activity is turned off and flushed, the window's records are
aggregated, and a :class:`WindowReport` (the window's own kernels, with their call sites) is kept
in ``Profile.windows`` and handed to ``on_window``. Records of kernels outside windows are never
made.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Sampling", "WindowReport"]


@dataclass(frozen=True)
class Sampling:
    """Profile in windows: ``window_steps`` steps traced out of every ``every_steps``.

    Steps are counted by ``prof.step()``, which the program calls once per iteration. The
    default, 20 steps of every 2000 (1 %), keeps the averaged cost near 1 % of CUPTI's 5-8 % and
    gives a decode loop a window every few seconds. The first window opens at the first
    ``prof.step()``. ``on_window(report)`` is called after each window, in the thread that calls
    ``step()`` (an exception it raises becomes a note of the profile); the last ``keep_windows``
    reports stay in ``Profile.windows``.

    Example::

        prof = graphtree.profile(sample=graphtree.profile.Sampling(on_window=lambda w: print(w.table(5))))
        with prof:
            while serving:
                prof.step()
                decode_one_token()
    """

    window_steps: int = 20
    every_steps: int = 2000
    on_window: Callable[[WindowReport], None] | None = field(default=None, compare=False)
    keep_windows: int = 64

    def __post_init__(self) -> None:
        if type(self.window_steps) is not int or self.window_steps < 1:
            raise ValueError(f"Sampling(window_steps=...) must be a positive int, got {self.window_steps!r}")
        if type(self.every_steps) is not int or self.every_steps <= self.window_steps:
            raise ValueError(
                f"Sampling(every_steps=...) must be an int larger than window_steps ({self.window_steps}), "
                f"got {self.every_steps!r}"
            )
        if type(self.keep_windows) is not int or self.keep_windows < 1:
            raise ValueError(f"Sampling(keep_windows=...) must be a positive int, got {self.keep_windows!r}")


@dataclass
class WindowRow:
    """One kernel (or memcpy/memset) and call site within one window."""

    kind: str
    name: str
    site: str
    count: int
    total_ns: int


@dataclass
class WindowReport:
    """What one sampling window saw: its kernels by GPU time, largest first.

    Example::

        for row in report.rows[:3]:
            print(row.name, row.count, row.total_ns / row.count)
    """

    index: int
    started_at: float  # time.time() when the window opened
    duration_ms: float  # from its opening to its closing step
    rows: list[WindowRow]
    edge_ms: float = 0.0  # spent at its opening and closing steps (synchronize, flush, aggregation)

    @property
    def gpu_ns(self) -> int:
        return sum(r.total_ns for r in self.rows)

    def table(self, limit: int = 15) -> str:
        """The window's top kernels as text."""
        stamp = time.strftime("%H:%M:%S", time.localtime(self.started_at))
        lines = [
            f"window {self.index} at {stamp} ({self.duration_ms:.1f} ms traced): "
            f"{sum(r.count for r in self.rows):,} GPU records, {self.gpu_ns / 1e6:.3f} ms GPU time"
        ]
        total = self.gpu_ns or 1
        for r in self.rows[:limit]:
            share = 100.0 * r.total_ns / total
            lines.append(f"{r.total_ns / 1e6:>10.3f} ms {share:>5.1f}% {r.count:>8,}  {r.name[:48]:<48} {r.site}")
        return "\n".join(lines)


class Sampler:
    """Opens and closes a session's windows at ``step()`` (see the module docstring).

    ``enable()``/``disable()`` turn the activity kinds on and off, ``quiesce()`` waits for the GPU
    to be idle, ``flush()`` makes CUPTI hand over the window's buffers, ``rows()`` gives the
    aggregated rows so far (cumulative: a window's rows are the difference of two calls),
    ``site(stats)`` a row's call site. ``lock`` serializes ``step()`` (from any thread) and ``stop()``.
    """

    def __init__(
        self,
        sampling: Sampling,
        *,
        enable: Callable[[], None],
        disable: Callable[[], None],
        quiesce: Callable[[], None],
        flush: Callable[[], None],
        rows: Callable[[], dict[Any, tuple[int, int, Any]]],
        site: Callable[[Any], str],
        note: Callable[[str], None],
    ) -> None:
        self.sampling = sampling
        self._enable, self._disable, self._quiesce = enable, disable, quiesce
        self._flush, self._rows, self._site, self._note = flush, rows, site, note
        self.lock = threading.Lock()
        self.tracing = False
        self.steps = 0  # prof.step() calls so far
        self.windows: collections.deque[WindowReport] = collections.deque(maxlen=sampling.keep_windows)
        self._index = 0
        self._opened = (0.0, 0.0)  # (monotonic, wall) time the open window opened
        self._before: dict[Any, tuple[int, int, Any]] = {}
        self._open_seconds = 0.0  # spent opening the current window
        self._stopped = False  # after stop(), step() does nothing (a step racing the session's end)

    def step(self) -> None:
        """One step ended: open or close a window when the schedule says so."""
        with self.lock:
            if self._stopped:
                return
            n = self.steps
            self.steps += 1
            phase = n % self.sampling.every_steps
            if phase == 0 and not self.tracing:
                t0 = time.monotonic()
                self._quiesce()
                self._enable()
                self.tracing = True
                self._opened = (time.monotonic(), time.time())
                self._open_seconds = self._opened[0] - t0
            elif phase == self.sampling.window_steps and self.tracing:
                self._close()

    def stop(self) -> None:
        """Close an open window (its records are kept); later ``step()`` calls do nothing."""
        with self.lock:
            self._stopped = True
            if self.tracing:
                self._close()

    def _close(self) -> None:
        t0 = time.monotonic()
        self._quiesce()
        self._disable()
        self.tracing = False
        opened, wall = self._opened
        duration_ms = 1000 * (time.monotonic() - opened)
        self._flush()
        now = self._rows()
        before = self._before
        rows = []
        for key, (count, total_ns, st) in now.items():
            was = before.get(key)
            if was is not None:
                count, total_ns = count - was[0], total_ns - was[1]
            if count:
                rows.append(WindowRow(st.kind, st.name, self._site(st), count, total_ns))
        self._before = now
        rows.sort(key=lambda r: (-r.total_ns, r.name))
        edge_ms = 1000 * (self._open_seconds + time.monotonic() - t0)
        report = WindowReport(self._index, wall, duration_ms, rows, edge_ms)
        self._index += 1
        self.windows.append(report)
        callback = self.sampling.on_window
        if callback is not None:
            try:
                callback(report)
            except Exception as e:  # noqa: BLE001 - the user's callback must not stop the sampling
                self._note(f"on_window raised {type(e).__name__}: {e}")
