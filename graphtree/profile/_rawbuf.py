"""CUPTI activity buffers straight from libcupti (ctypes): raw bytes, no Python object per record.

cupti-python hands every completed buffer over as a list of Python objects, one per record, built
in CUPTI's thread while it holds the GIL (the replay loop waits). Here the buffer callbacks are
registered with libcupti directly (``cuptiActivityRegisterCallbacks`` with ``ctypes.CFUNCTYPE``
callbacks): the "requested" callback hands out a buffer from a small bounded pool, the "completed"
callback gets ``(address, size, valid_size)`` and the session copies the records' fields out with
numpy (see ``_parse._RawParser``) before the buffer goes back to the pool.

The library is the one cupti-python loaded (found in ``/proc/self/maps`` after a call into
cupti-python), so both talk to one CUPTI instance; fallbacks: the ``nvidia`` wheel's
``cu*/lib/libcupti.so*`` / ``cuda_cupti/lib/libcupti.so*``, then ``ctypes.util.find_library``.

Activity enable/disable/flush/flush period go through the same ctypes handle (a ctypes call
releases the GIL, so CUPTI's worker thread can run our "completed" callback while ``flush`` waits).

Tests inject a fake through :data:`BACKEND_FACTORY`.

Example::

    backend = open_backend(cupti)          # LibcuptiBuffers, or raises RawBuffersUnavailable
    backend.register(request, complete)    # request() -> (address, size); complete(address, size, valid)
    backend.enable(10); ...; backend.flush_all(1); backend.disable(10)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND_FACTORY", "BufferPool", "LibcuptiBuffers", "RawBuffersUnavailable", "find_libcupti", "open_backend"]

_SUCCESS = 0
_MAX_LIMIT_REACHED = 12  # CUPTI_ERROR_MAX_LIMIT_REACHED: the end of a buffer's records
_ALIGN = 8  # ACTIVITY_RECORD_ALIGNMENT

_REQUEST = ctypes.CFUNCTYPE(
    None, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)
)
_COMPLETE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)

# ``Callable[[cupti module], backend]`` used instead of :func:`open_libcupti` (tests: the fake).
BACKEND_FACTORY: Callable[[Any], Any] | None = None
_BACKENDS: dict[str, LibcuptiBuffers] = {}
_LOCK = threading.Lock()


class RawBuffersUnavailable(Exception):
    """libcupti cannot be used directly here (not found, or symbols missing)."""


class RawCuptiError(Exception):
    """A libcupti call through ctypes returned ``status`` (a ``CUptiResult``)."""

    def __init__(self, what: str, status: int) -> None:
        self.status = int(status)
        super().__init__(f"{what} returned CUptiResult {int(status)}")


def _mapped_libcupti() -> list[str]:
    out: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6:
                    path = parts[5].strip()
                    if os.path.basename(path).startswith("libcupti.so") and path not in out:
                        out.append(path)
    except OSError:
        pass
    return out


def find_libcupti(cupti: Any = None) -> tuple[str | None, list[str]]:
    """``(path, mapped)``: the libcupti cupti-python uses, and every libcupti mapped in the process.

    A cheap call into cupti-python first makes sure it has loaded its library (its bindings load
    lazily), then ``/proc/self/maps`` tells which file it is.
    """
    if cupti is not None:
        for fn in ("get_version", "get_timestamp"):
            try:
                getattr(cupti, fn)()
                break
            except Exception:
                continue
    mapped = _mapped_libcupti()
    if mapped:
        return mapped[0], mapped
    cands: list[str] = []
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels

        for root in list(getattr(nvidia, "__path__", [])):
            for pat in ("cu*/lib/libcupti.so*", "cuda_cupti/lib/libcupti.so*"):
                cands += sorted(glob.glob(os.path.join(root, pat)))
    except Exception:
        pass
    if cands:
        return cands[0], mapped
    found = ctypes.util.find_library("cupti")
    return found, mapped


class LibcuptiBuffers:
    """The activity-buffer entry points of one libcupti, through ctypes.

    The C callbacks are created once per library and stay alive for the process (CUPTI keeps the
    function pointers); they dispatch to the Python functions of the latest :meth:`register`.
    """

    def __init__(self, path: str, mapped: list[str] | None = None) -> None:
        try:
            lib = ctypes.CDLL(path)
            self._register = lib.cuptiActivityRegisterCallbacks
            self._enable = lib.cuptiActivityEnable
            self._disable = lib.cuptiActivityDisable
            self._flush_all = lib.cuptiActivityFlushAll
            self._next = lib.cuptiActivityGetNextRecord
            self._period = getattr(lib, "cuptiActivityFlushPeriod", None)
        except (OSError, AttributeError) as e:
            raise RawBuffersUnavailable(f"{path}: {e}") from e
        for f in (self._register, self._enable, self._disable, self._flush_all, self._next, self._period):
            if f is not None:
                f.restype = ctypes.c_int
        self._register.argtypes = [_REQUEST, _COMPLETE]
        self._enable.argtypes = [ctypes.c_int]
        self._disable.argtypes = [ctypes.c_int]
        self._flush_all.argtypes = [ctypes.c_uint32]
        self._next.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
        if self._period is not None:
            self._period.argtypes = [ctypes.c_uint32]
        self.lib = lib
        self.path = path
        self.mapped = list(mapped or [])
        self._request_fn: Callable[[], tuple[int, int]] | None = None
        self._complete_fn: Callable[[int, int, int], None] | None = None
        self._c_request = _REQUEST(self._on_request)
        self._c_complete = _COMPLETE(self._on_complete)

    # -- the C callbacks (CUPTI's threads or the flushing thread; ctypes takes the GIL)
    def _on_request(self, pbuf: Any, psize: Any, pmax: Any) -> None:
        addr, size = 0, 0
        fn = self._request_fn
        if fn is not None:
            try:
                addr, size = fn()
            except BaseException:
                addr, size = 0, 0
        pbuf[0] = addr or None  # NULL: CUPTI drops records (and counts them)
        psize[0] = size if addr else 0
        pmax[0] = 0

    def _on_complete(self, ctx: Any, stream_id: int, buf: Any, size: int, valid: int) -> None:
        fn = self._complete_fn
        if fn is not None and buf:
            try:
                fn(int(buf), int(size), int(valid))
            except BaseException:
                pass

    # -- API
    def register(self, request: Callable[[], tuple[int, int]], complete: Callable[[int, int, int], None]) -> None:
        """Route CUPTI's buffer callbacks to ``request() -> (address, size)`` and
        ``complete(address, size, valid_size)``."""
        self._request_fn, self._complete_fn = request, complete
        self._check("cuptiActivityRegisterCallbacks", self._register(self._c_request, self._c_complete))

    def release(self) -> None:
        """Forget the Python functions (the C callbacks stay registered: requests get NULL)."""
        self._request_fn = self._complete_fn = None

    def enable(self, kind: int) -> None:
        self._check("cuptiActivityEnable", self._enable(int(kind)))

    def disable(self, kind: int) -> None:
        self._check("cuptiActivityDisable", self._disable(int(kind)))

    def flush_all(self, flag: int) -> None:
        self._check("cuptiActivityFlushAll", self._flush_all(int(flag)))

    def flush_period(self, ms: int) -> None:
        if self._period is None:
            raise RawCuptiError("cuptiActivityFlushPeriod (missing)", 11)
        self._check("cuptiActivityFlushPeriod", self._period(int(ms)))

    @property
    def has_flush_period(self) -> bool:
        return self._period is not None

    def record_offsets(self, addr: int, valid: int, limit: int | None = None) -> list[int]:
        """Offsets of the records in a buffer as CUPTI's own iterator (``cuptiActivityGetNextRecord``)
        walks them: the reference the numpy walk is checked against."""
        rec = ctypes.c_void_p(None)
        out: list[int] = []
        nxt = self._next
        while limit is None or len(out) < limit:
            st = nxt(addr, valid, ctypes.byref(rec))
            if st == _MAX_LIMIT_REACHED:
                break
            if st != _SUCCESS:
                raise RawCuptiError("cuptiActivityGetNextRecord", st)
            out.append(int(rec.value or 0) - addr)
        return out

    @staticmethod
    def _check(what: str, status: int) -> None:
        if status != _SUCCESS:
            raise RawCuptiError(what, status)


def open_libcupti(cupti: Any) -> LibcuptiBuffers:
    """The :class:`LibcuptiBuffers` of the libcupti cupti-python uses (one per process and path)."""
    path, mapped = find_libcupti(cupti)
    if not path:
        raise RawBuffersUnavailable("libcupti not found (not mapped, no nvidia wheel, not on the library path)")
    with _LOCK:
        b = _BACKENDS.get(path)
        if b is None:
            b = _BACKENDS[path] = LibcuptiBuffers(path, mapped)
        b.mapped = mapped
    return b


def open_backend(cupti: Any) -> Any:
    """:data:`BACKEND_FACTORY` when set (tests), else :func:`open_libcupti`."""
    factory = BACKEND_FACTORY
    if factory is not None:
        return factory(cupti)
    if not sys.platform.startswith("linux"):
        raise RawBuffersUnavailable("raw activity buffers are implemented for Linux only")
    return open_libcupti(cupti)


class BufferPool:
    """Activity buffers handed to CUPTI: ``take()`` -> ``(address, size)``, ``give(address)``.

    At most ``keep`` free buffers are kept for reuse (so memory stays bounded at
    ``(in flight + keep) * size``); ``max_in_flight`` is the most CUPTI held at once. Addresses are
    8-byte aligned (CUPTI's record alignment).
    """

    def __init__(self, size: int, keep: int = 3) -> None:
        self.size = int(size)
        self.keep = max(0, int(keep))
        self._free: list[Any] = []
        self._out: dict[int, Any] = {}
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.allocated = 0

    def take(self) -> tuple[int, int]:
        with self._lock:
            raw = self._free.pop() if self._free else None
        if raw is None:
            raw = ctypes.create_string_buffer(self.size + _ALIGN)
            self.allocated += 1
        addr = ctypes.addressof(raw)
        addr += (-addr) % _ALIGN
        with self._lock:
            self._out[addr] = raw
            self.in_flight += 1
            if self.in_flight > self.max_in_flight:
                self.max_in_flight = self.in_flight
        return addr, self.size

    def give(self, addr: int) -> None:
        with self._lock:
            raw = self._out.pop(int(addr), None)
            if raw is None:
                return
            self.in_flight -= 1
            if len(self._free) < self.keep:
                self._free.append(raw)

    def owns(self, addr: int) -> bool:
        return int(addr) in self._out


# Buffers CUPTI still held when a session ended: kept alive (CUPTI may still write into them).
ORPHANED: list[BufferPool] = []
