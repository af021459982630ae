"""Walk one graphtree call (a replay) and count the module stops it makes.

A *stop* is a change of the graphtree module that runs, at a Python call or return; a *return
stop* re-enters a module the walk already left. Frames outside graphtree (torch's Python) are
not counted as stops. Run on a GPU: ``python benchmarks/call_walk.py``.
"""

from __future__ import annotations

import os
import sys

import torch

import graphtree
from graphtree import _native
from graphtree.tree import fast_hit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fakes"))
from gt_fast_hit import module_stops as walk  # (the fast hit's tests walk the same way)


def _report(what: str, gc, call) -> None:
    """Walk ``call()`` three times: as it runs (the native fast hit once one is kept); without the
    native helpers (``GRAPHTREE_NATIVE=0``: the fast hit's Python twin); and by the Python path
    proper (its signatures left to it, as after a fast hit gave up: ``TreeManager.call``)."""
    native = _native.loaded
    for path in ("as it runs", "helpers off", "Python path"):
        _native.loaded = None if path == "helpers off" else native
        if path == "Python path":
            gc.fast_hits.update(dict.fromkeys(gc.fast_hits, fast_hit._GAVE_UP))
        try:
            seq, back = walk(call)
        finally:
            _native.loaded = native
        print(f"{what}, {path}: {len(seq)} stops in {len(set(seq))} modules, {back} returning to a module already left")
        print("  " + " -> ".join(seq))


def main() -> None:
    # graphtree's C++ helpers, as a long-running process has them (they load in the background:
    # without the wait the calls below run before they are there, and only the Python path is walked)
    print(f"native helpers: {_native.wait(600) is not None} ({_native.status()})")
    step = graphtree.graphed(lambda x: x * 2 + 1, name="two")
    x = torch.randn(1024, device="cuda")
    for _ in range(8):
        step(x)
    _report("replay call", step, lambda: step(x))
    lin = torch.nn.Linear(64, 64).cuda()
    gm = graphtree.graphed(lin)
    y = torch.randn(8, 64, device="cuda")
    with torch.no_grad():
        for _ in range(8):
            gm(y)
        _report("module replay", gm.graphed_callable, lambda: gm(y))


if __name__ == "__main__":
    main()
