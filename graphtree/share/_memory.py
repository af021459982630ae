"""GPU memory that other processes can map: export and import through NVIDIA's ``cuda.core``.

The producer allocates from an IPC-enabled memory pool (``cuda.core.DeviceMemoryResource`` with
``ipc_enabled=True``: a ``cuMemPool`` whose handle is a POSIX file descriptor). A consumer
imports the pool from that descriptor (``DeviceMemoryResource.from_allocation_handle``) and each
buffer from its export data (``Buffer.from_ipc_descriptor``), then views it as a torch tensor
(``__cuda_array_interface__``): the same memory, no copy.

The export data of a buffer is cuda.core's ``IPCBufferDescriptor`` (64 bytes of
``cuMemPoolExportPointer`` data and a size). It is sent as JSON, not pickled, and rebuilt with
``IPCBufferDescriptor._init`` (cuda.core 1.2; the one private name used here, checked at import
with a clear error).

Example::

    pool = ExportPool(device=0, max_bytes=1 << 30)
    buf, export = pool.allocate(4096)           # producer
    ...
    imported = ImportPool(device=0, fd=fd)       # consumer, fd received over the rendezvous
    t = imported.tensor(export, (1024,), torch.float32)
    imported.done()                              # the import closes when ``t`` and its views are gone
"""

from __future__ import annotations

import base64
import importlib
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["ExportPool", "ImportPool", "ShareUnavailableError", "cuda_core", "torch_stream"]

INSTALL_HINT = "pip install cuda-core cuda-bindings (cuda.core 1.2 or newer)"


class ShareUnavailableError(RuntimeError):
    """graphtree.share cannot run here (no cuda.core, no CUDA, an unsupported platform)."""


def cuda_core() -> Any:
    """NVIDIA's ``cuda.core`` or :class:`ShareUnavailableError` saying how to install it."""
    try:
        return importlib.import_module("cuda.core")
    except ImportError as e:
        raise ShareUnavailableError(f"graphtree.share needs NVIDIA's cuda.core ({e}): {INSTALL_HINT}") from None


def torch_stream(device: int) -> Any:
    """torch's current stream on ``device`` as a ``cuda.core`` stream.

    Buffers are allocated and freed on it, so that a tensor dropped right after torch queued work
    on it is freed only after that work: freeing on a stream of our own let the memory go while a
    kernel still read it (an illegal address, seen on the H100). Work on other streams needs the
    tensor kept alive until it is done, as with ``Tensor.record_stream``.
    """
    return _cc_stream(device, torch.cuda.current_stream(device))


def _cc_stream(device: int, s: torch.cuda.Stream) -> Any:
    cc = cuda_core()
    from_handle = getattr(cc.Stream, "from_handle", None)
    if from_handle is not None:
        return from_handle(s.cuda_stream)
    return cc.Device(device).create_stream(s)  # torch streams speak the __cuda_stream__ protocol


def _descriptor_type() -> Any:
    for module in ("cuda.core", "cuda.core._memory._ipc", "cuda.core._memory"):
        try:
            t = getattr(importlib.import_module(module), "IPCBufferDescriptor", None)
        except ImportError:
            continue
        if t is not None and hasattr(t, "_init"):
            return t
    raise ShareUnavailableError(f"this cuda.core has no IPCBufferDescriptor._init: {INSTALL_HINT}")


def _views(raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``raw`` (bytes, at least one) seen as a ``shape``/``dtype`` tensor (an empty one too)."""
    raw = raw.view(torch.uint8) if raw.element_size() == 1 else raw.view(-1).view(torch.uint8)
    return raw[: _numel(shape) * dtype.itemsize].view(dtype).view(shape)


class _Mapping:
    """A mapped buffer's bytes as ``__cuda_array_interface__``, for ``torch.as_tensor``: the tensor's
    storage keeps this object alive, and this object's end (a ``weakref.finalize``) is the
    signal that the last tensor on the buffer is gone."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


class ExportPool:
    """The producer's IPC-enabled pool on ``device``, of at most ``max_bytes``."""

    def __init__(self, device: int, max_bytes: int) -> None:
        cc = cuda_core()
        self.device = device
        dev = cc.Device(device)
        dev.set_current()
        options = cc.DeviceMemoryResourceOptions(ipc_enabled=True, max_size=max_bytes)
        self._mr = cc.DeviceMemoryResource(dev, options)

    def fd(self) -> int:
        """The pool's shareable handle (a file descriptor this object owns)."""
        return int(self._mr.allocation_handle.handle)

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, Any]]:
        """A new tensor in the pool and the JSON-ready data a consumer imports it with."""
        nbytes = max(1, _numel(shape) * dtype.itemsize)
        buf = self._mr.allocate(nbytes, stream=torch_stream(self.device))
        reserved, size = buf.ipc_descriptor.__reduce__()[1][:2]
        export = {"data": base64.b64encode(bytes(reserved)).decode(), "size": int(size), "nbytes": nbytes}
        # DLPack keeps ``buf`` (and the pool) alive as long as the tensor lives; the producer's
        # pool is never closed, so nothing needs to know when that ends
        return _views(torch.from_dlpack(buf), shape, dtype), export


class ImportPool:
    """The consumer's view of a producer's pool, imported from the pool's file descriptor.

    The import holds the producer's memory in this process until it is closed, and cuda.core
    closes an imported pool only on an explicit ``close()`` (measured on the H100: dropping
    every buffer and the resource left the whole pool allocated). So this object counts the
    buffers it mapped and closes the import once :meth:`done` was called (as many times as the
    import was taken: the constructor and each :meth:`reuse`) and the last buffer is gone. A
    buffer is mapped once however many tensors view it, and freed (on torch's current stream)
    when the last of them is collected.
    """

    def __init__(self, device: int, fd: int) -> None:
        cc = cuda_core()
        dev = cc.Device(device)
        dev.set_current()
        self._descriptor = _descriptor_type()
        self._buffer = cc.Buffer
        self._mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fd)
        self.device = device
        self._lock = threading.RLock()  # a collection inside tensor() may run _unmap on this thread
        self._live = 1  # the mapped buffers, plus one per taker until its done()
        self._mapped: dict[str, weakref.ref[_Mapping]] = {}  # export data -> the buffer's mapping

    @property
    def closed(self) -> bool:
        """Whether the import was given back (no tensor of it is left)."""
        return self._live == 0

    def reuse(self) -> bool:
        """Take the import again (for another attach; :meth:`done` when finished). False when it
        was closed already: import the pool anew then."""
        with self._lock:
            if self._live == 0:
                return False
            self._live += 1
            return True

    def tensor(self, export: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The producer's tensor described by ``export``, mapped here (no copy)."""
        key = export["data"]
        with self._lock:
            if self._live == 0:
                raise RuntimeError("this import of the producer's pool was closed")
            ref = self._mapped.get(key)
            mapping = None if ref is None else ref()
            if mapping is None:
                desc = self._descriptor._init(base64.b64decode(key), int(export["size"]))
                buf = self._buffer.from_ipc_descriptor(self._mr, desc, stream=torch_stream(self.device))
                self._live += 1
                mapping = _Mapping(int(buf.handle), int(export["nbytes"]))
                weakref.finalize(mapping, self._unmap, key, buf).atexit = False  # at exit the process frees it all
                self._mapped[key] = weakref.ref(mapping)
        return _views(torch.as_tensor(mapping, device=f"cuda:{self.device}"), shape, dtype)

    def done(self) -> None:
        """This taker maps no more: close the import once the last tensor is gone (now if none)."""
        self._release()

    def _unmap(self, key: str, buf: Any, stream: torch.cuda.Stream | None = None) -> None:
        """Free ``buf`` on ``stream`` (default: the current one) and give up its count."""
        stream = stream or torch.cuda.current_stream(self.device)
        if torch.cuda.is_current_stream_capturing():
            # the last tensor went while this thread captures a graph: a free now would become a
            # node of the graph, and the wait in _release would end the capture with an error;
            # so free on the same stream once its capture is over
            _after_capture(self.device, stream.cuda_stream, lambda: self._unmap(key, buf, stream))
            return
        buf.close(stream=_cc_stream(self.device, stream))
        with self._lock:
            ref = self._mapped.get(key)
            if ref is not None and ref() is None:  # not a newer mapping of the same buffer
                del self._mapped[key]
        self._release()

    def _release(self) -> None:
        with self._lock:
            self._live -= 1
            if self._live:
                return
        if torch.cuda.is_current_stream_capturing():  # done() inside a capture: close after it
            _after_capture(self.device, torch.cuda.current_stream(self.device).cuda_stream, self._close)
        else:
            self._close()

    def _close(self) -> None:
        # the buffers' frees are queued on streams; an imported pool destroyed before they ran
        # kept the producer's memory allocated (H100, driver 580), so wait for them first (in
        # the relaxed capture mode: another thread may be capturing a graph, see _after_capture)
        with _relaxed_capture_mode():
            torch.cuda.synchronize(self.device)
        self._mr.close()


@contextmanager
def _relaxed_capture_mode() -> Iterator[None]:
    """This thread's CUDA calls in the *relaxed* stream-capture mode: in the default *global*
    mode, a synchronizing call made while any thread captures a graph ends that capture with an
    error. (A thread's own capture is never waited for here: see ``ImportPool._unmap``.)"""
    from cuda.bindings import runtime as cudart

    mode = cudart.cudaStreamCaptureMode
    err, before = cudart.cudaThreadExchangeStreamCaptureMode(mode.cudaStreamCaptureModeRelaxed)
    try:
        yield
    finally:
        if err == cudart.cudaError_t.cudaSuccess:
            cudart.cudaThreadExchangeStreamCaptureMode(before)


def _after_capture(device: int, stream: int, then: Callable[[], None], every: float = 0.01) -> None:
    """Call ``then`` on a timer thread (``device`` current) once ``stream`` (a raw handle) no
    longer captures a graph."""

    def check() -> None:
        from cuda.bindings import runtime as cudart

        cuda_core().Device(device).set_current()  # a new thread has no current CUDA context
        err, status = cudart.cudaStreamIsCapturing(stream)
        if (
            err == cudart.cudaError_t.cudaSuccess
            and status != cudart.cudaStreamCaptureStatus.cudaStreamCaptureStatusNone
        ):
            _after_capture(device, stream, then, every)
            return
        then()

    timer = threading.Timer(every, check)
    timer.daemon = True
    timer.start()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
