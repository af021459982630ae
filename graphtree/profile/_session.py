"""The CUPTI side: one session's start and stop, in order, over its two halves: the callbacks
(``_subscription.py``: the subscription, busy detection) and the activity buffers (``_buffers.py``).

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
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from graphtree.profile._attribution import capture_stack, format_frame, is_user_file
from graphtree.profile._buffers import ActivityBuffers, step
from graphtree.profile._errors import INSTALL_HINT, ProfilerBusyError, ProfilerUnavailableError
from graphtree.profile._model import ProfileData, ProfileOptions
from graphtree.profile._sampling import Sampler, Sampling
from graphtree.profile._subscription import (
    MULTIPLE_SUBSCRIBERS,
    Subscription,
    busy_message,
    guess_other_cupti_users,
    status_of,
)

__all__ = ["Session", "active_session", "guess_other_cupti_users", "load_cupti"]

_STATE_LOCK = threading.Lock()
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
        gpu = _no_gpu()
        needs = (
            "a CUDA GPU and NVIDIA's CUPTI Python bindings; this machine has neither"
            if gpu
            else ("NVIDIA's CUPTI Python bindings")
        )
        raise ProfilerUnavailableError(
            f"graphtree.profile needs {needs}{f' ({gpu})' if gpu else ''}. The bindings (the `cupti` module, "
            f"package cupti-python) cannot be imported ({e}): install them with {INSTALL_HINT} "
            "(pick the cupti-python release that matches your CUDA's CUPTI, e.g. cupti-python 13.0.x "
            "for nvidia-cuda-cupti 13.0)."
        ) from e


def _no_gpu() -> str:
    """Why torch sees no CUDA GPU here, or "" when it sees one."""
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA"
    if not torch.cuda.is_available():
        return "torch finds no CUDA device (no GPU, or no driver)"
    return ""


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
        self.subscription: Subscription | None = None  # the callback side (_subscription.py), once started
        self.buffers: ActivityBuffers | None = None  # the activity side, once subscribed (_buffers.py)
        self.sampler: Sampler | None = None  # sampled mode: opens and closes the tracing windows
        self._sites: dict[Any, str] = {}  # (stack id, graph, label) -> call site text (window tables)
        self._unsubscribe_events: list[Callable[[], None]] = []
        self._capture = functools.partial(capture_stack, data.stacks, options.stack_depth)
        self._atexit: Callable[[], None] | None = None

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
            self.subscription = subscription = Subscription(cupti, self.data, self.sink, self._capture)
            subscription.subscribe()  # (first: another subscriber is found before anything is touched)
            try:
                subscription.enable()
                self.buffers = buffers = ActivityBuffers(cupti, self.data, self.options, self.sink)
                if self.options.sample is None:
                    buffers.enable()
                else:  # sampled: the sampler turns activity on inside windows only
                    self.sampler = self._make_sampler(self.options.sample, buffers)
            except BaseException as e:
                self._teardown([])
                if status_of(e) == MULTIPLE_SUBSCRIBERS:
                    raise ProfilerBusyError(busy_message()) from e
                if isinstance(e, Exception):
                    raise ProfilerUnavailableError(f"CUPTI could not be set up for profiling: {e}") from e
                raise
            self._watch_graphtree()
            self._name_earlier_recordings()
            self.sink.session_start(subscription.now())
            _ACTIVE = self
            self._atexit = self._stop_at_exit
            atexit.register(self._atexit)

    @property
    def pending(self) -> bool:
        """Whether records are stashed and not aggregated yet."""
        return self.buffers is not None and self.buffers.pending

    def drain(self) -> None:
        """Aggregate every stashed record now (records keep their arrival order)."""
        if self.buffers is not None:
            self.buffers.drain()

    # -- the sampler's windows
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

    def _make_sampler(self, sampling: Sampling, buffers: ActivityBuffers) -> Sampler:
        if not isinstance(sampling, Sampling):
            raise TypeError(f"profile(sample=...) takes a graphtree.profile.Sampling, got {type(sampling).__name__}")
        return Sampler(
            sampling,
            enable=buffers.enable,
            disable=buffers.disable,
            quiesce=_synchronize_cuda,
            flush=buffers.flush,
            rows=self._window_rows,
            site=self._site,
            note=self.data.notes.append,
        )

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

    def _name_earlier_recordings(self) -> None:
        """Attribute the nodes of graphtree's recordings made before this profile to the Python
        stacks that made them (``graphtree/tree/sites.py``): CUPTI names a replayed kernel by its
        executable graph's id (high 32 bits of the node id) and its index in the graph (low 32).
        Recordings made while profiling are named by CUPTI's own callbacks, as any capture."""
        if "graphtree.tree.manager" not in sys.modules:
            return  # no recording in this process
        from graphtree.tree import manager

        cupti, sink, stacks = self.cupti, self.sink, self.data.stacks
        thread = -1  # no thread of the process: no launch is open on it
        for tree in manager.managers():
            for node in tree.nodes():
                sink.set_label(thread, f"graphtree:{node.name}/{node.id}")
                for graph, sites in node.graph_sites:
                    if not sites:
                        continue
                    try:
                        exec_id = int(cupti.get_graph_exec_id(graph.raw_cuda_graph_exec()))
                    except Exception:  # a graph not instantiated (or gone): named by its replay, as before
                        continue
                    for first, end, frames in sites:  # (the user's frames, as for any launch)
                        sid = stacks.intern(tuple(f for f in frames if is_user_file(f[0])))
                        for index in range(first, end):
                            sink.node_created(exec_id, (exec_id << 32) | index, 0, thread, lambda sid=sid: sid)
                sink.set_label(thread, None)

    # ----------------------------------------------------------------------------- stop
    def stop(self) -> None:
        """Synchronize, flush, disable, unsubscribe (each step runs even if an earlier one failed)."""
        global _ACTIVE
        with _STATE_LOCK:
            if _ACTIVE is not self:
                return
            errors: list[str] = []
            t0 = time.perf_counter()
            step(errors, "synchronize", _synchronize_cuda)
            if self.sampler is not None:  # closes an open window: its records are kept
                step(errors, "sampler", self.sampler.stop)
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
        timings = self.data.stop_timings
        timings.clear()
        if self.buffers is not None:  # the activity side first, while CUPTI is still attached
            self.buffers.close(errors, timings)
        subscription = self.subscription
        ts = subscription.now() if subscription is not None else 0
        if subscription is not None:
            subscription.close(errors, timings)
        step(errors, "dropped records", self._read_dropped, timings)
        if self.options.finalize:
            step(errors, "finalize", cupti.finalize)
        for unsub in self._unsubscribe_events:
            step(errors, "graphtree events", unsub)
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


def _current_context() -> int:
    if "cuda.bindings" not in sys.modules and "cuda.bindings.driver" not in sys.modules:
        return 0  # do not import cuda-python just for this
    try:
        from cuda.bindings import driver

        err, ctx = driver.cuCtxGetCurrent()
        return int(ctx) if int(err) == 0 else 0
    except Exception:
        return 0
