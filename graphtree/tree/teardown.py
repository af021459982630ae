"""Every recording dropped before torch.distributed's process groups are torn down.

NCCL cannot destroy a communicator while a CUDA graph that captured one of its collectives exists
(``ncclCommDestroy`` waits for it: pytorch/pytorch#115388); :func:`graphtree.tree.lockstep.release_before_teardown`
runs :func:`drop_all` first. See tree/DESIGN.md, "Teardown".

Example::

    release_before_teardown(drop_all)   # once a graphed function is seen calling collectives
"""

from __future__ import annotations

from graphtree.tree import manager
from graphtree.tree.stats import log

WAIT = 10.0
"""Seconds to wait for a tree another thread is running a call in (it may wait on a peer)."""


def drop_all() -> None:
    """Every tree's recordings dropped (held outputs invalidated, counters kept), without waiting
    for the device; a tree busy in another thread for :data:`WAIT` seconds keeps them, with a warning."""
    for m in manager.managers():
        if not m.drop("torch.distributed's process groups were torn down", wait=WAIT):
            log.warning(
                "graphtree: a graphed call in thread %s kept its recordings through the teardown of the "
                "process groups (it held its tree for %g s); torch.distributed may wait for them",
                m.thread,
                WAIT,
            )
