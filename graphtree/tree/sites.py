"""Which Python line made each node of a recording's graph, kept so that a profile started later
names the kernels of its replays (issue 29).

CUPTI names a kernel inside a replay by its node: the executable graph's id in the high 32 bits of
the node id, the node's index in the graph (creation order, which instantiation keeps) in the low
32 (`benchmarks/cupti_graph_ids.py`, H100, driver 580). A profiler subscribed while the graph was
captured sees each node made; one started later does not, and could only name the replay's call
site. So while recording, after each operation the capture graph's node count is read
(``cuStreamGetCaptureInfo``, ``cuGraphGetNodes``; ``cuda.bindings``): the nodes the operation
added are ``[before, after)``, made by the Python stack that ran it. :mod:`graphtree.profile`
turns these into the node ids of each recording's executable graph when it starts.

Costs two driver calls per operation and, for operations that add nodes, a walk of the Python
stack, while recording only (replays pay nothing). Without ``cuda.bindings`` nothing is kept and
profiles name such kernels by their replay, as before; any error of the bindings turns the
bookkeeping off for the rest of the process, never the recording. ``GRAPHTREE_NO_SITES=1`` turns it
off (``benchmarks/recording_cost.py`` measures it with and without).

Example::

    sites = CaptureSites()
    sites.after_op(stream_handle)          # inside a capture, after each operation
    kept = sites.take()                    # [(first node, end node, stack), ...]
"""

from __future__ import annotations

import os
import sys
from typing import Any

Frame = tuple[str, int, str]  # (filename, line, function)
Site = tuple[int, int, tuple[Frame, ...]]  # nodes [first, end) of one operation, its stack outermost first

_MAX_FRAMES = 64
_driver: Any = None  # cuda.bindings.driver once loaded; False when unavailable or broken


def _bindings() -> Any:
    global _driver
    if _driver is None:
        if os.environ.get("GRAPHTREE_NO_SITES"):  # to measure what the bookkeeping costs
            _driver = False
            return _driver
        try:
            from cuda.bindings import driver

            _driver = driver
        except Exception:  # noqa: BLE001 - optional: without it, nothing is kept
            _driver = False
    return _driver


_interned: dict[Any, Any] = {}  # stacks seen, shared: recordings of one model repeat them
_frames: dict[tuple[Any, int], Frame] = {}  # (code, instruction) -> its frame: f_lineno scans the line table
_MAX_CACHED = 200_000  # (code made at run time, exec'd or generated, would grow them without end)


def _stack(skip: int) -> tuple[Frame, ...]:
    if len(_frames) > _MAX_CACHED or len(_interned) > _MAX_CACHED:
        _frames.clear()
        _interned.clear()
    frames: list[Frame] = []
    f: Any = sys._getframe(skip)
    while f is not None and len(frames) < _MAX_FRAMES:
        code = f.f_code
        where = (code, f.f_lasti)
        frame = _frames.get(where)
        if frame is None:
            frame = _frames[where] = (code.co_filename, f.f_lineno or 0, code.co_name)
        frames.append(frame)
        f = f.f_back
    frames.reverse()
    stack = tuple(frames)
    return _interned.setdefault(stack, stack)  # type: ignore[no-any-return]


class CaptureSites:
    """The sites of one graph under capture (see the module docstring)."""

    def __init__(self) -> None:
        self.sites: list[Site] = []
        self._count = 0
        self.on = bool(_bindings())  # (False without cuda.bindings: nothing to do per operation)

    def after_op(self, stream: int) -> None:
        """An operation just ran (was captured) on ``stream``: note the nodes it added, if any."""
        global _driver
        driver = _driver if _driver is not None else _bindings()
        if not driver:
            return
        try:
            info = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
            if info[0] != driver.CUresult.CUDA_SUCCESS:
                return  # (not a capturing stream)
            graph = next(x for x in info[1:] if isinstance(x, driver.CUgraph))
            got = driver.cuGraphGetNodes(graph, 0)
            if got[0] != driver.CUresult.CUDA_SUCCESS:
                return
            count = int(got[2])
        except Exception:  # noqa: BLE001 - bindings that differ: stop keeping sites, keep recording
            _driver = False
            self.on = False
            return
        if count > self._count:
            self.sites.append((self._count, count, _stack(2)))
            self._count = count

    def take(self) -> list[Site]:
        """The sites noted since the last take, for the graph just captured; starts a new graph."""
        sites, self.sites, self._count = self.sites, [], 0
        return sites
