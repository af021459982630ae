"""graphtree's own streams (graphtree/_streams.py): torch's pooled streams repeat, graphtree's do not."""

from __future__ import annotations

import torch

from graphtree import _streams


def test_torch_hands_out_a_stream_again_and_graphtree_streams_are_never_among_them():
    pooled = [torch.cuda.Stream().cuda_stream for _ in range(80)]
    assert len(set(pooled)) < len(pooled)  # the round-robin pool repeats (why _streams exists)
    mine = [_streams.own_stream(0) for _ in range(3)]
    try:
        handles = {s.cuda_stream for s in mine}
        assert len(handles) == 3 and not handles & set(pooled)
        assert not handles & {torch.cuda.Stream().cuda_stream for _ in range(80)}
        with torch.cuda.stream(mine[0]):  # usable as any stream, a capture included
            g = torch.cuda.CUDAGraph()
            x = torch.ones(4, device="cuda")
            g.capture_begin()
            y = x * 2
            g.capture_end()
        torch.cuda.current_stream().wait_stream(mine[0])
        x.fill_(3)
        g.replay()
        assert torch.equal(y, torch.full((4,), 6.0, device="cuda"))
    finally:
        for s in mine:
            _streams.give_back(s)
    again = _streams.own_stream(0)  # a stream given back is handed out again
    assert again.cuda_stream in handles
    _streams.give_back(again)
