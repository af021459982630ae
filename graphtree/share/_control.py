"""The control block of ``graphtree.share`` channels: a page of host memory both sides map.

A producer's channels keep their versions in slots (GPU buffers); which version each slot holds
and which consumers are reading it is bookkeeping both processes must see at once, so it lives in
shared host memory: an anonymous ``memfd`` the producer creates and hands to consumers over the
rendezvous socket with the pool's descriptor (it has no name, so nobody else can open it). Cells
are int64. Consumers change them under a process lock (``lockf`` on the memfd, plus a thread lock
in each process, since POSIX record locks do not exclude threads); the producer's writing thread
is the only writer of a channel's ``latest``, ``version`` and ``pending`` cells and writes them
without it (see :mod:`graphtree.share.channel`). A consumer killed while holding the lock frees
it (the kernel drops a dead process's locks).

Each process also registers its mapping of the page with CUDA (:meth:`ControlBlock.gpu_cells`), so
that the GPU reads and writes the same cells: the producer's GPU writes ``ready[s]`` when it has
written a version, and a consumer's GPU waits for it (``cuStreamWaitValue64``).

Layout (int64 cells): ``pid[c]`` of each consumer slot ``c`` (0: free), then per channel ``j``:
``latest`` (the newest committed version, 0 before any), and per slot ``s``: ``version[s]``
(-1 while being written), ``reading[s]`` (bit mask of consumers), ``pending[s]`` (the version
being written there) and ``ready[s]`` (the newest version there whose writes the producer's GPU
has done: written by that GPU).

Example::

    block = ControlBlock.create()             # producer
    with block.locked():
        block.set(block.latest_cell(0), 1)
    mirror = ControlBlock.open(fd)            # consumer, fd received over the rendezvous
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

__all__ = ["MAX_CHANNELS", "MAX_CONSUMERS", "MAX_SLOTS", "ChannelCells", "ControlBlock", "Membership", "alive"]

MAX_CONSUMERS = 62
"""Consumers attached at once to one producer (a bit each in the masks)."""
MAX_SLOTS = 8
"""Buffers a channel may rotate through."""
MAX_CHANNELS = 64
"""Channels one producer may publish."""

_CHANNEL_CELLS = 1 + 4 * MAX_SLOTS
_CELLS = MAX_CONSUMERS + MAX_CHANNELS * _CHANNEL_CELLS
_SIZE = (_CELLS * 8 + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE


class ControlBlock:
    """One producer's shared bookkeeping (see the module's docstring for the layout)."""

    def __init__(self, fd: int) -> None:
        if os.fstat(fd).st_size != _SIZE:
            raise ValueError(f"a control block has {_SIZE} bytes, this descriptor has {os.fstat(fd).st_size}")
        self.fd = fd
        self._map = mmap.mmap(fd, _SIZE)
        self.cells = memoryview(self._map).cast("q")
        """The int64 cells, for hot paths that index them directly (cell numbers from the ``*_cell`` methods)."""
        self._thread_lock = threading.Lock()
        self._gpu: tuple[int, Any] | None = None  # (registered address, CUDA view) once gpu_cells() ran

    @classmethod
    def create(cls) -> ControlBlock:
        """A new zeroed block (the producer's); the caller sends :attr:`fd` to consumers."""
        fd = os.memfd_create("graphtree-share-control", os.MFD_CLOEXEC)
        os.ftruncate(fd, _SIZE)
        return cls(fd)

    @property
    def closed(self) -> bool:
        return self.fd < 0

    def close(self) -> None:
        """Unregister from CUDA, unmap and close the descriptor (idempotent; waits for a thread
        that holds the block)."""
        if self._gpu is not None:
            import torch

            if torch.cuda.is_current_stream_capturing():  # (a finalizer) unregister after the capture
                from graphtree.share._memory import _after_capture

                _after_capture(self._gpu[1].device.index, torch.cuda.current_stream().cuda_stream, self.close)
                return
        with self._thread_lock:
            if self.fd < 0:
                return
            if self._gpu is not None:
                self._gpu_finalizer.detach()
                _unregister(self._gpu[0])
                self._gpu = None
            self.cells.release()
            self._map.close()
            os.close(self.fd)
            self.fd = -1

    def gpu_cells(self, device: int) -> Any:
        """The cells as an int64 CUDA tensor on ``device``: this mapping of the page registered
        with CUDA (``cudaHostRegister``, mapped), so the GPU reads and writes the same memory.
        Registered on the first call; :meth:`close` unregisters it."""
        with self._thread_lock:
            if self._gpu is None:
                self._gpu = _register(self._map, _SIZE, device)
                # a block dropped without close(): its address range may be mapped again, and
                # CUDA refuses to register a range it still has (cudaErrorHostMemoryAlreadyRegistered)
                self._gpu_finalizer = weakref.finalize(self, _unregister, self._gpu[0])
            return self._gpu[1]

    def device_address(self, cell: int) -> int:
        """The address of ``cell`` for the GPU (after :meth:`gpu_cells`), for stream memory operations."""
        if self._gpu is None:
            raise RuntimeError("the control block is not registered with CUDA (gpu_cells() first)")
        return self._gpu[1].data_ptr() + cell * 8

    def acquire(self) -> None:
        """Hold the block against every other thread and process that uses it (see :meth:`locked`).

        Spins on a non-blocking ``lockf`` rather than sleeping in a blocking one: the lock is held
        for a few cell updates, and a sleeping waiter is woken tens of microseconds late. Raises
        ``ValueError`` once the block is closed."""
        self._thread_lock.acquire()
        try:
            if self.fd < 0:
                raise ValueError("the control block is closed")
            tries = 0
            while True:
                try:
                    fcntl.lockf(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except (BlockingIOError, PermissionError):  # held by another process
                    tries += 1
                    if tries > 1000:
                        fcntl.lockf(self.fd, fcntl.LOCK_EX)  # held long (a stopped process): sleep on it
                        return
                    os.sched_yield()
        except BaseException:
            self._thread_lock.release()
            raise

    def release(self) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    @contextmanager
    def locked(self) -> Iterator[None]:
        """``with block.locked():`` holds the block (:meth:`acquire`/:meth:`release`, for cold paths)."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def get(self, cell: int) -> int:
        return self.cells[cell]

    def set(self, cell: int, value: int) -> None:
        self.cells[cell] = value

    @staticmethod
    def pid_cell(consumer: int) -> int:
        return consumer

    @staticmethod
    def latest_cell(channel: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS

    @staticmethod
    def version_cell(channel: int, slot: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS + 1 + slot

    @staticmethod
    def reading_cell(channel: int, slot: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS + 1 + MAX_SLOTS + slot

    @staticmethod
    def pending_cell(channel: int, slot: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS + 1 + 2 * MAX_SLOTS + slot

    @staticmethod
    def ready_cell(channel: int, slot: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS + 1 + 3 * MAX_SLOTS + slot

    @classmethod
    def channel_cells(cls, channel: int, slots: int) -> ChannelCells:
        """Channel ``channel``'s cell numbers, for its hot paths."""
        each = range(slots)
        return ChannelCells(
            cls.latest_cell(channel),
            [cls.version_cell(channel, s) for s in each],
            [cls.reading_cell(channel, s) for s in each],
            [cls.pending_cell(channel, s) for s in each],
            [cls.ready_cell(channel, s) for s in each],
        )


class ChannelCells(NamedTuple):
    """One channel's cell numbers: ``latest`` and, per slot, ``version``, ``reading``, ``pending``
    and ``ready`` (see the module's docstring)."""

    latest: int
    version: list[int]
    reading: list[int]
    pending: list[int]
    ready: list[int]


class Membership:
    """A consumer's place in a producer's block: consumer number ``index``, given up (its pid cell
    cleared, the block unmapped) by :meth:`close` or when nothing references it any more. The
    producer then drops the consumer's claims and events when it next looks."""

    def __init__(self, block: ControlBlock, index: int) -> None:
        self.block = block
        self.index = index
        self._finalizer = weakref.finalize(self, _leave, block, index)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Give up the place (idempotent)."""
        self._finalizer()


def _leave(block: ControlBlock, index: int) -> None:
    try:
        with block.locked():
            block.set(block.pid_cell(index), 0)
    except ValueError:  # closed already
        pass
    finally:
        block.close()


class _HostCells:
    """Registered host memory as ``__cuda_array_interface__`` (int64 cells), for ``torch.as_tensor``."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (n,),
            "typestr": "<i8",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def _check(result: Any, what: str) -> Any:
    from cuda.bindings import runtime as cudart

    err = result[0] if isinstance(result, tuple) else result
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"{what} failed: {err!r}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else None


def _register(mapping: mmap.mmap, size: int, device: int) -> tuple[int, Any]:
    """Register ``mapping`` with CUDA (pinned and mapped into every device's address space) and
    view it as an int64 CUDA tensor on ``device``: (host address, tensor)."""
    import torch
    from cuda.bindings import runtime as cudart

    window = ctypes.c_char.from_buffer(mapping)  # only to learn the address: released at once
    host = ctypes.addressof(window)
    del window
    flags = cudaHostRegisterPortable | cudaHostRegisterMapped
    with torch.cuda.device(device):
        _check(cudart.cudaHostRegister(host, size, flags), "cudaHostRegister of the control block")
        ptr = int(_check(cudart.cudaHostGetDevicePointer(host, 0), "cudaHostGetDevicePointer"))
        view = torch.as_tensor(_HostCells(ptr, size // 8), device=f"cuda:{device}")
    return host, view


def _unregister(host: int) -> None:
    from cuda.bindings import runtime as cudart

    from graphtree.share._memory import _relaxed_capture_mode

    with _relaxed_capture_mode():  # not to end another thread's capture (see _memory._after_capture)
        cudart.cudaHostUnregister(host)  # an error (CUDA torn down at exit) leaves nothing to undo


cudaHostRegisterPortable = 1
cudaHostRegisterMapped = 2


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed but not yet waited for, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process (allow_uids): alive
    return True
