"""GPU memory that other processes can map: export and import through NVIDIA's ``cuda.core``.

The producer allocates from an IPC-enabled memory pool (``cuda.core.DeviceMemoryResource`` with
``ipc_enabled=True``: a ``cuMemPool`` whose handle is a POSIX file descriptor). A consumer
imports the pool from that descriptor (``DeviceMemoryResource.from_allocation_handle``) and each
buffer from its export data (``Buffer.from_ipc_descriptor``), then views it as a torch tensor
through DLPack: the same memory, no copy.

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
"""

from __future__ import annotations

import base64
import importlib
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
    cc = cuda_core()
    s = torch.cuda.current_stream(device)
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


def _views(buf: Any, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    raw = torch.from_dlpack(buf)  # keeps ``buf`` (and its pool) alive as long as the tensor lives
    raw = raw.view(torch.uint8) if raw.element_size() == 1 else raw.view(-1).view(torch.uint8)
    return raw[:nbytes].view(dtype).view(shape)


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
        nbytes = max(1, _numel(shape) * torch.empty((), dtype=dtype).element_size())
        buf = self._mr.allocate(nbytes, stream=torch_stream(self.device))
        reserved, size = buf.ipc_descriptor.__reduce__()[1][:2]
        export = {"data": base64.b64encode(bytes(reserved)).decode(), "size": int(size), "nbytes": nbytes}
        return _views(buf, nbytes, shape, dtype), export


class ImportPool:
    """The consumer's view of a producer's pool, imported from the pool's file descriptor."""

    def __init__(self, device: int, fd: int) -> None:
        cc = cuda_core()
        dev = cc.Device(device)
        dev.set_current()
        self._descriptor = _descriptor_type()
        self._mr = cc.DeviceMemoryResource.from_allocation_handle(dev, fd)
        self.device = device

    def tensor(self, export: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The producer's tensor described by ``export``, mapped here (no copy)."""
        desc = self._descriptor._init(base64.b64decode(export["data"]), int(export["size"]))
        buf = self._buffer_type().from_ipc_descriptor(self._mr, desc, stream=torch_stream(self.device))
        return _views(buf, int(export["nbytes"]), shape, dtype)

    @staticmethod
    def _buffer_type() -> Any:
        return cuda_core().Buffer


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
