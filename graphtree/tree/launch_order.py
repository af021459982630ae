"""The order of one tree's launches across streams.

The recordings of a tree share one memory pool, whose blocks are reused from one recording to the
next in the order they were recorded: two recordings replayed at once on two streams would write
each other's memory (torch's ``test_graph_concurrent_replay``, ported in
``tests/gpu/test_ported_test_cuda_gpu.py``, summed wrong). A graphed call replays on the caller's
current stream; :class:`LaunchOrder` makes a call on another stream than the last call's wait for
that stream first, so that the pool's work runs in the order it was queued, as eager work on one
stream would.

Example (what :class:`graphtree.tree.manager.TreeManager` does on every call)::

    order = LaunchOrder(device)
    order.follow()     # before the call's replay, warm-up or recording
"""

from __future__ import annotations

import torch

from graphtree import _torch


class LaunchOrder:
    """The stream a tree's last call ran on, on ``device``; :meth:`follow` orders the next after it."""

    __slots__ = ("_last", "_last_raw", "_raw_stream", "device")  # (read natively at their offsets: fast_hit.h)

    def __init__(self, device: int) -> None:
        self.device = device
        self._raw_stream = _torch.raw_stream_getter()  # (None on a build without CUDA)
        self._last: torch.cuda.Stream | None = None
        self._last_raw = -1  # (none yet: the legacy default stream's handle is 0)

    def unchanged(self) -> bool:
        """Whether :meth:`follow` has nothing to do: the current stream is the last call's."""
        return self._raw_stream is None or self._raw_stream(self.device) == self._last_raw

    def follow(self) -> None:
        """Make the current stream wait for the last call's, when it is another one (an event; the
        check costs one call into torch, 0.2 µs). Not inside a capture, whose own stream is current
        and cannot wait on work queued outside it."""
        if self._raw_stream is None:  # (a build without CUDA: no streams to order)
            return
        raw = self._raw_stream(self.device)
        if raw == self._last_raw:
            return
        stream = torch.cuda.current_stream(self.device)
        if _torch.stream_capturing(stream):
            return
        if self._last is not None:
            stream.wait_stream(self._last)
        self._last, self._last_raw = stream, raw
