"""The control block of ``graphtree.share`` channels: a page of host memory both sides map.

A producer's channels keep their versions in slots (GPU buffers); which version each slot holds,
which consumers are reading it and which have finished is bookkeeping both processes must see
at once, so it lives in shared host memory: an anonymous ``memfd`` the producer creates and hands
to consumers over the rendezvous socket with the pool's descriptor (it has no name, so nobody
else can open it). Cells are int64; every change is made under a process lock (``lockf`` on the
memfd, plus a thread lock in each process, since POSIX record locks do not exclude threads),
except a channel's publication of a new version, which only its producer thread writes (see
:meth:`graphtree.share.channel.Channel.commit`). A consumer killed while holding the lock frees
it (the kernel drops a dead process's locks).

Layout (int64 cells): ``pid[c]`` of each consumer slot ``c`` (0: free), then per channel ``j``:
``latest`` (the newest committed version, 0 before any), and per slot ``s``: ``version[s]``
(-1 while being written), ``reading[s]`` and ``done[s]`` (bit masks of consumers).

Example::

    block = ControlBlock.create()             # producer
    with block.locked():
        block.set(block.latest_cell(0), 1)
    mirror = ControlBlock.open(fd)            # consumer, fd received over the rendezvous
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["MAX_CHANNELS", "MAX_CONSUMERS", "MAX_SLOTS", "ControlBlock", "Membership"]

MAX_CONSUMERS = 62
"""Consumers attached at once to one producer (a bit each in the masks)."""
MAX_SLOTS = 8
"""Buffers a channel may rotate through."""
MAX_CHANNELS = 64
"""Channels one producer may publish."""

_CHANNEL_CELLS = 1 + 3 * MAX_SLOTS
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

    @classmethod
    def create(cls) -> ControlBlock:
        """A new zeroed block (the producer's); the caller sends :attr:`fd` to consumers."""
        fd = os.memfd_create("graphtree-share-control", os.MFD_CLOEXEC)
        os.ftruncate(fd, _SIZE)
        return cls(fd)

    def close(self) -> None:
        """Unmap and close the descriptor (idempotent)."""
        if self.fd < 0:
            return
        self.cells.release()
        self._map.close()
        os.close(self.fd)
        self.fd = -1

    def acquire(self) -> None:
        """Hold the block against every other thread and process that uses it (see :meth:`locked`).

        Spins on a non-blocking ``lockf`` rather than sleeping in a blocking one: the lock is held
        for a few cell updates, and a sleeping waiter is woken tens of microseconds late."""
        self._thread_lock.acquire()
        try:
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
    def done_cell(channel: int, slot: int) -> int:
        return MAX_CONSUMERS + channel * _CHANNEL_CELLS + 1 + 2 * MAX_SLOTS + slot

    @classmethod
    def channel_cells(cls, channel: int, slots: int) -> tuple[int, list[int], list[int], list[int]]:
        """Channel ``channel``'s cells, for its hot paths: ``latest`` and, per slot, ``version``,
        ``reading`` and ``done``."""
        each = range(slots)
        return (
            cls.latest_cell(channel),
            [cls.version_cell(channel, s) for s in each],
            [cls.reading_cell(channel, s) for s in each],
            [cls.done_cell(channel, s) for s in each],
        )


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
    finally:
        block.close()
