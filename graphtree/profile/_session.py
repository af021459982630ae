"""The CUPTI side: subscription, callbacks, activity buffers, flush, teardown, busy detection.

One :class:`Session` is one ``start()``..``stop()`` of a :class:`graphtree.profile.Profile`. At most
one runs per process (CUPTI allows a single callback subscriber).

Order of ``start()`` (see DESIGN.md for why):

1. import ``cupti.cupti`` (missing: :class:`ProfilerUnavailableError` saying
   ``pip install 'graphtree[profile]'``);
2. ``subscribe_v2`` (or ``subscribe``) *first*: if another tool holds CUPTI this fails with
   ``CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`` before anything global (activity kinds,
   buffer callbacks) was touched, and becomes :class:`ProfilerBusyError`;
3. enable the launch callbacks (runtime + driver kernel launches, their ``_ptsz``/``Ex`` forms,
   ``cudaGraphLaunch[_ptsz]``, ``cuGraphLaunch[_ptsz]``) and the resource callbacks
   ``GRAPHNODE_CREATED``, ``GRAPHNODE_CLONED``, ``GRAPH_CLONED`` - never the capture callbacks;
4. register the activity buffer callbacks and a flush period;
5. enable ``CONCURRENT_KERNEL`` (+ ``MEMCPY``, ``MEMSET``) activity - never ``GRAPH_TRACE``.

``stop()``: synchronize CUDA, forced flush, disable the activity kinds, flush again, disable the
callbacks, unsubscribe, read CUPTI's dropped-record count. ``cuptiFinalize`` is *not* called unless
asked for (``finalize=True``): tearing CUPTI down and re-initialising it is what crashes CUDA graphs
(pytorch/pytorch#75504 and the follow-up Kineto workarounds).

Example::

    session = Session(ProfileData(), ProfileOptions())
    session.start(); step(x); session.stop()
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from graphtree.profile import _cbids, _rawbuf
from graphtree.profile._attribution import capture_stack, format_frame
from graphtree.profile._errors import INSTALL_HINT, ProfilerBusyError, ProfilerUnavailableError
from graphtree.profile._model import KERNEL, MEMCPY, MEMSET, ProfileData, ProfileOptions
from graphtree.profile._parse import _FastParser, _memcpy_names, _pin, _RawParser, _record_classes
from graphtree.profile._sampling import Sampler, Sampling

__all__ = ["Session", "active_session", "guess_other_cupti_users", "load_cupti"]

SUBSCRIBER_NAME = "graphtree.profile"
_MULTIPLE_SUBSCRIBERS = 39  # cupti.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED
_STATE_LOCK = threading.Lock()
_RAW_LAYOUT_BAD = False  # a raw buffer failed its layout check: later sessions use cupti-python's
_ACTIVE: Session | None = None


def active_session() -> Session | None:
    """The running session of this process, if any.

    Example::

        assert active_session() is None
    """
    return _ACTIVE


def load_cupti() -> Any:
    """Import NVIDIA's ``cupti.cupti`` bindings or raise :class:`ProfilerUnavailableError`.

    Example::

        cupti = load_cupti()
        print(cupti.ActivityKind.CONCURRENT_KERNEL)
    """
    try:
        return importlib.import_module("cupti.cupti")
    except ImportError as e:
        raise ProfilerUnavailableError(
            "graphtree.profile needs NVIDIA's CUPTI Python bindings (the `cupti` module, package "
            f"cupti-python) and they cannot be imported ({e}). Install them with: {INSTALL_HINT} "
            "(pick the cupti-python release that matches your CUDA's CUPTI, e.g. cupti-python 13.0.x "
            "for nvidia-cuda-cupti 13.0)."
        ) from e


def _status(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    try:
        return int(status) if status is not None else None
    except (TypeError, ValueError):
        return None


def guess_other_cupti_users(old_subscriber_name: str = "") -> list[str]:
    """Best guesses at who else holds CUPTI in this process, most likely first.

    Example::

        >>> isinstance(guess_other_cupti_users(), list)
        True
    """
    who: list[str] = []
    if old_subscriber_name and old_subscriber_name.strip("<>") != "not provided":
        who.append(f"the subscriber named {old_subscriber_name!r}")
    if "torch" in sys.modules:
        from graphtree import _torch

        if _torch.torch_profiler_active():
            who.append("torch.profiler (a torch.profiler.profile() / Kineto session is running)")
    inj = os.environ.get("CUDA_INJECTION64_PATH", "")
    low = inj.lower()
    keys = " ".join(os.environ).upper()
    if "sanitizer" in low or "SANITIZER" in keys:
        who.append("compute-sanitizer")
    if "nsys" in low or "nsight-systems" in low or "toolsinjection" in low or "NSYS_" in keys:
        who.append("Nsight Systems (nsys)")
    if "ncu" in low or "nsight-compute" in low or "nsight_compute" in low or "NV_COMPUTE_PROFILER" in keys:
        who.append("Nsight Compute (ncu)")
    if inj and not any(w for w in who if "Nsight" in w or "sanitizer" in w):
        who.append(f"the CUDA injection library {inj!r} (CUDA_INJECTION64_PATH)")
    if not who and "torch.profiler" in sys.modules:  # only a guess when nothing else explains it
        who.append("torch.profiler/Kineto from an earlier session (Kineto may keep its CUPTI subscription)")
    if "dcgm" in keys.lower():
        who.append("DCGM profiling")
    return who


def _busy_message(old_subscriber_name: str = "") -> str:
    who = guess_other_cupti_users(old_subscriber_name)
    likely = (
        " or ".join(who)
        if who
        else "another CUPTI-based tool (torch.profiler, Nsight Systems/Compute, compute-sanitizer)"
    )
    return (
        "graphtree.profile cannot start: CUPTI already has a subscriber in this process "
        f"(CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED); likely {likely}. CUPTI allows one "
        "profiler at a time: stop the other one first (leave the torch.profiler.profile() block, or "
        "run without nsys/ncu/compute-sanitizer), or profile in a separate process."
    )


def _synchronize_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return
    except Exception:
        return
    current = torch.cuda.current_device()
    torch.cuda.synchronize(current)
    for d in range(torch.cuda.device_count()):
        if d != current and torch.cuda.memory_allocated(d) > 0:
            torch.cuda.synchronize(d)


class Session:
    """One CUPTI subscription plus activity collection feeding a :class:`ProfileData`.

    Example::

        s = Session(data, ProfileOptions()); s.start(); ...; s.stop()
    """

    def __init__(self, data: ProfileData, options: ProfileOptions) -> None:
        self.data = data
        self.options = options
        self.sink: Any = options.tap(data) if options.tap is not None else data
        self.cupti: Any = None
        self.subscriber: Any = None
        self.enabled_callbacks: list[tuple[int, int]] = []
        self.enabled_kinds: list[int] = []
        self._kinds: list[int] = []  # the activity kinds this session traces
        self.sampler: Sampler | None = None  # sampled mode: opens and closes the tracing windows
        self._sites: dict[Any, str] = {}  # (stack id, graph, label) -> call site text (window tables)
        self.missing_callbacks: list[str] = []
        self._flush_period_set = False
        self._in_flight = 0
        self._unsubscribe_events: list[Callable[[], None]] = []
        self._capture = functools.partial(capture_stack, data.stacks, options.stack_depth)
        self._params: Any = None
        self._callback: Any = None
        self._resource_ids: dict[str, int] = {}
        self._atexit: Callable[[], None] | None = None
        self._fast: _FastParser | None = None
        self._drainer: _FastParser | None = None  # parses what was stashed (kept after a mismatch)
        self._pending: list[tuple[int, Any]] = []  # stashed (code, compact columns), not yet aggregated
        self._pending_records = 0
        self._pending_since = 0  # data.launch_puts when the oldest pending buffer arrived
        # activity control: libcupti through ctypes (raw buffers) or cupti-python
        self._act: Any = None
        self._raw: _RawParser | None = None  # raw-buffer parser while its layout checks pass
        self._raw_backend: Any = None
        self._pool: _rawbuf.BufferPool | None = None
        self.buffer_path = ""  # "libcupti" (raw buffers through ctypes) or "cupti-python"

    # ----------------------------------------------------------------------------- start
    def start(self) -> None:
        """Subscribe, enable callbacks and activity kinds (see the module docstring for the order)."""
        global _ACTIVE
        with _STATE_LOCK:
            if _ACTIVE is not None:
                raise ProfilerBusyError(
                    "graphtree.profile is already running in this process (CUPTI allows one "
                    "subscriber): stop the other graphtree.profile() first."
                )
            cupti = load_cupti()
            self.cupti = cupti
            domains, api_table, launch_ids, resource_ids = self._resolve_ids(cupti)
            self.sink.set_api_table(api_table)
            self._subscribe(cupti)
            try:
                sub = self.subscriber
                for domain, cbid in launch_ids + [(domains["resource"], c) for c in resource_ids.values()]:
                    cupti.enable_callback(1, sub, domain, cbid)
                    self.enabled_callbacks.append((domain, cbid))
                self._resource_ids = resource_ids
                self._register_buffers(cupti)
                kinds = [cupti.ActivityKind.CONCURRENT_KERNEL]
                if self.options.memcpy:
                    kinds += [cupti.ActivityKind.MEMCPY, cupti.ActivityKind.MEMSET]
                self._kinds = [int(k) for k in kinds]
                if self.options.sample is None:
                    self._enable_activity()
                else:  # sampled: the sampler turns activity on inside windows only
                    self.sampler = self._make_sampler(self.options.sample)
            except BaseException as e:
                self._teardown([])
                if _status(e) == _MULTIPLE_SUBSCRIBERS:
                    raise ProfilerBusyError(_busy_message()) from e
                if isinstance(e, Exception):
                    raise ProfilerUnavailableError(f"CUPTI could not be set up for profiling: {e}") from e
                raise
            self._watch_graphtree()
            self.sink.session_start(self._now())
            _ACTIVE = self
            self._atexit = self._stop_at_exit
            atexit.register(self._atexit)

    # -- activity on and off (the whole session, or the sampler's windows)
    def _enable_activity(self) -> None:
        for kind in self._kinds:
            self._act.enable(kind)
            self.enabled_kinds.append(kind)

    def _disable_activity(self) -> None:
        for kind in self.enabled_kinds:
            self._act.disable(kind)
        self.enabled_kinds = []

    def _flush_forced(self) -> None:
        """Make CUPTI hand over every buffer, full or not (our buffer callbacks run meanwhile)."""
        self._act.flush_all(int(getattr(getattr(self.cupti, "ActivityFlag", None), "FLUSH_FORCED", 1)))

    def _flush_window(self) -> None:
        self._flush_forced()
        self.drain()

    def _window_rows(self) -> dict[Any, tuple[int, int, Any]]:
        """Every aggregate so far: key -> (count, total ns, the stats row)."""
        out = {}
        for st in self.data.kernel_stats():
            key = (st.kind, st.name, st.stack_id, st.graph_key, st.label, st.captured_before_profiling)
            out[key] = (st.count, st.total_ns, st)
        return out

    def _site(self, st: Any) -> str:
        """The call site of a stats row as the window tables show it (cached per stack and graph)."""
        key = (st.stack_id, st.graph_key, st.label)
        site = self._sites.get(key)
        if site is None:
            frames = self.data.stack(st.stack_id)
            site = format_frame(frames[-1] if frames else None)
            if st.graph_key:
                site = f"[graph {st.graph_key}{' ' + st.label if st.label else ''}] {site}"
            self._sites[key] = site
        return site

    def _make_sampler(self, sampling: Sampling) -> Sampler:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"profile(sample=...) takes a graphtree.profile.Sampling, got {type(sampling).__name__}")
        return Sampler(
            sampling,
            enable=self._enable_activity,
            disable=self._disable_activity,
            quiesce=_synchronize_cuda,
            flush=self._flush_window,
            rows=self._window_rows,
            site=self._site,
            note=self.data.notes.append,
        )

    def _register_buffers(self, cupti: Any) -> None:
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
                    self._raw = self._drainer = parser
                    self._raw_backend = self._act = backend
                    self.buffer_path = "libcupti"
                    data.buffer_path = f"libcupti ({getattr(backend, 'path', '?')})"
                    return
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        self._act = _CuptiPythonActivity(cupti)
        self._set_flush_period(self._act)
        self._fast = _FastParser.create(cupti, self.options) if self.options.vectorized else None
        self._drainer = self._fast
        self.buffer_path = "cupti-python"
        data.buffer_path = "cupti-python"

    def _set_flush_period(self, act: Any) -> None:
        if self.options.flush_period_ms > 0 and act.has_flush_period:
            act.flush_period(int(self.options.flush_period_ms))
            self._flush_period_set = True

    def _resolve_ids(
        self, cupti: Any
    ) -> tuple[dict[str, int], dict[tuple[int, int], tuple[str, str]], list[tuple[int, int]], dict[str, int]]:
        dom = cupti.CallbackDomain
        domains = {
            "driver": int(dom.DRIVER_API),
            "runtime": int(dom.RUNTIME_API),
            "resource": int(dom.RESOURCE),
        }
        enums = {"runtime": cupti.runtime_api_trace_cbid, "driver": cupti.driver_api_trace_cbid}
        table: dict[tuple[int, int], tuple[str, str]] = {}
        launch_ids: list[tuple[int, int]] = []
        for d, name, kind in _cbids.LAUNCH_CALLBACKS:
            member = getattr(enums[d], name, None)
            if member is None:  # not in this CUPTI release
                self.missing_callbacks.append(name)
                continue
            key = (domains[d], int(member))
            table[key] = (_cbids.display_name(name), kind)
            launch_ids.append(key)
        resource_ids: dict[str, int] = {}
        for name in _cbids.RESOURCE_CALLBACKS:
            member = getattr(cupti.CallbackIdResource, name, None)
            if member is None:
                self.missing_callbacks.append(name)
                continue
            resource_ids[name] = int(member)
        return domains, table, launch_ids, resource_ids

    def _subscribe(self, cupti: Any) -> None:
        callback = self._make_callback(cupti)
        self._callback = callback  # CUPTI keeps a raw pointer; we keep the object alive
        try:
            try:
                params = cupti.SubscriberParams()
                params.struct_size = cupti.SUBSCRIBER_PARAMS_SIZE
                params.subscriber_name = SUBSCRIBER_NAME
                self._params = params
                self.subscriber = cupti.subscribe_v2(callback, 0, params.ptr)
            except (AttributeError, NotImplementedError):  # no cuptiSubscribe_v2 in this release
                self._params = None
                self.subscriber = cupti.subscribe(callback, 0)
            except Exception as e:
                if _status(e) is not None or "FunctionNotFound" not in type(e).__name__:
                    raise
                self._params = None
                self.subscriber = cupti.subscribe(callback, 0)
        except Exception as e:
            status = _status(e)
            if status == _MULTIPLE_SUBSCRIBERS:
                old = ""
                if self._params is not None:
                    try:
                        raw = self._params.old_subscriber_name
                        old = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
                    except Exception:
                        old = ""
                raise ProfilerBusyError(_busy_message(old.strip("\x00 "))) from e
            if status is not None:
                try:
                    name = cupti.Result(status).name
                except Exception:
                    name = str(status)
                raise ProfilerUnavailableError(f"CUPTI refused the subscription ({name}): {e}") from e
            raise ProfilerUnavailableError(f"CUPTI cannot be used here: {e}") from e

    def _watch_graphtree(self) -> None:
        try:
            from graphtree import _events
        except Exception:
            return
        sink = self.sink

        def begin(name: str = "", node: Any = None, **_: Any) -> None:
            sink.set_label(threading.get_ident(), f"graphtree:{name}" + (f"/{node}" if node is not None else ""))

        def end(**_: Any) -> None:
            sink.set_label(threading.get_ident(), None)

        self._unsubscribe_events = [_events.subscribe("record_begin", begin), _events.subscribe("record_end", end)]

    # ----------------------------------------------------------------------------- callbacks
    def _now(self) -> int:
        try:
            return int(self.cupti.get_timestamp())
        except Exception:
            return 0

    def _make_callback(self, cupti: Any) -> Callable[..., None]:
        sink = self.sink
        data = self.data
        capture = self._capture
        timestamp = cupti.get_timestamp
        get_ident = threading.get_ident
        resource = int(cupti.CallbackDomain.RESOURCE)
        enter = int(cupti.ApiCallbackSite.API_ENTER)
        on_resource = self._on_resource

        def callback(userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
            try:
                if domain == resource:
                    on_resource(cbid, cbdata)
                elif cbdata.callback_site == enter:
                    sink.api_enter(domain, cbid, cbdata.correlation_id, get_ident(), timestamp(), capture)
                else:
                    sink.api_exit(domain, cbid, cbdata.correlation_id, get_ident(), timestamp())
            except BaseException:  # never raise into CUPTI
                data.callback_errors += 1

        return callback

    def _on_resource(self, cbid: int, cbdata: Any) -> None:
        cupti = self.cupti
        ids = self._resource_ids
        gd = _graph_data(cupti, cbdata)
        if gd is None:
            return
        if cbid == ids.get("GRAPHNODE_CREATED"):
            self.sink.node_created(
                _graph_id(cupti, gd.graph),
                _node_id(cupti, gd.node),
                int(gd.node_type),
                threading.get_ident(),
                self._capture,
            )
        elif cbid == ids.get("GRAPHNODE_CLONED"):
            self.sink.node_cloned(_node_id(cupti, gd.node), _node_id(cupti, gd.original_node))
        elif cbid == ids.get("GRAPH_CLONED"):
            self.sink.graph_cloned(_graph_id(cupti, gd.graph), _graph_id(cupti, gd.original_graph))

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
                self._add_pending(items)
                return
        self._buffer_completed_slow(activities)

    def _vectorized_failed(self, e: BaseException) -> None:
        """Note why bulk parsing stopped, and aggregate what it stashed (records keep their order)."""
        self.data.notes.append(f"vectorized record parsing disabled ({type(e).__name__}: {e})")
        self.drain()

    def _add_pending(self, items: list[tuple[int, Any]]) -> None:
        data = self.data
        with data.lock:
            data.buffers_completed += 1
            if not self._pending:
                self._pending_since = data.launch_puts
            self._pending.extend(items)
            self._pending_records += sum(int(a.shape[0]) for _, a in items)
            if (
                self._pending_records >= self.options.defer_records
                or data.launch_puts - self._pending_since >= data.launch_generation // 2
            ):
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
                    self._add_pending(items)
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
        backend = self._raw_backend
        parser = self._drainer
        classes = getattr(parser, "objects", {}) or {}
        offsets = backend.record_offsets(addr, valid)
        objs = []
        lost = 0
        for off in offsets:
            kind = ctypes.c_uint32.from_address(addr + off).value
            cls = classes.get(int(kind))
            if cls is None:
                lost += 1
                continue
            objs.append(cls.from_ptr(addr + off, True))
        _pin(objs)
        if lost:
            self.data.record_errors += lost
        self._buffer_completed_slow(objs)

    @property
    def pending(self) -> bool:
        """Whether records are stashed and not aggregated yet."""
        return bool(self._pending)

    def _resolve_names(self) -> None:
        drainer = self._drainer
        if drainer is not None:
            with self.data.lock:
                drainer.resolve_names(self._pending)

    def drain(self) -> None:
        """Aggregate every stashed record now (records keep their arrival order)."""
        data = self.data
        with data.lock:
            if not self._pending:
                return
            items, self._pending = self._pending, []
            self._pending_records = 0
            drainer = self._drainer
            if drainer is None:  # pragma: no cover - nothing is stashed without a parser
                return
            try:
                for batch in drainer.batches(items):
                    self.sink.record_batch(*batch)
            except Exception as e:
                data.record_errors += sum(int(a.shape[0]) for _, a in items)
                data.notes.append(f"records lost while aggregating ({type(e).__name__}: {e})")

    def _buffer_completed_slow(self, activities: Any) -> None:
        """Per-record reading (cupti-python objects), aggregated per kind in one batch each."""
        data = self.data
        try:
            cupti = self.cupti
            code_of = {int(cupti.ActivityKind.CONCURRENT_KERNEL): KERNEL, int(cupti.ActivityKind.KERNEL): KERNEL}
            code_of[int(cupti.ActivityKind.MEMCPY)] = MEMCPY
            code_of[int(cupti.ActivityKind.MEMSET)] = MEMSET
            memcpy_names = self._memcpy_names
            rows: dict[int, list[tuple[Any, ...]]] = {KERNEL: [], MEMCPY: [], MEMSET: []}
            for a in activities or ():
                try:
                    code = code_of.get(a.kind)
                    if code is None:
                        continue
                    if code == KERNEL:
                        name, nbytes = a.name, 0
                    elif code == MEMCPY:
                        name, nbytes = memcpy_names.get(a.copy_kind, "Memcpy"), a.bytes
                    else:
                        name, nbytes = "Memset", a.bytes
                    row = (name, a.start, a.end, a.device_id, a.stream_id, a.correlation_id)
                    rows[code].append((*row, a.graph_id, a.graph_node_id, nbytes))
                except Exception:
                    data.record_errors += 1
            with data.lock:
                data.buffers_completed += 1
                for code, batch in rows.items():
                    if batch:
                        names = sorted({r[0] for r in batch})
                        index = {n: i for i, n in enumerate(names)}
                        columns = list(zip(*batch))
                        self.sink.record_batch(code, names, [index[n] for n in columns[0]], *columns[1:])
        except Exception:
            data.record_errors += 1

    @functools.cached_property
    def _memcpy_names(self) -> dict[int, str]:
        return _memcpy_names(self.cupti)

    # ----------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Synchronize, flush, disable, unsubscribe (each step runs even if an earlier one failed)."""
        global _ACTIVE
        with _STATE_LOCK:
            if _ACTIVE is not self:
                return
            errors: list[str] = []
            t0 = time.perf_counter()
            _step(errors, "synchronize", _synchronize_cuda)
            if self.sampler is not None:  # closes an open window: its records are kept
                _step(errors, "sampler", self.sampler.stop)
            t_sync = 1e3 * (time.perf_counter() - t0)
            self._teardown(errors)
            self.data.stop_timings["synchronize"] = t_sync
            _ACTIVE = None
            if self._atexit is not None:
                atexit.unregister(self._atexit)
                self._atexit = None
            if errors:
                self.data.notes.append("while stopping: " + "; ".join(errors))

    def _teardown(self, errors: list[str]) -> None:
        cupti = self.cupti
        act = self._act
        timings = self.data.stop_timings
        timings.clear()
        in_callbacks, buffers = self.data.buffer_seconds, self.data.buffers_completed
        if self.enabled_kinds:
            _step(errors, "flush", self._flush_forced, timings)
            timings["flush: buffers"] = self.data.buffers_completed - buffers
            timings["flush: in graphtree's buffer callbacks"] = 1e3 * (self.data.buffer_seconds - in_callbacks)
        for kind in self.enabled_kinds:
            _step(
                errors,
                f"disable activity {kind}",
                lambda: act.disable(kind),  # noqa: B023 - _step calls it at once
                timings,
                "disable",
            )
        if self.enabled_kinds:
            _step(errors, "flush", self._flush_forced, timings, "flush again")
        self.enabled_kinds = []
        # Aggregation waits for the first query (Profile._drain): stop() only reads the kernel
        # names, pointers into CUPTI's memory, while CUPTI is still attached.
        _step(errors, "read kernel names", self._resolve_names, timings)
        if self._flush_period_set:
            _step(errors, "flush period", lambda: act.flush_period(0), timings)
            self._flush_period_set = False
        if self._pool is not None:
            if self._pool.in_flight:  # CUPTI still holds some: never free memory it may write to
                _rawbuf.ORPHANED.append(self._pool)
            self._pool = None
        if self._raw_backend is not None and hasattr(self._raw_backend, "release"):
            self._raw_backend.release()
        ts = self._now()
        if self.subscriber is not None:
            sub = self.subscriber

            def disable_callbacks() -> None:
                for domain, cbid in self.enabled_callbacks:
                    _step(
                        errors,
                        f"disable callback {domain}/{cbid}",
                        lambda: cupti.enable_callback(0, sub, domain, cbid),  # noqa: B023 - _step calls it at once
                    )

            _step(errors, "disable callbacks", disable_callbacks, timings)
            _step(errors, "unsubscribe", lambda: cupti.unsubscribe(sub), timings)
            self.subscriber = None
        self.enabled_callbacks = []
        _step(errors, "dropped records", self._read_dropped, timings)
        if self.options.finalize:
            _step(errors, "finalize", cupti.finalize)
        for unsub in self._unsubscribe_events:
            _step(errors, "graphtree events", unsub)
        self._unsubscribe_events = []
        if self.data.sessions and self.data.sessions[-1][1] == 0 and _ACTIVE is self:
            self.sink.session_stop(ts)

    def _read_dropped(self) -> None:
        """CUPTI's dropped-record counts: the global queue, then each seen stream of the current
        context (when cuda-python can name the context). Each query resets its counter."""
        value = ctypes.c_size_t(0)
        self.cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(value))
        total = int(value.value)
        ctx = _current_context()
        if ctx:
            for stream in sorted(self.data.streams)[:64]:
                value.value = 0
                try:
                    self.cupti.activity_get_num_dropped_records(ctx, int(stream), ctypes.addressof(value))
                    total += int(value.value)
                except Exception:
                    break
        self.sink.dropped(total)

    def _stop_at_exit(self) -> None:
        try:
            self.stop()
        except Exception:
            pass


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


def _current_context() -> int:
    if "cuda.bindings" not in sys.modules and "cuda.bindings.driver" not in sys.modules:
        return 0  # do not import cuda-python just for this
    try:
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        return int(ctx) if int(err) == 0 else 0
    except Exception:
        return 0


def _step(
    errors: list[str], what: str, fn: Callable[[], Any], timings: dict[str, float] | None = None, key: str | None = None
) -> None:
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as e:  # keep tearing down: never leave CUPTI subscribed
        errors.append(f"{what}: {type(e).__name__}: {e}")
    finally:
        if timings is not None:
            k = key or what
            timings[k] = timings.get(k, 0.0) + 1e3 * (time.perf_counter() - t0)


def _graph_data(cupti: Any, cbdata: Any) -> Any:
    if hasattr(cbdata, "node") and hasattr(cbdata, "original_node"):
        return cbdata
    ptr = getattr(cbdata, "resource_descriptor", 0)
    if not ptr:
        return None
    return cupti.GraphData.from_ptr(int(ptr), True)


def _graph_id(cupti: Any, handle: Any) -> int:
    h = int(handle or 0)
    return int(cupti.get_graph_id(h)) if h else 0


def _node_id(cupti: Any, handle: Any) -> int:
    h = int(handle or 0)
    return int(cupti.get_graph_node_id(h)) if h else 0
