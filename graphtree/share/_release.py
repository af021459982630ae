"""The release thread of a consumer process: it ends the reads of ``graphtree.share`` channels.

A :class:`Read` is one ``Subscription.read()`` block as this thread follows it; the subscription
hands it three callables (is the version written, unblock if the producer died, drop the claim),
so that this module knows nothing of the control block's cells. :class:`Releaser` is the thread;
:func:`releaser` starts it once per process (again in a forked child), :func:`drain_reads` waits
for the claims of ended reads to go.

Example::

    read = Read(is_written, unblock_if_producer_died, release=drop_claim)
    releaser().follow(read); ...; releaser().end(read, event)
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

__all__ = ["Read", "Releaser", "backoff", "drain_reads", "releaser"]

log = logging.getLogger("graphtree")


class Read:
    """One ``read()`` block of a consumer as the release thread follows it: first until the
    producer's GPU wrote the version (``is_written()``, a look at the ``ready`` cell on the CPU;
    every 100 ms meanwhile ``unblock_if_producer_died()``), then, once the block ended (``end``:
    an event after the GPU work queued inside it), until that work is done; then ``release()``
    drops the claim on the slot.

    Example::

        read = Read(lambda: True, lambda: False, release=lambda: None)
    """

    __slots__ = ("end", "release", "written", "_check", "_is_written", "_unblock")

    def __init__(
        self, is_written: Callable[[], bool], unblock_if_producer_died: Callable[[], bool], release: Callable[[], None]
    ) -> None:
        self._is_written, self._unblock, self.release = is_written, unblock_if_producer_died, release
        self.end: Any = None  # an event (anything with query()), set when the block ends
        self.written = False
        self._check = time.monotonic() + _LIVENESS_CHECK

    @property
    def idle(self) -> bool:
        """Nothing to poll: the version is written and the block has not ended."""
        return self.written and self.end is None

    def over(self) -> bool:
        """Whether the claim may be dropped (a step of polling: no wait)."""
        if not self.written:
            if self._is_written():
                self.written = True
            elif time.monotonic() > self._check:
                self._check = time.monotonic() + _LIVENESS_CHECK
                self.written = self._unblock()
            if not self.written:
                return False
        return self.end is not None and bool(self.end.query())


_LIVENESS_CHECK = 0.1
"""Seconds between checks that the producer lives, while a version it published is not yet written."""

_WAKE = object()


class Releaser:
    """The thread of a consumer process that ends reads (:class:`Read`): it drops a read's claim
    on its slot once the producer's GPU wrote the version and the GPU work queued inside the
    ``read()`` block is done, so that the producer may write the slot again; and it writes the
    ``ready`` cell itself if the producer died before its GPU did (checked every 100 ms while
    waiting), which would otherwise leave this process's GPU waiting for ever. It polls (a short
    spin, then sleeps of up to 1 ms) only while a read needs it; open blocks whose version is
    written cost nothing."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="graphtree-share-release", daemon=True)
        self._thread.start()

    def follow(self, read: Read) -> None:
        """Follow a read from the moment its GPU wait is queued."""
        self._queue.put(read)

    def end(self, read: Read, event: Any) -> None:
        """The read's block ended; ``event`` completes after the GPU work queued inside it."""
        read.end = event
        self._queue.put(_WAKE)

    def drain(self, timeout: float) -> bool:
        """Wait until the reads whose block ended so far have dropped their claims (False after
        ``timeout`` seconds)."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def _run(self) -> None:
        from graphtree.share._memory import _relaxed_capture_mode

        reads: list[Read] = []
        drains: list[tuple[threading.Event, list[Read]]] = []
        spins = 0
        # its event queries must not end another thread's capture (none without CUDA)
        with _relaxed_capture_mode() if torch.cuda.is_available() else nullcontext():
            while True:
                # nothing to poll: sleep until a read starts or ends
                items = [self._queue.get()] if all(r.idle for r in reads) else []
                while True:
                    try:
                        items.append(self._queue.get_nowait())
                    except queue.Empty:
                        break
                for item in items:
                    if isinstance(item, Read):
                        reads.append(item)
                    elif isinstance(item, threading.Event):
                        drains.append((item, [r for r in reads if r.end is not None]))
                progressed = bool(items)
                for read in [r for r in reads if self._over(r)]:
                    reads.remove(read)
                    read.release()
                    progressed = True
                for done, waited in drains:
                    if not any(r in reads for r in waited):
                        done.set()
                drains = [(d, w) for d, w in drains if not d.is_set()]
                spins = 0 if progressed else backoff(spins)

    @staticmethod
    def _over(read: Read) -> bool:
        try:
            return read.over()
        except ValueError:  # the consumer closed its block meanwhile
            return True
        except Exception:  # a broken context: drop the claim all the same
            log.exception("graphtree.share: following a read failed")
            return True


def backoff(spins: int) -> int:
    """Yield the CPU, then sleep a little longer each time (up to 1 ms); the next count."""
    if spins > 200:
        time.sleep(min(1e-3, 1e-5 * spins / 200))
    else:
        os.sched_yield()
    return spins + 1


_the_releaser: Releaser | None = None
_releaser_lock = threading.Lock()


def _forget_releaser() -> None:  # a forked child has no thread of its parent's
    global _the_releaser
    _the_releaser = None


os.register_at_fork(after_in_child=_forget_releaser)


def releaser() -> Releaser:
    """The release thread of this process (started at the first read)."""
    global _the_releaser
    if _the_releaser is None:
        with _releaser_lock:
            if _the_releaser is None:
                _the_releaser = Releaser()
    return _the_releaser


def drain_reads(timeout: float = 5.0) -> bool:
    """Wait until every read this process ended has dropped its claim (False after ``timeout``)."""
    return _the_releaser is None or _the_releaser.drain(timeout)
