"""The one memory pool a tree's recordings share, with allocator checkpoints to branch.

A CUDA graph bakes in the addresses of every buffer it uses. All recordings of a tree draw
their memory from one private pool of PyTorch's caching allocator, so a recording made after
another one can reuse the other's freed intermediates instead of reserving memory of its own.

Replays do not go through the allocator, so after a replay the allocator's bookkeeping of the
pool no longer matches what is alive. Before the tree records (or warms up) again it restores
the bookkeeping to the checkpoint taken right after the recording it stands on, telling the
allocator which of that recording's outputs the caller still holds (:meth:`Pool.restore`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from graphtree import _torch


class Pool:
    """A private CUDA memory pool on one device, shared by every recording of one tree.

    Example::

        pool = Pool(device=0)
        with pool.allocating():            # eager work whose memory lands in the pool
            y = x * 2
        state = pool.checkpoint()
    """

    def __init__(self, device: int) -> None:
        self.device = device
        self.id: tuple[int, int] = torch.cuda.graph_pool_handle()
        # An empty recording holds the pool open for as long as this object lives; once it and
        # every node's graph are gone, torch.cuda.empty_cache() can give the memory back.
        self._keepalive = torch.cuda.CUDAGraph()
        _torch.capture_empty(self._keepalive, device, self.id, isolated=True)
        self._root_state: Any = None

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Route this thread's allocations on the pool's device into the pool."""
        _torch.begin_allocate_to_pool(self.device, self.id)
        try:
            yield
        finally:
            _torch.end_allocate_to_pool(self.device, self.id)

    def checkpoint(self) -> Any:
        """The allocator's view of the pool now (which blocks are allocated)."""
        return _torch.checkpoint_pool(self.device, self.id)

    def root_state(self) -> Any:
        """The checkpoint of the pool before any recording: nothing of the tree allocated."""
        if self._root_state is None:
            self._root_state = self.checkpoint()
        return self._root_state

    def restore(self, state: Any, live: Sequence[int], dead_ptrs: Sequence[int]) -> None:
        """Make the allocator's view of the pool ``state`` again.

        ``live``: ``StorageImpl`` pointers of outputs in ``state`` that are still held (they get
        deleters, so dropping them frees their blocks); ``dead_ptrs``: addresses of blocks
        allocated in ``state`` whose outputs have died since (freed here).
        """
        _torch.restore_pool(self.device, state, live)
        for ptr in dead_ptrs:
            _torch.raw_delete(ptr)

    def segments(self) -> list[dict[str, Any]]:
        """The pool's segments as in ``torch.cuda.memory_snapshot``."""
        snap = torch.cuda.memory_snapshot()
        return [
            s for s in snap if tuple(s.get("segment_pool_id", ())) == tuple(self.id) and s.get("device") == self.device
        ]

    def reserved_bytes(self) -> int:
        """Bytes the pool holds from the device (its segments' sizes)."""
        return sum(int(s["total_size"]) for s in self.segments())

    def breakdown(self) -> str:
        """Where the pool's bytes go, for :func:`graphtree.describe`: its segments of small blocks (2 MiB
        each, for allocations under 1 MiB), its large segments, and what is allocated in them now
        (the outputs the caller may still hold; the rest is free for the next recordings)."""
        segs = self.segments()
        small = [int(s["total_size"]) for s in segs if s.get("segment_type") == "small"]
        large = sorted((int(s["total_size"]) for s in segs if s.get("segment_type") != "small"), reverse=True)
        allocated = sum(int(s["allocated_size"]) for s in segs)
        mib = 2**20
        sizes = ", ".join(f"{b / mib:.1f}" for b in large[:4]) + (", ..." if len(large) > 4 else "")
        return (
            f"{sum(small) / mib:.1f} MiB in {len(small)} small segment(s), {sum(large) / mib:.1f} MiB in "
            f"{len(large)} large ({sizes or 'none'} MiB); {allocated / mib:.1f} MiB allocated, the rest free"
        )

    def address_test(self) -> Callable[[int], bool]:
        """``test(ptr)``: whether ``ptr`` lies in one of the pool's segments as they are now."""
        ranges = [(int(s["address"]), int(s["address"]) + int(s["total_size"])) for s in self.segments()]
        return lambda ptr: any(lo <= ptr < hi for lo, hi in ranges)
