"""A tree's calls wait for the stream of the last call when they come on another one (issue 44:
torch's test_graph_concurrent_replay, ported, summed wrong when two recordings of one pool replayed
at once on two streams). The GPU test is the ported one; here the decisions, with fake streams."""

from __future__ import annotations

import torch

from graphtree import _torch
from graphtree.tree import launch_order


class _Stream:
    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.waited: list[int] = []

    def wait_stream(self, other: _Stream) -> None:
        self.waited.append(other.handle)


def test_a_call_waits_for_the_last_calls_stream_only_when_the_stream_changes(monkeypatch):
    streams = {h: _Stream(h) for h in (0, 7, 9)}
    now = {"handle": 0, "capturing": False}
    monkeypatch.setattr(_torch, "raw_stream_getter", lambda: lambda device: now["handle"])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: streams[now["handle"]])
    monkeypatch.setattr(_torch, "stream_capturing", lambda stream: now["capturing"])
    order = launch_order.LaunchOrder(0)

    order.follow()  # the legacy default stream first (handle 0): nothing to wait for
    order.follow()
    now["handle"] = 7
    order.follow()  # another stream: it waits for the default one
    order.follow()  # the same again: no second wait
    now["handle"] = 9
    now["capturing"] = True
    order.follow()  # a capturing stream cannot wait on work outside its capture: left alone
    now["capturing"] = False
    order.follow()
    now["handle"] = 0
    order.follow()
    assert streams[0].waited == [9]
    assert streams[7].waited == [0]
    assert streams[9].waited == [7]


def test_without_cuda_nothing_is_ordered(monkeypatch):
    monkeypatch.setattr(_torch, "raw_stream_getter", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: (_ for _ in ()).throw(AssertionError))
    order = launch_order.LaunchOrder(0)
    order.follow()
    order.follow()
