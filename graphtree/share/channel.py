"""Versions of a shared tensor, stream-ordered on both sides: ``graphtree.share`` channels.

A producer's :class:`Channel` rotates through ``slots`` GPU buffers of one shape. To publish a
version it writes into the buffer :meth:`Channel.next` gives (its current stream first waits,
on the GPU, for every consumer still reading what that buffer held) and calls
:meth:`Channel.commit`, which records an inter-process CUDA event after the writes. A consumer's
:meth:`Subscription.read` takes the newest committed version, makes its current stream wait on
that event (a GPU wait: the CPU goes on) and, when the ``with`` block ends, records its own
inter-process event, which the producer's next write into that buffer waits for. So a reader
never sees a half-written version and a writer never overwrites a version being read, without
either CPU waiting for the other's GPU. The bookkeeping (which slot holds which version, who
reads it) is in a shared page (:mod:`graphtree.share._control`).

Constraints: one writing thread per channel; a consumer uses a version's tensor only inside its
``with`` block and on its current stream (as with ``Tensor.record_stream``, other streams must
be ordered after it). A slow consumer holds back the producer when every other slot is in use:
:meth:`Channel.next` then waits on the CPU, up to ``timeout`` seconds.

Example::

    ch = pub.channel("logits", (8, 32000), torch.float16)       # producer
    step(x, out=ch.next()); ch.commit()

    with shared.channel("logits").read() as frame:              # consumer
        tokens = frame.tensor.argmax(-1)
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple, TypeVar

import torch

from graphtree import _torch
from graphtree.share._control import ControlBlock, Membership

__all__ = ["Channel", "Frame", "Subscription", "interprocess_events"]

_T = TypeVar("_T")


class Frame(NamedTuple):
    """One version of a channel as a consumer reads it: the tensor and its version number."""

    tensor: torch.Tensor
    version: int


def _poll(attempt: Callable[[], _T | None], timeout: float, what: Callable[[], str]) -> _T:
    """Call ``attempt`` (spinning briefly, then sleeping a little) until it gives something, or
    raise ``TimeoutError(what())`` after ``timeout`` seconds."""
    start = time.perf_counter()
    spins = 0
    while (result := attempt()) is None:
        spins += 1
        elapsed = time.perf_counter() - start
        if elapsed > timeout:
            raise TimeoutError(what())
        if spins > 200:
            time.sleep(min(1e-3, 1e-5 * spins / 200))
        else:
            os.sched_yield()
    return result


class _CurrentStream:
    """``current()``: torch's current stream on ``device``, cheaply, for the channels' hot paths.

    ``torch.cuda.current_stream`` builds a new ``Stream`` object on each call (3.1 µs on the H100
    host); the raw handle costs 0.17 µs, so the objects are kept by handle (a few streams at most)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device.index
        self._raw = _torch.raw_stream_getter() if device.type == "cuda" else None
        self._known: dict[int, torch.cuda.Stream] = {}

    def current(self) -> torch.cuda.Stream:
        if self._raw is None:
            return torch.cuda.current_stream(self._device)
        handle = self._raw(self._device)
        stream = self._known.get(handle)
        if stream is None:
            if len(self._known) >= 64:
                self._known.clear()
            stream = self._known[handle] = torch.cuda.current_stream(self._device)
        return stream


def interprocess_events(n: int, device: torch.device | int) -> list[torch.cuda.Event]:
    """``n`` inter-process CUDA events on ``device``, each recorded once, so that a wait before
    the first real record is a no-op."""
    with torch.cuda.device(device):
        events = [torch.cuda.Event(interprocess=True) for _ in range(n)]
        for e in events:
            e.record()
    return events


class Channel:
    """The producer's side of a channel: rotate through ``slots`` buffers, one version at a time.

    Made by :meth:`graphtree.share.Publisher.channel`. Example::

        ch = pub.channel("logits", (8, 32000), torch.float16, slots=3)
        for x in batches:
            torch.matmul(x, w, out=ch.next())   # or a graphed step writing into it
            ch.commit()
    """

    def __init__(
        self,
        name: str,
        index: int,
        buffers: list[torch.Tensor],
        block: ControlBlock,
        consumer_events: Callable[[int], list[torch.cuda.Event] | None],
        reap: Callable[[], None],
    ) -> None:
        self.name = name
        self.index = index
        self.buffers = buffers
        self.device = buffers[0].device
        self.written = interprocess_events(len(buffers), self.device)
        self._stream = _CurrentStream(self.device)
        self._block = block
        self._consumer_events = consumer_events
        self._reap = reap
        self._writing = -1
        self._latest_slot = -1
        self.version = 0
        n = len(buffers)
        self._latest_cell, self._version_cells, self._reading_cells, self._done_cells = block.channel_cells(index, n)
        # the slots to try after the newest is in slot k (key -1: none yet); one slot: itself
        self._tries = {k: [s for s in ((k + i) % n for i in range(1, n + 1)) if s != k or n == 1] for k in range(-1, n)}

    def next(self, *, timeout: float = 5.0) -> torch.Tensor:
        """The buffer to write the next version into (ordered after its readers on the GPU)."""
        if self._writing >= 0:
            raise RuntimeError(f"channel {self.name!r}: commit() the version being written before next()")
        taken = self._take()
        if taken is None:  # every other slot is being read: wait for a reader to finish (or die)
            taken = _poll(
                self._take_or_reap,
                timeout,
                lambda: f"channel {self.name!r}: every slot is being read after {timeout} s",
            )
        s, done = taken
        if done:
            stream = self._stream.current()
            c = 0
            while done:
                events = self._consumer_events(c) if done & 1 else None
                if events is not None:  # None: the consumer detached or died since
                    stream.wait_event(events[s])
                done >>= 1
                c += 1
        self._writing = s
        return self.buffers[s]

    def commit(self) -> int:
        """Publish what was written into :meth:`next`'s buffer as the newest version (stream-ordered)."""
        s = self._writing
        if s < 0:
            raise RuntimeError(f"channel {self.name!r}: next() gives the buffer to write before commit()")
        self.written[s].record(self._stream.current())
        v = self.version = self.version + 1
        # No lock: only this thread writes these two cells, the slot's first. A consumer that
        # sees the new ``latest`` then finds its slot (or, where stores may be reordered, finds
        # none and looks again); the slot is claimed under the lock, against _take.
        cells = self._block.cells
        cells[self._version_cells[s]] = v
        cells[self._latest_cell] = v
        self._latest_slot, self._writing = s, -1
        return v

    def _take_or_reap(self) -> tuple[int, int] | None:
        taken = self._take()
        if taken is None:
            self._reap()  # a consumer killed while reading holds its slot until reaped
        return taken

    def _take(self) -> tuple[int, int] | None:
        """A slot nobody reads, oldest version first and never the newest (readers may want it),
        marked as being written; with the consumers that read it since its last write."""
        block, cells = self._block, self._block.cells
        block.acquire()
        try:
            for s in self._tries[self._latest_slot]:
                if cells[self._reading_cells[s]] == 0:
                    done = cells[self._done_cells[s]]
                    cells[self._done_cells[s]] = 0
                    cells[self._version_cells[s]] = -1
                    return s, done
            return None
        finally:
            block.release()


class Subscription:
    """A consumer's side of a channel: read its newest versions (see :meth:`read`).

    Made by :meth:`graphtree.share.Attached.channel`.
    """

    def __init__(
        self,
        name: str,
        index: int,
        buffers: list[torch.Tensor],
        written: list[torch.cuda.Event],
        read_done: list[torch.cuda.Event],
        membership: Membership,
    ) -> None:
        self.name = name
        self.index = index
        self.buffers = buffers
        self.device = buffers[0].device
        self._bit = 1 << membership.index
        self._written = written
        self._read_done = read_done
        self._membership = membership  # kept: this consumer stays registered while it can read
        self._stream = _CurrentStream(self.device)
        block = self._block = membership.block
        self._latest_cell, self._version_cells, self._reading_cells, self._done_cells = block.channel_cells(
            index, len(buffers)
        )
        self.last = 0  # the newest version this consumer has read

    @property
    def latest(self) -> int:
        """The newest version the producer has committed (0 before any)."""
        return self._block.cells[self._latest_cell]

    @contextmanager
    def read(self, *, after: int | None = None, timeout: float = 5.0) -> Iterator[Frame]:
        """Wait for a version newer than ``after`` (default: the last one read here) and read it.

        The current stream waits (on the GPU) for the producer's writes of that version; use the
        tensor only inside the ``with`` block, on the current stream. Raises ``TimeoutError``
        when no newer version comes within ``timeout`` seconds.

        Example::

            with sub.read() as frame:
                out.copy_(frame.tensor)
        """
        if self._membership.closed:
            raise RuntimeError(f"channel {self.name!r}: this consumer was closed (Attached.close())")
        after = self.last if after is None else int(after)
        taken = self._claim(after)
        if taken is None:
            taken = _poll(
                lambda: self._claim(after),
                timeout,
                lambda: f"channel {self.name!r}: no version newer than {after} within {timeout} s",
            )
        s, v = taken
        stream = self._stream.current()
        stream.wait_event(self._written[s])
        try:
            yield Frame(self.buffers[s], v)
        finally:
            self._read_done[s].record(stream)
            block, cells, bit = self._block, self._block.cells, self._bit
            block.acquire()
            cells[self._reading_cells[s]] &= ~bit
            cells[self._done_cells[s]] |= bit
            block.release()
            self.last = v

    def _claim(self, after: int) -> tuple[int, int] | None:
        """Mark the slot of the newest version as read by this consumer, if it is newer than ``after``."""
        block, cells = self._block, self._block.cells
        if cells[self._latest_cell] <= after:  # unlocked peek: a stale value only delays the claim
            return None
        block.acquire()
        try:
            v = cells[self._latest_cell]
            for s, cell in enumerate(self._version_cells):
                if cells[cell] == v:
                    cells[self._reading_cells[s]] |= self._bit
                    return s, v
            return None
        finally:
            block.release()
