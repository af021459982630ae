"""The activity side of a profiling session: the buffers CUPTI fills with kernel, memcpy and memset
records, and what becomes of them.

:class:`ActivityBuffers` registers the buffer callbacks (raw buffers straight from libcupti through
ctypes when its record layouts check out, see ``_rawbuf``; else cupti-python's), switches the
activity kinds on and off (for the whole session, or the sampler's windows), flushes, copies each
completed buffer's records into compact numpy columns (the fast paths) or reads them one by one
(the fallbacks), and aggregates what is stashed (``_stash.py``) into the session's sink on
:meth:`drain`. The
subscription and the API callbacks are the session's (``_session.py``).

Example::

    buffers = ActivityBuffers(cupti, data, options, sink)   # after subscribing
    buffers.enable(); ...; errors = []; buffers.close(errors, timings)
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from graphtree.profile import _rawbuf
from graphtree.profile._model import ProfileData, ProfileOptions
from graphtree.profile._parse import (
    _FastParser,
    _memcpy_names,
    _RawParser,
    _record_classes,
    batches_of_objects,
    objects_in_raw_buffer,
)
from graphtree.profile._stash import Stash

__all__ = ["ActivityBuffers", "step"]

_RAW_LAYOUT_BAD = False  # a raw buffer failed its layout check: later sessions use cupti-python's


class ActivityBuffers:
    """One session's activity records, from CUPTI's buffers to the sink (built whole: the buffer
    callbacks are registered by the constructor; nothing is traced until :meth:`enable`).

    Example::

        buffers = ActivityBuffers(cupti, data, ProfileOptions(), data)
        buffers.enable(); step(x); buffers.close([], {})
    """

    def __init__(self, cupti: Any, data: ProfileData, options: ProfileOptions, sink: Any) -> None:
        self.cupti = cupti
        self.data = data
        self.options = options
        self.sink = sink
        kinds = [cupti.ActivityKind.CONCURRENT_KERNEL]
        if options.memcpy:
            kinds += [cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET]
        self.kinds = [int(k) for k in kinds]  # the activity kinds this session traces
        self.enabled_kinds: list[int] = []
        self._in_flight = 0
        self._flush_period_set = False
        self._fast: _FastParser | None = None
        self.stash = Stash(data, options, sink)  # compact columns not yet aggregated (_stash.py)
        # activity control: libcupti through ctypes (raw buffers) or cupti-python
        self._act: Any = None
        self._raw: _RawParser | None = None  # raw-buffer parser while its layout checks pass
        self._raw_backend: Any = None
        self._pool: _rawbuf.BufferPool | None = None
        self._register(cupti)

    # -- activity on and off (the whole session, or the sampler's windows)
    def enable(self) -> None:
        """Trace this session's activity kinds from now on."""
        for kind in self.kinds:
            self._act.enable(kind)
            self.enabled_kinds.append(kind)

    def disable(self) -> None:
        """Stop tracing (records already in CUPTI's buffers still arrive at the next flush)."""
        for kind in self.enabled_kinds:
            self._act.disable(kind)
        self.enabled_kinds = []

    def flush_forced(self) -> None:
        """Make CUPTI hand over every buffer, full or not (our buffer callbacks run meanwhile)."""
        self._act.flush_all(int(getattr(getattr(self.cupti, "ActivityFlag", None), "FLUSH_FORCED", 1)))

    def flush(self) -> None:
        """Hand over every buffer and aggregate it now (the end of a sampler's window)."""
        self.flush_forced()
        self.drain()

    def _register(self, cupti: Any) -> None:
        """Register the activity buffer callbacks: raw buffers straight from libcupti when it can
        be loaded and the record dtypes are known (see ``_rawbuf``), else cupti-python's."""
        data = self.data
        if self.options.vectorized and self.options.raw_buffers and not _RAW_LAYOUT_BAD:
            parser = _RawParser.create(cupti, self.options)
            backend = None
            if parser is not None:
                try:
                    backend = _rawbuf.open_backend(cupti)
                except Exception as e:  # no libcupti to load: cupti-python's buffers
                    data.buffer_path_reason = f"{type(e).__name__}: {e}"
            if parser is not None and backend is not None:
                parser.backend = backend
                parser.objects = _record_classes(cupti)
                self._pool = _rawbuf.BufferPool(int(self.options.buffer_size), keep=self.options.buffer_pool)
                try:
                    backend.register(self._raw_requested, self._raw_completed)
                    self._set_flush_period(backend)
                except Exception as e:  # this libcupti will not do: cupti-python's buffers
                    data.buffer_path_reason = f"{type(e).__name__}: {e}"
                    self._pool = None
                    backend.release()
                else:
                    self._raw = self.stash.parser = parser
                    self._raw_backend = self._act = backend
                    data.buffer_path = f"libcupti ({getattr(backend, 'path', '?')})"
                    return
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        self._act = _CuptiPythonActivity(cupti)
        self._set_flush_period(self._act)
        self._fast = _FastParser.create(cupti, self.options) if self.options.vectorized else None
        self.stash.parser = self._fast
        data.buffer_path = "cupti-python"

    def _set_flush_period(self, act: Any) -> None:
        if self.options.flush_period_ms > 0 and act.has_flush_period:
            act.flush_period(int(self.options.flush_period_ms))
            self._flush_period_set = True

    def _buffer_requested(self, *args: Any) -> tuple[int, int]:
        self._in_flight += 1
        if self._in_flight > self.data.max_buffers_in_flight:
            self.data.max_buffers_in_flight = self._in_flight
        return int(self.options.buffer_size), 0

    def _buffer_completed(self, *args: Any) -> None:
        """CUPTI's thread hands over a completed buffer (holding the GIL: the replay loop waits).

        Fast path: copy the needed fields of the buffer's records into compact numpy columns
        (:meth:`_FastParser.stash`, a few vectorized copies per buffer) and return. Aggregation
        (:meth:`drain`) runs at ``stop()``, on queries, or when ``options.defer_records`` records or
        half a launch-table generation of launches are pending, so memory stays bounded and every
        record still finds its launch.
        """
        self._in_flight = max(0, self._in_flight - 1)
        data = self.data
        activities = args[-1] if args else ()
        if not activities:
            with data.lock:
                data.buffers_completed += 1
            return
        if self._fast is not None:
            try:
                items = self._fast.stash(activities)
            except Exception as e:  # layout not as expected: per-record path from now on
                self._fast = None
                self._vectorized_failed(e)
            else:
                self.stash.add(items)
                return
        self._completed_slow(activities)

    def _vectorized_failed(self, e: BaseException) -> None:
        """Note why bulk parsing stopped, and aggregate what it stashed (records keep their order)."""
        self.data.notes.append(f"vectorized record parsing disabled ({type(e).__name__}: {e})")
        self.drain()

    # -- raw buffers (libcupti through ctypes)
    def _raw_requested(self) -> tuple[int, int]:
        pool = self._pool
        if pool is None:
            return 0, 0
        got = pool.take()
        if pool.max_in_flight > self.data.max_buffers_in_flight:
            self.data.max_buffers_in_flight = pool.max_in_flight
        return got

    def _raw_completed(self, addr: int, size: int, valid: int) -> None:
        """CUPTI hands back buffer ``addr`` with ``valid`` bytes of records (CUPTI's thread, or the
        flushing one; ctypes holds the GIL meanwhile). The records' fields are copied into compact
        numpy columns (:meth:`_RawParser.stash_raw`: a few vectorized copies per run of records of
        one kind, no Python object per record), then the buffer goes back to the pool."""
        data = self.data
        t0 = time.perf_counter()
        try:
            if valid <= 0:
                with data.lock:
                    data.buffers_completed += 1
                return
            raw = self._raw
            if raw is not None:
                try:
                    items = raw.stash_raw(addr, valid)
                except Exception as e:  # layout not as expected: CUPTI's iterator + cupti-python objects
                    global _RAW_LAYOUT_BAD
                    _RAW_LAYOUT_BAD = True  # later sessions use cupti-python's buffers
                    self._raw = None
                    self._vectorized_failed(e)
                else:
                    self.stash.add(items)
                    return
            self._raw_completed_slow(addr, valid)
        except Exception:
            data.record_errors += 1
        finally:
            pool = self._pool
            if pool is not None:
                pool.give(addr)
            data.buffer_seconds += time.perf_counter() - t0

    def _raw_completed_slow(self, addr: int, valid: int) -> None:
        """Per-record fallback: CUPTI's own iterator finds the records, cupti-python's classes
        (``from_ptr``) read them."""
        classes = getattr(self.stash.parser, "objects", {}) or {}
        objs, lost = objects_in_raw_buffer(self._raw_backend, classes, addr, valid)
        self.data.record_errors += lost
        self._completed_slow(objs)

    @property
    def pending(self) -> bool:
        """Whether records are stashed and not aggregated yet."""
        return self.stash.pending

    def drain(self) -> None:
        """Aggregate every stashed record now (records keep their arrival order)."""
        self.stash.drain()

    def _completed_slow(self, activities: Any) -> None:
        """Per-record reading (cupti-python objects), aggregated per kind in one batch each."""
        data = self.data
        try:
            batches, unread = batches_of_objects(self.cupti, activities, self._memcpy_names)
            data.record_errors += unread
            with data.lock:
                data.buffers_completed += 1
                for batch in batches:
                    self.sink.record_batch(*batch)
        except Exception:
            data.record_errors += 1

    @functools.cached_property
    def _memcpy_names(self) -> dict[int, str]:
        return _memcpy_names(self.cupti)

    # -- stop
    def close(self, errors: list[str], timings: dict[str, float]) -> None:
        """Flush, disable the activity kinds, flush again, read the kernel names and give the
        buffers back; each step runs even if an earlier one failed (its error goes to ``errors``,
        its time to ``timings``). Aggregation waits for the first query (``Profile._drain``)."""
        act = self._act
        in_callbacks, buffers = self.data.buffer_seconds, self.data.buffers_completed
        if self.enabled_kinds:
            step(errors, "flush", self.flush_forced, timings)
            timings["flush: buffers"] = self.data.buffers_completed - buffers
            timings["flush: in graphtree's buffer callbacks"] = 1e3 * (self.data.buffer_seconds - in_callbacks)
        for kind in self.enabled_kinds:
            step(
                errors,
                f"disable activity {kind}",
                lambda: act.disable(kind),  # noqa: B023 - step calls it at once
                timings,
                "disable",
            )
        if self.enabled_kinds:
            step(errors, "flush", self.flush_forced, timings, "flush again")
        self.enabled_kinds = []
        step(errors, "read kernel names", self.stash.resolve_names, timings)
        if self._flush_period_set:
            step(errors, "flush period", lambda: act.flush_period(0), timings)
            self._flush_period_set = False
        if self._pool is not None:
            if self._pool.in_flight:  # CUPTI still holds some: never free memory it may write to
                _rawbuf.ORPHANED.append(self._pool)
            self._pool = None
        if self._raw_backend is not None and hasattr(self._raw_backend, "release"):
            self._raw_backend.release()


class _CuptiPythonActivity:
    """Activity control through cupti-python (the path without raw buffers)."""

    def __init__(self, cupti: Any) -> None:
        self.cupti = cupti
        self.has_flush_period = hasattr(cupti, "activity_flush_period")

    def enable(self, kind: int) -> None:
        self.cupti.activity_enable(kind)

    def disable(self, kind: int) -> None:
        self.cupti.activity_disable(kind)

    def flush_all(self, flag: int) -> None:
        self.cupti.activity_flush_all(flag)

    def flush_period(self, ms: int) -> None:
        self.cupti.activity_flush_period(ms)


def step(
    errors: list[str], what: str, fn: Callable[[], Any], timings: dict[str, float] | None = None, key: str | None = None
) -> None:
    """Run one step of tearing down: its error is noted in ``errors``, its time (ms) in ``timings``."""
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # keep tearing down: never leave CUPTI subscribed
        errors.append(f"{what}: {type(e).__name__}: {e}")
    finally:
        if timings is not None:
            k = key or what
            timings[k] = timings.get(k, 0.0) + 1e3 * (time.perf_counter() - t0)
