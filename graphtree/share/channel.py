"""Versions of a shared tensor, stream-ordered on both sides: ``graphtree.share`` channels.

A producer's :class:`Channel` rotates through ``slots`` GPU buffers of one shape. To publish a
version it writes into the buffer :meth:`Channel.next` gives and calls :meth:`Channel.commit`,
which queues, after the writes on the current stream, a write of the version number into the
slot's ``ready`` cell: a cell of host memory both processes map and have registered with CUDA
(:mod:`graphtree.share._control`). A consumer's :meth:`Subscription.read` takes the newest
committed version and makes its current stream wait, on the GPU, until that cell holds the
version (``cuStreamWaitValue64``): the CPU goes on. When the ``with`` block ends, a thread of the
consumer's process drops its claim on the slot once the GPU work queued inside the block is done;
the producer writes a slot again only when no consumer claims it. So a reader never sees a
half-written version and a writer never overwrites a version being read, and the producer makes
no CUDA call for the ordering but that one write.

:meth:`Channel.graphed` goes further: a function recorded by graphtree writes each call's result
into the next slot, and the ``ready`` write is a node of its recording (a copy from the slot's
``pending`` cell, which the CPU sets when it takes the slot): no CUDA call at all per version
beyond the replay itself.

Constraints: one writing thread per channel; a consumer uses a version's tensor only inside its
``with`` block and on its current stream (as with ``Tensor.record_stream``, other streams must
be ordered after it). A slow consumer holds back the producer when every other slot is in use,
and the producer's GPU may be at most ``slots - 1`` versions behind its CPU: :meth:`Channel.next`
then waits on the CPU, up to ``timeout`` seconds.

Example::

    ch = pub.channel("logits", (8, 32000), torch.float16)       # producer
    step(x, out=ch.next()); ch.commit()
    publish = ch.graphed(model.decode_step)                      # or: graphed, writing each call's
    logits = publish(tokens, pos)                                # result as the next version

    with shared.channel("logits").read() as frame:              # consumer
        tokens = frame.tensor.argmax(-1)
"""

from __future__ import annotations

import array
import functools
import logging
import platform
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import torch

from graphtree import _native, _torch
from graphtree.share._control import ChannelCells, ControlBlock, Membership, alive
from graphtree.share._release import Read, backoff, drain_reads, releaser

__all__ = ["Channel", "Frame", "GraphedWriter", "Subscription", "drain_reads"]

log = logging.getLogger("graphtree")

_T = TypeVar("_T")


class Frame(NamedTuple):
    """One version of a channel as a consumer reads it: the tensor and its version number."""

    tensor: torch.Tensor
    version: int


def _poll(attempt: Callable[[], _T | None], timeout: float, what: Callable[[], str]) -> _T:
    """Call ``attempt`` (spinning briefly, then sleeping a little) until it gives something, or
    raise ``TimeoutError(what())`` after ``timeout`` seconds."""
    start = time.perf_counter()
    spins = 1
    while (result := attempt()) is None:
        if time.perf_counter() - start > timeout:
            raise TimeoutError(what())
        spins = backoff(spins)
    return result


_fence_lock = threading.Lock()


def _fence() -> None:
    """A full memory barrier on x86-64: a lock and unlock (an atomic read-modify-write, which
    x86 orders against every earlier store and later load). See ``_LOCK_FREE``."""
    _fence_lock.acquire()
    _fence_lock.release()


_LOCK_FREE = platform.machine().lower() in ("x86_64", "amd64")
"""Whether the producer takes slots without the control block's lock (the store, fence, load
handshake of :meth:`Channel._take` and :meth:`Subscription._claim`); elsewhere it takes the lock,
since ``_fence`` is a full barrier only under x86's memory order."""

_VERSION, _NEWEST, _WRITING, _WRITTEN = 0, 1, 2, 3
"""A producer's state is one int64 array, read and written in place by graphtree/_native's
channel functions and by their Python twins: the newest version, the slot holding it (-1: none
yet), the slot being written (-1: none), then from ``_WRITTEN`` on the version last committed in
each slot."""

_AGAIN = object()
"""What ``_native.channel_write`` returns when the Python path must decide (see
:meth:`GraphedWriter.__call__`)."""


class _CurrentStream:
    """``current()``: torch's current stream on ``device``, cheaply; ``raw()``: its handle.

    ``torch.cuda.current_stream`` builds a new ``Stream`` object on each call (3.1 µs on the H100
    host); the raw handle costs 0.17 µs, so the objects are kept by handle (a few streams at most)."""

    def __init__(self, device: torch.device) -> None:
        self._device = device.index
        self._raw = _torch.raw_stream_getter() if device.type == "cuda" else None
        self._known: dict[int, torch.cuda.Stream] = {}

    def raw(self) -> int:
        return 0 if self._raw is None else self._raw(self._device)

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


class _Order:
    """The GPU side of a channel's ordering: the ``ready`` cells written and waited for on streams.

    ``mark(stream, s, v)`` queues ``ready[s] = v`` on ``stream`` (a raw handle) after the work
    queued there; ``wait(stream, s, v)`` makes ``stream`` wait until ``ready[s] >= v``;
    ``read_end(stream)`` is an event whose ``query()`` says the work queued so far is done.
    ``view`` is the whole block as an int64 tensor (on the GPU: its registered mapping) and
    ``marks[s]`` the cell numbers ``(pending[s], ready[s])`` in it, for a recording that writes
    ``ready[s]`` itself. With CPU buffers (tests of the bookkeeping) the cells are written and
    read directly."""

    def __init__(self, block: ControlBlock, cells: ChannelCells, device: torch.device) -> None:
        self._block = block
        self._ready = cells.ready
        self.cuda = device.type == "cuda"
        self.marks = list(zip(cells.pending, cells.ready, strict=True))
        if not self.cuda:
            self.view = torch.frombuffer(block.cells, dtype=torch.int64)
            return
        from cuda.bindings import driver

        self.view = block.gpu_cells(device.index)
        self._addresses = [block.device_address(r) for r in cells.ready]
        self._write_value = driver.cuStreamWriteValue64
        self._wait_value = driver.cuStreamWaitValue64
        self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self._ok = driver.CUresult.CUDA_SUCCESS

    def mark(self, stream: int, s: int, v: int) -> None:
        if not self.cuda:
            self._block.cells[self._ready[s]] = v
            return
        (err,) = self._write_value(stream, self._addresses[s], v, 0)
        if err != self._ok:
            raise RuntimeError(f"cuStreamWriteValue64 of a channel's ready cell failed: {err!r}")

    def wait(self, stream: int, s: int, v: int) -> None:
        if not self.cuda:
            return  # mark() wrote the cell already
        (err,) = self._wait_value(stream, self._addresses[s], v, self._geq)
        if err != self._ok:
            raise RuntimeError(f"cuStreamWaitValue64 on a channel's ready cell failed: {err!r}")

    def read_end(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event


class Channel:
    """The producer's side of a channel: rotate through ``slots`` buffers, one version at a time.

    Made by :meth:`graphtree.share.Publisher.channel`. Example::

        ch = pub.channel("logits", (8, 32000), torch.float16, slots=3)
        for x in batches:
            torch.matmul(x, w, out=ch.next())   # or ch.graphed(step) for a graphed step
            ch.commit()

    ``version`` is the newest version published; ``waits`` counts the versions for which no slot
    was free at once and the CPU waited (slow readers, or a GPU ``slots - 1`` versions behind):
    more slots, or faster readers, bring it down.
    """

    def __init__(
        self,
        name: str,
        index: int,
        buffers: list[torch.Tensor],
        block: ControlBlock,
        reap: Callable[[], None],
    ) -> None:
        self.name = name
        self.index = index
        self.buffers = buffers
        self.device = buffers[0].device
        self._stream = _CurrentStream(self.device)
        self._block = block
        self._reap = reap
        n = len(buffers)
        self._cells = block.channel_cells(index, n)
        self._order = _Order(block, self._cells, self.device)
        self._state = array.array("q", [0, -1, -1] + [0] * n)  # see _VERSION
        self.waits = 0
        # the slots to try after the newest is in slot k (key -1: none yet); one slot: itself;
        # each with its cell numbers: reading, ready, version, pending
        c = self._cells
        self._plan = {
            k: [
                (s, c.reading[s], c.ready[s], c.version[s], c.pending[s])
                for s in ((k + i) % n for i in range(1, n + 1))
                if s != k or n == 1
            ]
            for k in range(-1, n)
        }
        self._publishing = [(c.version[s], c.latest) for s in range(n)]  # the cells _publish writes
        # the same two tables packed as int64 for the native functions: the plans in order of k,
        # each padded to n steps (slot -1: none)
        none = (-1, 0, 0, 0, 0)
        padded = [x for k in range(-1, n) for step in self._plan[k] + [none] * (n - len(self._plan[k])) for x in step]
        self._packed_plans = array.array("q", padded).tobytes()
        self._packed_publishing = array.array("q", [x for pair in self._publishing for x in pair]).tobytes()
        if self.device.type == "cuda":
            _native.start()  # its channel_take, channel_publish and channel_write replace the Python steps

    @property
    def version(self) -> int:
        """The newest version published (0: none yet)."""
        return self._state[_VERSION]

    def next(self, *, timeout: float = 5.0) -> torch.Tensor:
        """The buffer to write the next version into: a slot no consumer reads and whose last
        version this GPU has written (the CPU waits up to ``timeout`` seconds for one)."""
        return self.buffers[self._begin(timeout)]

    def _begin(self, timeout: float) -> int:
        """Take the slot to write the next version into (see :meth:`next`), marked as being written."""
        if self._state[_WRITING] >= 0:
            raise RuntimeError(f"channel {self.name!r}: commit() the version being written before next()")
        s = self._take()
        if s is None:
            self.waits += 1
            s = _poll(
                self._take_or_reap,
                timeout,
                lambda: (
                    f"channel {self.name!r}: every slot is being read after {timeout} s "
                    "(or this GPU has not yet written the versions in them)"
                ),
            )
        return s

    def commit(self) -> int:
        """Publish what was written into :meth:`next`'s buffer as the newest version (stream-ordered)."""
        state = self._state
        s = state[_WRITING]
        if s < 0:
            raise RuntimeError(f"channel {self.name!r}: next() gives the buffer to write before commit()")
        self._order.mark(self._stream.raw(), s, state[_VERSION] + 1)
        return self._publish()

    def graphed(
        self, fn: Callable[..., Any], *, out: str = "out", timeout: float = 5.0, **options: Any
    ) -> GraphedWriter:
        """``fn`` recorded by graphtree, each call writing its result into the next version.

        ``fn`` must write its result into the keyword argument ``out`` (as ``torch.mm(...,
        out=out)`` does); each call takes a slot (:meth:`next`), calls the graphed ``fn`` with
        ``out=`` that slot's buffer, and publishes the version. The write of the slot's ``ready``
        cell is recorded with ``fn``, so a replayed version costs no CUDA call but the replay.
        ``options`` are :func:`graphtree.graphed`'s. Calls are made on one stream (the
        recordings' ``ready`` writes are ordered by it).

        Example::

            publish = ch.graphed(model.decode_step)      # decode_step(tokens, pos, out=None)
            logits = publish(tokens, pos)                # the version's tensor (the slot's buffer)
        """
        return GraphedWriter(self, fn, out=out, timeout=timeout, **options)

    def _publish(self) -> int:
        """Publish the slot being written as the newest version; that version."""
        # No lock: only this thread writes these cells, the slot's version first. A consumer
        # that sees the new ``latest`` then finds its slot (or, where stores may be reordered,
        # finds none and looks again); claims are checked against _take (see _claim).
        native = _native.loaded
        if native is not None:
            return native.channel_publish(self._block.cells, self._state, self._packed_publishing)
        cells, state = self._block.cells, self._state
        s, v = state[_WRITING], state[_VERSION] + 1
        version, latest = self._publishing[s]
        state[_WRITTEN + s] = v
        cells[version] = v
        cells[latest] = v
        state[_VERSION], state[_NEWEST], state[_WRITING] = v, s, -1
        return v

    def _abandon(self) -> None:
        """Give up the version being written (its writer raised): the slot is not published."""
        self._state[_WRITING] = -1

    def _writer(self, call: Callable[..., Any], out: str) -> tuple[Any, ...]:
        """What ``_native.channel_write`` needs to take a slot, call ``call`` with ``out=`` its
        buffer and publish it, in one C call (see :meth:`GraphedWriter.__call__`)."""
        return (
            self._block.cells,
            self._state,
            self._packed_plans,
            self._packed_publishing,
            tuple(self.buffers),
            call,
            out,
            _AGAIN,
        )

    def _take_or_reap(self) -> int | None:
        taken = self._take()
        if taken is None:
            self._reap()  # a consumer killed while reading holds its slot until reaped
        return taken

    def _take(self) -> int | None:
        """A slot nobody reads and whose last version the GPU has written, never the newest
        (readers may want it), marked as being written, with ``pending`` set to the next version.

        Lock-free on x86-64: mark the slot (version -1), fence, then look again for a claim. A
        consumer sets its claim, fences, then checks the version (see :meth:`Subscription._claim`):
        of two such store-fence-load sequences at least one sees the other's store, so the slot
        is either taken here or read there, never both. (The hot path of every version: cell
        numbers come precomputed per slot.)"""
        if not _LOCK_FREE:
            return self._take_locked()
        native = _native.loaded
        if native is not None:  # the same steps in C++ (graphtree/_native), 4-5x faster
            s = native.channel_take(self._block.cells, self._state, self._packed_plans)
            return None if s < 0 else s
        cells, state = self._block.cells, self._state
        for s, reading, ready, version, pending in self._plan[state[_NEWEST]]:
            if cells[reading] or cells[ready] < state[_WRITTEN + s]:
                continue
            before = cells[version]
            cells[version] = -1
            _fence_lock.acquire()  # _fence(), inline
            _fence_lock.release()
            if cells[reading]:  # a consumer claimed it meanwhile: it keeps it
                cells[version] = before
                continue
            cells[pending] = state[_VERSION] + 1
            state[_WRITING] = s
            return s
        return None

    def _take_locked(self) -> int | None:
        """:meth:`_take` under the control block's lock (where ``_fence`` is not a full barrier)."""
        block, state = self._block, self._state
        block.acquire()
        try:
            cells = block.cells
            for s, reading, ready, version, pending in self._plan[state[_NEWEST]]:
                if cells[reading] or cells[ready] < state[_WRITTEN + s]:
                    continue
                cells[version] = -1
                cells[pending] = state[_VERSION] + 1
                state[_WRITING] = s
                return s
            return None
        finally:
            block.release()


class GraphedWriter:
    """A function recorded by graphtree that writes each call's result as a channel's next version.

    Made by :meth:`Channel.graphed`; called like the function, without ``out=``; returns what
    the function returns (the slot's buffer when it returns its ``out``)."""

    def __init__(self, channel: Channel, fn: Callable[..., Any], *, out: str, timeout: float, **options: Any) -> None:
        import graphtree

        if not callable(fn):
            raise TypeError(f"Channel.graphed needs a callable, got {type(fn).__name__}")
        self.channel = channel
        self._out = out
        self._timeout = timeout
        owner = getattr(fn, "__self__", None)  # a module of a bound method, kept in the closure:
        # graphtree finds the module's parameters there
        slots = {t.data_ptr(): s for s, t in enumerate(channel.buffers)}
        marks, cells = channel._order.marks, channel._order.view  # cells: a tensor in the closure,
        # so graphtree reads it in place as state (checked natively per replay), not as an
        # "external" (a weak reference checked in Python, and no fast path)

        def write(*args: Any, **kwargs: Any) -> Any:
            _ = owner
            result = fn(*args, **kwargs)
            # after fn's writes, on its stream: "version written". The slot's cells are found from
            # its buffer (not passed as arguments: each tensor argument costs every replay ~3 µs)
            pending, ready = marks[slots[kwargs[out].data_ptr()]]
            torch.add(cells[pending], 0, out=cells[ready])
            return result

        options.setdefault("name", getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "write"))
        self._call = graphtree.graphed(write, **options)
        self._native = channel._writer(self._call, out) if _LOCK_FREE else None
        for t in channel.buffers:
            graphtree.mark_static(t)

    def __repr__(self) -> str:
        return f"<graphtree.share GraphedWriter of channel {self.channel.name!r}: {self._call!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Take, call, publish: in one C call once graphtree's native helpers are loaded (these
        # Python steps cost the producer ~1.5 µs per version on the H100's host); it hands back to
        # them where it cannot go on alone (no slot free now, out= given, a slot being written).
        native = _native.loaded
        if native is not None and self._native is not None:
            result = native.channel_write(self._native, args, kwargs)
            if result is not _AGAIN:
                return result
        if self._out in kwargs:
            raise TypeError(f"channel {self.channel.name!r} gives {self._out}= itself (the next slot's buffer)")
        ch = self.channel
        s = ch._begin(self._timeout)
        kwargs[self._out] = ch.buffers[s]
        try:
            result = self._call(*args, **kwargs)
        except BaseException:
            ch._abandon()
            raise
        ch._publish()
        return result


class Subscription:
    """A consumer's side of a channel: read its newest versions (see :meth:`read`).

    Made by :meth:`graphtree.share.Attached.channel`.
    """

    def __init__(
        self,
        name: str,
        index: int,
        buffers: list[torch.Tensor],
        membership: Membership,
        producer_pid: int,
    ) -> None:
        self.name = name
        self.index = index
        self.buffers = buffers
        self.device = buffers[0].device
        self._bit = 1 << membership.index
        self._membership = membership  # kept: this consumer stays registered while it can read
        self._producer_pid = producer_pid
        self._stream = _CurrentStream(self.device)
        block = self._block = membership.block
        self._cells = block.channel_cells(index, len(buffers))
        self._ordering: _Order | None = None  # made on the first read (it registers the block with CUDA)
        self.last = 0  # the newest version this consumer has read

    @property
    def _order(self) -> _Order:
        if self._ordering is None:
            self._ordering = _Order(self._block, self._cells, self.device)
        return self._ordering

    @property
    def latest(self) -> int:
        """The newest version the producer has committed (0 before any)."""
        return self._block.cells[self._cells.latest]

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
        if not self._order.cuda:  # CPU buffers (tests of the bookkeeping): nothing to wait for
            try:
                yield Frame(self.buffers[s], v)
            finally:
                self.last = v
                self._unclaim(s)
            return
        stream = self._stream.current()
        # followed from now, not from the block's end: while this GPU waits for the version,
        # a CUDA call of this thread may block too (a kernel's first launch loads its module,
        # which waits for the device), so a producer that died before its GPU wrote the version
        # must be noticed by another thread
        read = self._release_of(s, v)
        release = releaser()
        release.follow(read)
        try:
            self._order.wait(stream.cuda_stream, s, v)
            yield Frame(self.buffers[s], v)
        finally:
            self.last = v
            release.end(read, self._order.read_end(stream))

    def _claim(self, after: int) -> tuple[int, int] | None:
        """Claim the slot of the newest version for this consumer, if it is newer than ``after``."""
        block, cells, c = self._block, self._block.cells, self._cells
        if cells[c.latest] <= after:  # unlocked peek: a stale value only delays the claim
            return None
        block.acquire()  # against other consumers' read-modify-writes of the masks
        try:
            v = cells[c.latest]
            for s, cell in enumerate(c.version):
                if cells[cell] == v:
                    cells[c.reading[s]] |= self._bit
                    break
            else:
                return None
        finally:
            block.release()
        _fence()
        if cells[c.version[s]] != v:  # the producer took the slot meanwhile (Channel._take)
            self._unclaim(s)
            return None
        return s, v

    def _release_of(self, s: int, v: int) -> Read:
        """The read of version ``v`` in slot ``s`` as the release thread follows it."""
        return Read(
            functools.partial(self._written, s, v),
            functools.partial(self._unblock_if_producer_died, s, v),
            release=functools.partial(self._unclaim, s),
        )

    def _written(self, s: int, v: int) -> bool:
        """Whether the producer's GPU wrote version ``v`` of slot ``s`` (its ``ready`` cell)."""
        return self._block.cells[self._cells.ready[s]] >= v

    def _unclaim(self, s: int) -> None:
        block, cells = self._block, self._block.cells
        try:
            block.acquire()
        except ValueError:  # this consumer left already: the producer drops its claims
            return
        try:
            cells[self._cells.reading[s]] &= ~self._bit
        finally:
            block.release()

    def _unblock_if_producer_died(self, s: int, v: int) -> bool:
        """If the producer died before its GPU wrote version ``v``, write the ready cell from
        here so that this process's GPU stops waiting (the version's data is incomplete)."""
        cells = self._block.cells
        if self._block.closed or cells[self._cells.ready[s]] >= v or alive(self._producer_pid):
            return False
        cells[self._cells.ready[s]] = v
        log.warning(
            "graphtree.share: the producer (pid %d) of channel %r died before its GPU wrote version %d; "
            "this process's GPU no longer waits for it, and what it read of that version is incomplete",
            self._producer_pid,
            self.name,
            v,
        )
        return True
