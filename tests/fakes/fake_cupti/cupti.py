"""A fake of NVIDIA's ``cupti.cupti`` module (cupti-python 13.0.1) for the CPU tests.

It mimics the parts of the API that graphtree.profile uses, with the *real* enum values (copied
by hand from cupti-python 13.0.1, independently of graphtree's own tables), and it behaves like
CUPTI where it matters for correctness tests:

- callbacks are dispatched **only** for the (domain, cbid) pairs a subscriber enabled with
  ``enable_callback`` / ``enable_domain``, so a missing subscription makes a test fail;
- a second subscriber gets ``cuptiError(ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)`` and
  ``subscribe_v2`` reports the first subscriber's name in ``old_subscriber_name``;
- activity records exist only for enabled kinds, go into buffers obtained from the registered
  "buffer requested" callback, and reach the "buffer completed" callback when a buffer is full or
  on ``activity_flush_all``; with no buffer available they are dropped and counted;
- a runtime launch nests the matching driver call, both with callbacks; launches into a capturing
  stream create graph nodes (GRAPHNODE_CREATED inside the launch call) and run nothing;
  instantiation reports each exec node as created, then cloned (GRAPHNODE_CREATED, then
  GRAPHNODE_CLONED, the order seen on an H200), and a graph launch emits one record per node.

The simulation is driven through ``SIM`` (see :class:`Sim`).

Example::

    from fake_cupti import cupti
    cupti.SIM.reset()
    cupti.SIM.launch_kernel("k")
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
from collections.abc import Callable
from typing import Any

__graphtree_profile_internal__ = True  # stacks skip this module's frames


class CallbackDomain(enum.IntEnum):
    INVALID = 0
    DRIVER_API = 1
    RUNTIME_API = 2
    RESOURCE = 3
    SYNCHRONIZE = 4
    NVTX = 5
    STATE = 6
    SIZE = 7


class ApiCallbackSite(enum.IntEnum):
    API_ENTER = 0
    API_EXIT = 1


class CallbackIdResource(enum.IntEnum):
    INVALID = 0
    CONTEXT_CREATED = 1
    CONTEXT_DESTROY_STARTING = 2
    STREAM_CREATED = 3
    STREAM_DESTROY_STARTING = 4
    CU_INIT_FINISHED = 5
    MODULE_LOADED = 6
    MODULE_UNLOAD_STARTING = 7
    MODULE_PROFILED = 8
    GRAPH_CREATED = 9
    GRAPH_DESTROY_STARTING = 10
    GRAPH_CLONED = 11
    GRAPHNODE_CREATE_STARTING = 12
    GRAPHNODE_CREATED = 13
    GRAPHNODE_DESTROY_STARTING = 14
    GRAPHNODE_DEPENDENCY_CREATED = 15
    GRAPHNODE_DEPENDENCY_DESTROY_STARTING = 16
    GRAPHEXEC_CREATE_STARTING = 17
    GRAPHEXEC_CREATED = 18
    GRAPHEXEC_DESTROY_STARTING = 19
    GRAPHNODE_CLONED = 20
    STREAM_ATTRIBUTE_CHANGED = 21
    GRAPH_NODE_UPDATED = 22
    GRAPH_NODE_SET_PARAMS = 23


class ActivityKind(enum.IntEnum):
    INVALID = 0
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    CONCURRENT_KERNEL = 10
    OVERHEAD = 17
    GRAPH_TRACE = 51


class ActivityFlag(enum.IntEnum):
    NONE = 0
    FLUSH_FORCED = 1


class ActivityMemcpyKind(enum.IntEnum):
    UNKNOWN = 0
    HTOD = 1
    DTOH = 2
    HTOA = 3
    ATOH = 4
    ATOA = 5
    ATOD = 6
    DTOA = 7
    DTOD = 8
    HTOH = 9
    PTOP = 10


class Result(enum.IntEnum):
    SUCCESS = 0
    ERROR_INVALID_PARAMETER = 1
    ERROR_INVALID_OPERATION = 7
    ERROR_NOT_INITIALIZED = 15
    ERROR_INSUFFICIENT_PRIVILEGES = 35
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39
    ERROR_UNKNOWN = 999


# Values as in cupti-python 13.0.1's enums (a subset).
runtime_api_trace_cbid = enum.IntEnum(
    "runtime_api_trace_cbid",
    {
        "cudaLaunch_v3020": 13,
        "cudaMemcpyAsync_v3020": 41,
        "cudaLaunchKernel_v7000": 211,
        "cudaLaunch_ptsz_v7000": 213,
        "cudaLaunchKernel_ptsz_v7000": 214,
        "cudaLaunchCooperativeKernel_v9000": 269,
        "cudaLaunchCooperativeKernel_ptsz_v9000": 270,
        "cudaLaunchHostFunc_v10000": 284,
        "cudaGraphInstantiate_v10000": 310,
        "cudaGraphLaunch_v10000": 311,
        "cudaGraphLaunch_ptsz_v10000": 312,
        "cudaStreamBeginCapture_v10000": 315,
        "cudaStreamBeginCapture_ptsz_v10000": 316,
        "cudaStreamEndCapture_v10000": 319,
        "cudaStreamEndCapture_ptsz_v10000": 320,
        "cudaGraphInstantiateWithFlags_v11040": 418,
        "cudaLaunchKernelExC_v11060": 430,
        "cudaLaunchKernelExC_ptsz_v11060": 431,
        "cudaStreamBeginCaptureToGraph_v12030": 452,
        "cudaStreamBeginCaptureToGraph_ptsz_v12030": 453,
    },
)

driver_api_trace_cbid = enum.IntEnum(
    "driver_api_trace_cbid",
    {
        "cuMemcpyHtoDAsync_v2": 277,
        "cuMemcpyDtoDAsync_v2": 281,
        "cuLaunchKernel": 307,
        "cuLaunchKernel_ptsz": 442,
        "cuLaunchCooperativeKernel": 477,
        "cuLaunchCooperativeKernel_ptsz": 478,
        "cuStreamBeginCapture": 495,
        "cuStreamBeginCapture_ptsz": 496,
        "cuStreamEndCapture": 497,
        "cuStreamEndCapture_ptsz": 498,
        "cuGraphInstantiate": 513,
        "cuGraphLaunch": 514,
        "cuGraphLaunch_ptsz": 515,
        "cuLaunchHostFunc": 527,
        "cuStreamBeginCapture_v2": 539,
        "cuStreamBeginCapture_v2_ptsz": 540,
        "cuGraphInstantiateWithFlags": 643,
        "cuLaunchKernelEx": 652,
        "cuLaunchKernelEx_ptsz": 653,
        "cuStreamBeginCaptureToGraph": 720,
        "cuStreamBeginCaptureToGraph_ptsz": 721,
    },
)

SUBSCRIBER_PARAMS_SIZE = 32
SUBSCRIBER_NAME_MAX_LEN = 53

# runtime API -> the driver API it calls (and so nests)
_NESTED = {
    "cudaLaunchKernel_v7000": "cuLaunchKernel",
    "cudaLaunchKernel_ptsz_v7000": "cuLaunchKernel_ptsz",
    "cudaLaunchKernelExC_v11060": "cuLaunchKernelEx",
    "cudaLaunchKernelExC_ptsz_v11060": "cuLaunchKernelEx_ptsz",
    "cudaLaunchCooperativeKernel_v9000": "cuLaunchCooperativeKernel",
    "cudaLaunchCooperativeKernel_ptsz_v9000": "cuLaunchCooperativeKernel_ptsz",
    "cudaGraphLaunch_v10000": "cuGraphLaunch",
    "cudaGraphLaunch_ptsz_v10000": "cuGraphLaunch_ptsz",
    "cudaStreamBeginCapture_v10000": "cuStreamBeginCapture_v2",
    "cudaStreamBeginCapture_ptsz_v10000": "cuStreamBeginCapture_v2_ptsz",
    "cudaStreamEndCapture_v10000": "cuStreamEndCapture",
    "cudaStreamEndCapture_ptsz_v10000": "cuStreamEndCapture_ptsz",
    "cudaGraphInstantiate_v10000": "cuGraphInstantiateWithFlags",
    "cudaMemcpyAsync_v3020": "cuMemcpyHtoDAsync_v2",
}


class cuptiError(Exception):
    """Like cupti-python's: ``status`` is the CUPTI result code."""

    def __init__(self, status: int) -> None:
        self.status = int(status)
        try:
            name = Result(status).name
        except ValueError:
            name = str(status)
        super().__init__(f"{name} ({int(status)})")


# ----------------------------------------------------------------------------- data objects
_POINTERS: dict[int, Any] = {}
_RECORDS_AT: dict[int, Any] = {}  # address -> record object, for the raw buffer in delivery
_ptr_counter = itertools.count(0x10000, 0x40)


def _register(obj: Any) -> int:
    ptr = next(_ptr_counter)
    _POINTERS[ptr] = obj
    return ptr


class SubscriberParams:
    def __init__(self) -> None:
        self.struct_size = 0
        self.subscriber_name = ""
        self.old_subscriber_name = ""
        self.ptr = _register(self)


class CallbackData:
    def __init__(self, site: int, corr: int, function_name: str) -> None:
        self.callback_site = site
        self.correlation_id = corr
        self.function_name = function_name
        self.context = 0x1
        self.context_uid = 1
        self.correlation_data = 0
        self.function_return_value = 0
        self.symbol_name = ""


class ResourceData:
    def __init__(self, descriptor: int) -> None:
        self.context = 0x1
        self.resource_descriptor = descriptor


class GraphData:
    def __init__(
        self,
        graph: int = 0,
        node: int = 0,
        node_type: int = 0,
        original_node: int = 0,
        original_graph: int = 0,
        graph_exec: int = 0,
        dependency: int = 0,
    ) -> None:
        self.graph = graph
        self.node = node
        self.node_type = node_type
        self.original_node = original_node
        self.original_graph = original_graph
        self.graph_exec = graph_exec
        self.dependency = dependency
        self.ptr = _register(self)

    @staticmethod
    def from_ptr(ptr: int, readonly: bool = False) -> GraphData:
        obj = _POINTERS.get(int(ptr))
        if not isinstance(obj, GraphData):
            raise cuptiError(Result.ERROR_INVALID_PARAMETER)
        return obj


class _FakeRecord:
    """Base of the fake activity record classes."""

    @classmethod
    def from_ptr(cls, ptr: int, readonly: bool = False, owner: Any = None) -> Any:
        """The record at ``ptr`` (as cupti-python builds it from memory; the fake returns the
        values it meant to write, so a corrupted layout shows)."""
        obj = _RECORDS_AT.get(int(ptr))
        if not isinstance(obj, cls):
            raise cuptiError(Result.ERROR_INVALID_PARAMETER)
        return obj


class ActivityKernel10(_FakeRecord):
    def __init__(self, **kw: Any) -> None:
        self.kind = int(ActivityKind.CONCURRENT_KERNEL)
        self.context_id = 1
        self.__dict__.update(kw)


class ActivityMemcpy6(_FakeRecord):
    def __init__(self, **kw: Any) -> None:
        self.kind = int(ActivityKind.MEMCPY)
        self.context_id = 1
        self.runtime_correlation_id = 0
        self.__dict__.update(kw)


class ActivityMemset4(_FakeRecord):
    def __init__(self, **kw: Any) -> None:
        self.kind = int(ActivityKind.MEMSET)
        self.context_id = 1
        self.value = 0
        self.__dict__.update(kw)


def _dtype(itemsize: int, fields: dict[str, tuple[str, int]]) -> Any:
    import numpy as np

    names = list(fields)
    return np.dtype(
        {
            "names": names,
            "formats": [fields[n][0] for n in names],
            "offsets": [fields[n][1] for n in names],
            "itemsize": itemsize,
        }
    )


# The layouts of cupti-python 13.0.1's dtypes (offsets copied from it), reduced to what is used.
try:
    activity_kernel10_dtype = _dtype(
        216,
        {
            "kind": ("<i4", 0),
            "start": ("<u8", 16),
            "end": ("<u8", 24),
            "device_id": ("<u4", 40),
            "context_id": ("<u4", 44),
            "stream_id": ("<u4", 48),
            "correlation_id": ("<u4", 92),
            "name": ("<i8", 104),
            "graph_node_id": ("<u8", 144),
            "graph_id": ("<u4", 156),
        },
    )
    activity_memcpy6_dtype = _dtype(
        96,
        {
            "kind": ("<i4", 0),
            "copy_kind": ("u1", 4),
            "bytes": ("<u8", 8),
            "start": ("<u8", 16),
            "end": ("<u8", 24),
            "device_id": ("<u4", 32),
            "context_id": ("<u4", 36),
            "stream_id": ("<u4", 40),
            "correlation_id": ("<u4", 44),
            "runtime_correlation_id": ("<u4", 48),
            "graph_node_id": ("<u8", 64),
            "graph_id": ("<u4", 72),
        },
    )
    activity_memset4_dtype = _dtype(
        88,
        {
            "kind": ("<i4", 0),
            "value": ("<u4", 4),
            "bytes": ("<u8", 8),
            "start": ("<u8", 16),
            "end": ("<u8", 24),
            "device_id": ("<u4", 32),
            "context_id": ("<u4", 36),
            "stream_id": ("<u4", 40),
            "correlation_id": ("<u4", 44),
            "graph_node_id": ("<u8", 64),
            "graph_id": ("<u4", 72),
        },
    )
except ImportError:  # no numpy: the profiler uses its per-record path
    pass

_RECORD_DTYPE_NAMES = {
    ActivityKernel10: "activity_kernel10_dtype",
    ActivityMemcpy6: "activity_memcpy6_dtype",
    ActivityMemset4: "activity_memset4_dtype",
}
_RECORD_BYTES = {ActivityKernel10: 216, ActivityMemcpy6: 96, ActivityMemset4: 88}
_NAME_BUFFERS: dict[str, Any] = {}


def _name_ptr(name: str) -> int:
    buf = _NAME_BUFFERS.get(name)
    if buf is None:
        buf = _NAME_BUFFERS[name] = ctypes.create_string_buffer(name.encode())
    return ctypes.addressof(buf)


def _write_record(rec: Any, address: int, corrupt: bool) -> None:
    """Lay ``rec`` out at ``address`` exactly as CUPTI would (so ``rec.ptr`` points at it)."""
    dt = globals().get(_RECORD_DTYPE_NAMES[type(rec)])
    if dt is None:
        return
    import numpy as np

    arr = np.zeros(1, dtype=dt)
    for f in dt.names:
        if f == "name":
            arr[f] = _name_ptr(rec.name)
        elif hasattr(rec, f):
            arr[f] = getattr(rec, f)
    if corrupt:
        arr["start"] = 12345
    ctypes.memmove(address, arr.ctypes.data, dt.itemsize)


# ----------------------------------------------------------------------------- simulation
class _Subscriber:
    def __init__(self, handle: int, callback: Callable[..., None], userdata: Any, name: str) -> None:
        self.handle = handle
        self.callback = callback
        self.userdata = userdata
        self.name = name
        self.enabled: set[tuple[int, int]] = set()
        self.domains: set[int] = set()


class FakeNode:
    def __init__(self, sim: Sim, kind: str, name: str, duration: int, node_type: int, graph: FakeGraph) -> None:
        # as CUPTI reports them on an H100 (driver 580, benchmarks/cupti_graph_ids.py): a node's id is
        # its graph's id in the high 32 bits and its index in the graph (creation order) in the low
        self.id = (graph.id << 32) | len(graph.nodes)
        self.handle = sim._handle(self)
        self.kind = kind
        self.name = name
        self.duration = duration
        self.node_type = node_type
        self.graph = graph
        self.nbytes = 0


class FakeGraph:
    def __init__(self, sim: Sim) -> None:
        self.id = next(sim._graph_ids)
        self.handle = sim._handle(self)
        self.nodes: list[FakeNode] = []


class FakeExec:
    def __init__(self, sim: Sim, original: FakeGraph) -> None:
        self.graph = FakeGraph(sim)  # the instantiated copy, with cloned nodes
        self.id = self.graph.id  # an exec graph's id is its graph's (graph and exec ids share one counter)
        self.handle = sim._handle(self)
        self.original = original
        self.clones: list[tuple[FakeNode, FakeNode]] = []


class Sim:
    """The simulated process: CUPTI state plus a GPU that runs launches instantly.

    Knobs (set after ``reset()``):

    - ``share_correlation``: a nested driver call reuses the runtime call's correlation id
      (default False: separate ids, kernels carry the id chosen below);
    - ``eager_record_corr`` / ``graph_record_corr``: ``"runtime"`` or ``"driver"``: which call's
      correlation id the records of an eager launch / graph launch carry;
    - ``record_node_ids``: ``"clone"`` (records carry the executable graph's node ids) or
      ``"original"``; ``record_graph_ids``: ``"exec"`` or ``"original"``.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.lock = threading.RLock()
        self.subscriber: _Subscriber | None = None
        self.other_subscriber: str | None = None
        self.enabled_kinds: set[int] = set()
        self.buffer_requested: Callable[..., Any] | None = None
        self.buffer_completed: Callable[..., Any] | None = None
        self.buffer: list[Any] | None = None
        self.buffer_size = 0
        self.buffer_used = 0
        self.buffers_requested = 0
        self.buffers_delivered = 0
        self.dropped = 0
        self.flush_period = 0
        self.finalized = 0
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.dispatched: list[tuple[int, int, int]] = []  # (domain, cbid, site) actually delivered
        self.capturing: dict[int, FakeGraph] = {}
        self.cpu_clock = 1_000_000
        self.gpu_clock = 2_000_000
        self.share_correlation = False
        self.eager_record_corr = "runtime"
        self.graph_record_corr = "driver"
        self.record_node_ids = "clone"
        self.record_graph_ids = "exec"
        self.corrupt_layout = False  # write wrong bytes: the profiler must notice and fall back
        # raw mode (libcupti's callbacks through ctypes, see FakeLibcupti): request() -> (address,
        # size); complete(address, size, valid_size)
        self.raw_request: Callable[[], tuple[int, int]] | None = None
        self.raw_complete: Callable[[int, int, int], None] | None = None
        self.raw_offsets: dict[int, list[int]] = {}  # address of a delivered buffer -> record offsets
        self.raw_records: list[Any] = []  # records of the current raw buffer
        self.raw_buffers_outstanding: set[int] = set()
        self._memory: list[Any] = []  # activity buffers (kept alive while records point into them)
        self._buffer_address = 0
        self._corr = itertools.count(1)
        self._sub_handles = itertools.count(0xA000)
        self._graph_ids = itertools.count(1)
        self._handles: dict[int, Any] = {}
        self._handle_counter = itertools.count(0x7F0000001000, 0x100)

    # -- helpers
    def _handle(self, obj: Any) -> int:
        h = next(self._handle_counter)
        self._handles[h] = obj
        return h

    def obj(self, handle: int) -> Any:
        return self._handles[int(handle)]

    def enabled(self, domain: int, cbid: int) -> bool:
        s = self.subscriber
        return s is not None and ((domain, cbid) in s.enabled or domain in s.domains)

    def enabled_pairs(self) -> set[tuple[int, int]]:
        return set(self.subscriber.enabled) if self.subscriber else set()

    def _dispatch(self, domain: int, cbid: int, cbdata: Any, site: int = -1) -> None:
        s = self.subscriber
        if s is not None and ((domain, cbid) in s.enabled or domain in s.domains):
            self.dispatched.append((int(domain), int(cbid), site))
            s.callback(s.userdata, int(domain), int(cbid), cbdata)

    def _api(self, domain: int, name: str, site: int, corr: int) -> None:
        enum_ = runtime_api_trace_cbid if domain == CallbackDomain.RUNTIME_API else driver_api_trace_cbid
        cbid = int(enum_[name])
        self._dispatch(int(domain), cbid, CallbackData(site, corr, name), site)

    def _resource(self, cbid: CallbackIdResource, gd: GraphData) -> None:
        self._dispatch(int(CallbackDomain.RESOURCE), int(cbid), ResourceData(gd.ptr))

    def _call(self, api: str, inner: Callable[[], None], with_runtime: bool | None = None) -> tuple[int, int]:
        """Run API ``api`` (runtime name, or driver-only name) with its nested driver call."""
        runtime = api in runtime_api_trace_cbid.__members__ if with_runtime is None else with_runtime
        rt_corr = next(self._corr) if runtime else 0
        drv_name = _NESTED.get(api, api) if runtime else api
        drv_corr = rt_corr if (runtime and self.share_correlation) else next(self._corr)
        if runtime:
            self._api(CallbackDomain.RUNTIME_API, api, ApiCallbackSite.API_ENTER, rt_corr)
        self._api(CallbackDomain.DRIVER_API, drv_name, ApiCallbackSite.API_ENTER, drv_corr)
        inner()
        self._api(CallbackDomain.DRIVER_API, drv_name, ApiCallbackSite.API_EXIT, drv_corr)
        if runtime:
            self._api(CallbackDomain.RUNTIME_API, api, ApiCallbackSite.API_EXIT, rt_corr)
        return rt_corr, drv_corr

    def _now(self) -> int:
        self.cpu_clock += 10
        return self.cpu_clock

    # -- activity
    def _emit(self, rec: Any) -> None:
        kind = rec.kind
        enabled = kind in self.enabled_kinds or (
            kind == ActivityKind.CONCURRENT_KERNEL and int(ActivityKind.KERNEL) in self.enabled_kinds
        )
        if not enabled:
            return
        size = _RECORD_BYTES[type(rec)]
        if self.buffer is not None and self.buffer_used + size > self.buffer_size:
            self._complete()
        if self.buffer is None and self.raw_request is not None:
            addr, got_size = self.raw_request()
            self.buffers_requested += 1
            if not addr or int(got_size) < size:
                self.dropped += 1
                return
            self.buffer = []
            self.buffer_used = 0
            self.buffer_size = int(got_size)
            self._buffer_address = int(addr)
            self.raw_buffers_outstanding.add(int(addr))
        if self.buffer is None:
            if self.buffer_requested is None:
                self.dropped += 1
                return
            got = self.buffer_requested()
            self.buffers_requested += 1
            self.buffer_size = int(got[0])
            if self.buffer_size < size:
                self.dropped += 1
                return
            self.buffer = []
            self.buffer_used = 0
            mem = ctypes.create_string_buffer(self.buffer_size)
            self._memory.append(mem)
            if len(self._memory) > 64:
                del self._memory[:32]
            self._buffer_address = ctypes.addressof(mem)
        rec.ptr = self._buffer_address + self.buffer_used
        _write_record(rec, rec.ptr, self.corrupt_layout)
        self.buffer.append(rec)
        self.buffer_used += size

    def _complete(self) -> None:
        buf, self.buffer = self.buffer, None
        used, self.buffer_used = self.buffer_used, 0
        if buf is not None and self.raw_complete is not None:
            addr = self._buffer_address
            self.raw_offsets[addr] = [r.ptr - addr for r in buf]
            for r in buf:
                _RECORDS_AT[r.ptr] = r
            self.buffers_delivered += 1
            self.raw_buffers_outstanding.discard(addr)
            try:
                self.raw_complete(addr, self.buffer_size, used)
            finally:
                for r in buf:
                    _RECORDS_AT.pop(r.ptr, None)
                self.raw_offsets.pop(addr, None)
            return
        if buf is not None and self.buffer_completed is not None:
            self.buffers_delivered += 1
            self.buffer_completed(buf)

    def _run(self, duration: int) -> tuple[int, int]:
        start = self.gpu_clock
        end = start + duration
        self.gpu_clock = end + 50
        return start, end

    def _node_record(self, node: FakeNode, corr: int, stream: int, graph_id: int, node_id: int) -> Any:
        start, end = self._run(node.duration)
        common = dict(
            start=start,
            end=end,
            device_id=0,
            stream_id=stream,
            correlation_id=corr,
            graph_id=graph_id,
            graph_node_id=node_id,
        )
        if node.kind == "memcpy":
            return ActivityMemcpy6(copy_kind=int(ActivityMemcpyKind.DTOD), bytes=node.nbytes, **common)
        if node.kind == "memset":
            return ActivityMemset4(bytes=node.nbytes, memory_kind=0, **common)
        return ActivityKernel10(name=node.name, **common)

    # -- what tests drive
    def launch_kernel(
        self, name: str, api: str = "cudaLaunchKernel_v7000", stream: int = 7, duration: int = 1000
    ) -> tuple[int, int]:
        """Launch one kernel (or capture it, when ``stream`` is capturing); returns (rt, drv) corr."""
        graph = self.capturing.get(stream)

        def inner() -> None:
            if graph is not None:
                node = FakeNode(self, "kernel", name, duration, 0, graph)
                graph.nodes.append(node)
                self._resource(
                    CallbackIdResource.GRAPHNODE_CREATED, GraphData(graph=graph.handle, node=node.handle, node_type=0)
                )

        rt, drv = self._call(api, inner)
        if graph is None:
            corr = rt if (rt and self.eager_record_corr == "runtime") else drv
            start, end = self._run(duration)
            self._emit(
                ActivityKernel10(
                    name=name,
                    start=start,
                    end=end,
                    device_id=0,
                    stream_id=stream,
                    correlation_id=corr,
                    graph_id=0,
                    graph_node_id=0,
                )
            )
        return rt, drv

    def memcpy(self, nbytes: int = 4096, kind: str = "HTOD", stream: int = 7, duration: int = 500) -> None:
        """An async memcpy (its API is not one the profiler subscribes to)."""
        graph = self.capturing.get(stream)

        def inner() -> None:
            if graph is not None:
                node = FakeNode(self, "memcpy", "memcpy", duration, 1, graph)
                node.nbytes = nbytes
                graph.nodes.append(node)
                self._resource(
                    CallbackIdResource.GRAPHNODE_CREATED, GraphData(graph=graph.handle, node=node.handle, node_type=1)
                )

        rt, drv = self._call("cudaMemcpyAsync_v3020", inner)
        if graph is None:
            start, end = self._run(duration)
            self._emit(
                ActivityMemcpy6(
                    copy_kind=int(ActivityMemcpyKind[kind]),
                    bytes=nbytes,
                    start=start,
                    end=end,
                    device_id=0,
                    stream_id=stream,
                    correlation_id=drv,
                    runtime_correlation_id=rt,
                    graph_id=0,
                    graph_node_id=0,
                )
            )

    def memset(self, nbytes: int = 4096, stream: int = 7, duration: int = 300) -> None:
        """An eager memset (no subscribed API)."""
        start, end = self._run(duration)
        self._emit(
            ActivityMemset4(
                bytes=nbytes,
                start=start,
                end=end,
                device_id=0,
                stream_id=stream,
                correlation_id=next(self._corr),
                graph_id=0,
                graph_node_id=0,
                memory_kind=0,
            )
        )

    def begin_capture(self, stream: int = 7) -> None:
        graph = FakeGraph(self)

        def inner() -> None:
            self.capturing[stream] = graph
            self._resource(CallbackIdResource.GRAPH_CREATED, GraphData(graph=graph.handle))

        self._call("cudaStreamBeginCapture_v10000", inner)

    def end_capture(self, stream: int = 7) -> FakeGraph:
        graph = self.capturing[stream]

        def inner() -> None:
            del self.capturing[stream]

        self._call("cudaStreamEndCapture_v10000", inner)
        return graph

    def instantiate(self, graph: FakeGraph) -> FakeExec:
        exe = FakeExec(self, graph)

        def inner() -> None:
            self._resource(
                CallbackIdResource.GRAPH_CLONED, GraphData(graph=exe.graph.handle, original_graph=graph.handle)
            )
            for node in graph.nodes:
                clone = FakeNode(self, node.kind, node.name, node.duration, node.node_type, exe.graph)
                clone.nbytes = node.nbytes
                exe.graph.nodes.append(clone)
                exe.clones.append((clone, node))
                # as recorded on an H200 (CUDA 13.0): the exec graph's node is first reported as
                # CREATED (outside any launch call, so with the instantiate call's stack), then CLONED
                self._resource(
                    CallbackIdResource.GRAPHNODE_CREATED,
                    GraphData(graph=exe.graph.handle, node=clone.handle, node_type=node.node_type),
                )
                self._resource(
                    CallbackIdResource.GRAPHNODE_CLONED,
                    GraphData(
                        graph=exe.graph.handle, node=clone.handle, original_node=node.handle, node_type=node.node_type
                    ),
                )
            self._resource(CallbackIdResource.GRAPHEXEC_CREATED, GraphData(graph=graph.handle, graph_exec=exe.handle))

        self._call("cudaGraphInstantiate_v10000", inner)
        return exe

    def capture(self, fn: Callable[[], None], stream: int = 7) -> FakeExec:
        """Capture ``fn`` (which launches on ``stream``) and instantiate it."""
        self.begin_capture(stream)
        fn()
        return self.instantiate(self.end_capture(stream))

    def graph_launch(self, exe: FakeExec, api: str = "cudaGraphLaunch_v10000", stream: int = 7) -> tuple[int, int]:
        """Launch an executable graph through ``api`` (runtime or driver name)."""
        rt, drv = self._call(api, lambda: None)
        corr = rt if (rt and self.graph_record_corr == "runtime") else drv
        graph_id = exe.graph.id if self.record_graph_ids == "exec" else exe.original.id
        for clone, original in exe.clones:
            node_id = clone.id if self.record_node_ids == "clone" else original.id
            self._emit(self._node_record(clone, corr, stream, graph_id, node_id))
        return rt, drv


SIM = Sim()


def _log(name: str, *args: Any) -> None:
    SIM.calls.append((name, args))


# ----------------------------------------------------------------------------- the API
def subscribe(callback: Callable[..., None], userdata: Any) -> int:
    _log("subscribe")
    return _subscribe(callback, userdata, "", None)


def subscribe_v2(callback: Callable[..., None], userdata: Any, p_params: int) -> int:
    _log("subscribe_v2")
    params = _POINTERS.get(int(p_params)) if p_params else None
    name = getattr(params, "subscriber_name", "") or ""
    return _subscribe(callback, userdata, name, params)


def _subscribe(callback: Callable[..., None], userdata: Any, name: str, params: Any) -> int:
    holder = SIM.subscriber.name if SIM.subscriber is not None else SIM.other_subscriber
    if SIM.subscriber is not None or SIM.other_subscriber is not None:
        if params is not None:
            params.old_subscriber_name = holder or ""
        raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
    handle = next(SIM._sub_handles)
    SIM.subscriber = _Subscriber(handle, callback, userdata, name)
    return handle


def _check_sub(subscriber: int) -> _Subscriber:
    s = SIM.subscriber
    if s is None or s.handle != subscriber:
        raise cuptiError(Result.ERROR_INVALID_PARAMETER)
    return s


def unsubscribe(subscriber: int) -> None:
    _log("unsubscribe", subscriber)
    _check_sub(subscriber)
    SIM.subscriber = None


def enable_callback(enable: int, subscriber: int, domain: int, cbid: int) -> None:
    _log("enable_callback", enable, int(domain), int(cbid))
    s = _check_sub(subscriber)
    if enable:
        s.enabled.add((int(domain), int(cbid)))
    else:
        s.enabled.discard((int(domain), int(cbid)))


def enable_domain(enable: int, subscriber: int, domain: int) -> None:
    _log("enable_domain", enable, int(domain))
    s = _check_sub(subscriber)
    if enable:
        s.domains.add(int(domain))
    else:
        s.domains.discard(int(domain))


def enable_all_domains(enable: int, subscriber: int) -> None:
    for d in (1, 2, 3, 4, 5, 6):
        enable_domain(enable, subscriber, d)


def get_callback_state(subscriber: int, domain: int, cbid: int) -> int:
    return int(SIM.enabled(int(domain), int(cbid)))


def activity_enable(kind: int) -> None:
    _log("activity_enable", int(kind))
    SIM.enabled_kinds.add(int(kind))


def activity_disable(kind: int) -> None:
    _log("activity_disable", int(kind))
    SIM.enabled_kinds.discard(int(kind))


def activity_register_callbacks(
    func_buffer_requested: Callable[..., Any], func_buffer_completed: Callable[..., Any]
) -> None:
    _log("activity_register_callbacks")
    SIM.buffer_requested = func_buffer_requested
    SIM.buffer_completed = func_buffer_completed
    SIM.raw_request = SIM.raw_complete = None


class FakeLibcupti:
    """libcupti's activity-buffer API as graphtree.profile's ``_rawbuf.LibcuptiBuffers`` wraps
    it (the raw path): the same process-wide CUPTI state as the cupti-python functions above, so
    registering here replaces cupti-python's buffer callbacks and vice versa. Records are written
    into the caller's buffers with the real layouts; ``record_offsets`` answers like
    ``cuptiActivityGetNextRecord`` from what was written (independently of any parsing)."""

    path = "<fake libcupti>"
    mapped: tuple[str, ...] = ()  # what the real backend reports it mapped: nothing here

    def register(self, request: Callable[[], tuple[int, int]], complete: Callable[[int, int, int], None]) -> None:
        _log("activity_register_callbacks")
        SIM.raw_request, SIM.raw_complete = request, complete
        SIM.buffer_requested = SIM.buffer_completed = None

    def release(self) -> None:
        pass

    has_flush_period = True

    def enable(self, kind: int) -> None:
        activity_enable(kind)

    def disable(self, kind: int) -> None:
        activity_disable(kind)

    def flush_all(self, flag: int) -> None:
        activity_flush_all(flag)

    def flush_period(self, ms: int) -> None:
        activity_flush_period(ms)

    def record_offsets(self, addr: int, valid: int, limit: int | None = None) -> list[int]:
        offs = [o for o in SIM.raw_offsets.get(int(addr), []) if o < valid]
        return offs if limit is None else offs[:limit]


LIBCUPTI = FakeLibcupti()


def activity_flush_all(flag: int) -> None:
    _log("activity_flush_all", int(flag))
    if SIM.buffer is not None and (SIM.buffer or int(flag)):
        SIM._complete()


def activity_flush_period(time: int) -> None:
    _log("activity_flush_period", int(time))
    SIM.flush_period = int(time)


def activity_get_num_dropped_records(context: int, stream_id: int, dropped: int) -> None:
    _log("activity_get_num_dropped_records", context, stream_id)
    ctypes.c_size_t.from_address(int(dropped)).value = SIM.dropped
    SIM.dropped = 0


def get_timestamp() -> int:
    return SIM._now()


def get_graph_id(graph: int) -> int:
    return SIM.obj(graph).id


def get_graph_node_id(node: int) -> int:
    return SIM.obj(node).id


def get_graph_exec_id(graph_exec: int) -> int:
    return SIM.obj(graph_exec).id


def get_callback_name(domain: int, cbid: int) -> str:
    enum_ = runtime_api_trace_cbid if int(domain) == CallbackDomain.RUNTIME_API else driver_api_trace_cbid
    return enum_(int(cbid)).name


def get_last_error() -> int:
    return 0


def finalize() -> None:
    _log("finalize")
    SIM.finalized += 1
