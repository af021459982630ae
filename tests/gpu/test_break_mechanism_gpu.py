"""What breakable recordings (issue 26) will rest on, checked on torch as it is, before graphtree
builds on it:

1. a capture can be ended from inside a ``TorchDispatchMode`` at a host read (``.item()`` is
   ``aten::_local_scalar_dense``), what was captured replayed, the value read, and the rest of the
   same Python call captured into a second graph of the same pool, reading the first one's
   tensors in place; replaying both, with the read in between, equals eager;
2. the caching allocator is deterministic: the same code captured again into the pool, from the
   same state of it, gets the same addresses (what lets a new value's branch be recorded later
   against a segment that was recorded before).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

DEV = "cuda"
_ITEM = torch.ops.aten._local_scalar_dense.default


class _Segments(TorchDispatchMode):
    """Capture a call as segments: a host read ends one graph and begins the next."""

    def __init__(self, pool: tuple[int, int]) -> None:
        super().__init__()
        self.pool = pool
        self.graphs = [torch.cuda.CUDAGraph()]
        self.read: list[torch.Tensor] = []  # the tensor each break reads (kept: a segment's output)
        self.values: list[object] = []
        self.live_at_break: list[list[int]] = []  # addresses the next segment may read

    def begin(self) -> None:
        self.graphs[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graphs[-1].capture_end()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _ITEM:
            return func(*args, **kwargs)
        self.end()
        self.graphs[-1].replay()  # the capture ran nothing: compute what the read needs
        value = func(*args, **kwargs)  # the host read itself, eagerly
        self.read.append(args[0])
        self.values.append(value)
        self.graphs.append(torch.cuda.CUDAGraph())
        self.begin()
        return value


def _f(x: torch.Tensor, trace: list[int] | None = None) -> torch.Tensor:
    y = x * 2
    if trace is not None:
        trace.append(y.data_ptr())
    if y.sum().item() > 0:  # a host read that decides what runs next
        return (y + 1).relu()
    return (y - 1).abs()


def _record(
    x: torch.Tensor, pool: tuple[int, int], side: torch.cuda.Stream, trace: list[int] | None = None
) -> tuple[_Segments, torch.Tensor]:
    side.wait_stream(torch.cuda.current_stream())
    segments = _Segments(pool)
    with torch.cuda.stream(side):
        segments.begin()
        with segments:
            out = _f(x, trace)
        segments.end()
        segments.graphs[-1].replay()  # the last segment was captured, not run: run it, as a recording does
    torch.cuda.current_stream().wait_stream(side)
    return segments, out


def test_a_capture_ended_at_a_host_read_goes_on_in_a_second_graph_of_the_same_pool():
    torch.manual_seed(0)
    x = torch.rand(1 << 16, device=DEV)  # positive: the first branch
    _f(x)  # warm up (kernels loaded, cuBLAS/cuDNN handles made) outside the capture
    pool = torch.cuda.graph_pool_handle()
    segments, out = _record(x, pool, torch.cuda.Stream())
    assert len(segments.graphs) == 2 and segments.values and segments.values[0] > 0
    torch.testing.assert_close(out, _f(x))
    for _ in range(3):  # replay: segment 1, the same host read, the branch recorded for its value
        fresh = torch.rand(1 << 16, device=DEV)
        x.copy_(fresh)
        segments.graphs[0].replay()
        assert segments.read[0].item() > 0, "the read on replay picks the recorded branch"
        segments.graphs[1].replay()
        torch.testing.assert_close(out, _f(fresh))
    x.copy_(-torch.rand(1 << 16, device=DEV))  # a value of the other branch: the read says so
    segments.graphs[0].replay()
    assert segments.read[0].item() < 0


def test_the_same_code_captured_again_from_the_same_pool_state_gets_the_same_addresses():
    x = torch.rand(1 << 16, device=DEV)
    _f(x)
    pool = torch.cuda.graph_pool_handle()
    keep = torch.cuda.CUDAGraph()  # holds the pool while the captures' tensors come and go
    with torch.cuda.graph(keep, pool=pool):
        pass
    traces = []
    side = torch.cuda.Stream()  # one stream, as a tree has: the allocator keeps its blocks per stream
    for _ in range(3):
        trace: list[int] = []
        segments, out = _record(x, pool, side, trace)
        trace += [segments.read[0].data_ptr(), out.data_ptr()]
        traces.append(trace)
        del segments, out  # everything of the capture dies: the pool is as it was before it
        torch.cuda.synchronize()
    assert traces[0] == traces[1] == traces[2], traces
