"""One tree's memory: its pool, its side stream, and whether the allocator's view of the pool is exact.

Replays do not go through the allocator: once one ran, the caching allocator's view of the pool
is that of the checkpoint the tree last recorded or warmed up from, not what the replays left
alive. Before the tree warms up or records again, :meth:`TreeMemory.sync` restores the view to the
checkpoint of the node the step stands on, telling the allocator which of the outputs of the
path's nodes the caller still holds (:meth:`graphtree.tree.pool.Pool.restore`).

Example (what :class:`~graphtree.tree.manager.TreeManager` does before a recording)::

    memory = TreeMemory(device=0)
    memory.live = False     # a replay ran
    memory.sync(walk)       # the allocator sees what the path's nodes left alive
"""

from __future__ import annotations

import weakref

import torch

from graphtree import _streams
from graphtree.tree.node import Root
from graphtree.tree.pool import Pool
from graphtree.tree.stats import log
from graphtree.tree.walk import Walk


class TreeMemory:
    """The pool a tree's recordings share (made at its first warm-up or recording, replaced after a
    failed capture) and the stream they run on, on one device."""

    __slots__ = ("__weakref__", "_pool", "_stream", "device", "live")  # (live set natively: fast_hit.h)

    def __init__(self, device: int) -> None:
        self.device = device
        self.live = True  # the allocator's view of the pool is exact (False once a replay ran)
        self._pool: Pool | None = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(self.device)
            self._pool.root_state()
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # (its own: torch's pooled streams repeat, graphtree/_streams.py)
            self._stream = _streams.own_stream(self.device)
            weakref.finalize(self, _streams.give_back, self._stream)
        return self._stream

    @property
    def has_pool(self) -> bool:
        return self._pool is not None

    def reserved_bytes(self) -> int:
        """Bytes the pool holds on the device (0 before the first recording)."""
        return self._pool.reserved_bytes() if self._pool is not None else 0

    def breakdown(self) -> str:
        """Where the pool's bytes go (:meth:`Pool.breakdown`), or "" before the first recording."""
        return self._pool.breakdown() if self._pool is not None else ""

    def sync(self, walk: Walk) -> None:
        """Restore the pool's bookkeeping to the checkpoint of the node ``walk`` stands on, if
        replays moved on since it was exact."""
        if self.live:
            return
        node = walk.current
        if isinstance(node, Root):
            self.pool.restore(self.pool.root_state(), [], [])
        else:
            live: list[int] = []
            dead: set[int] = set()
            for d, g in node.alive_at_checkpoint:
                owner = walk.path[d]
                if owner.live.is_held(g):
                    live.append(owner.live.refs[g])
                    owner.live.drop_base()  # the storage gets a deleter: only the caller may keep it
                else:
                    dead.add(owner.outputs.groups[g].ptr)
            self.pool.restore(node.checkpoint, live, sorted(dead))
        self.live = True

    def retire(self, walk: Walk, quiet: bool = False) -> None:
        """Move to a fresh pool and an empty tree (a capture failed); keep the old ones until the
        step ends."""
        walk.retire(self._pool)
        self.release()
        (log.info if quiet else log.warning)(
            "graphtree: a capture failed on cuda:%d; recordings start again in a new memory pool", self.device
        )

    def release(self) -> None:
        """Let the pool go (the tree has no recording left in it): the next recording makes a new one."""
        self._pool = None
        self.live = True
