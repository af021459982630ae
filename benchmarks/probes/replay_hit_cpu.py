"""A replay hit followed frame by frame on a machine without a GPU (issue 47, item 4).

The real call path of ``graphtree.graphed(lambda x: x * 2 + 1)`` and of a graphed ``nn.Linear``
runs on CPU tensors here. Stand-ins take the place of the native helpers (each counts as one
native call), of a recording (a ``Node`` built by hand: one copied input, one output from the
pool), of the raw stream and of the launch. It prints the Python frames and C calls of one hit,
and writes the call tree to ``--out``. It is coupled to graphtree's internals: a probe, not a
benchmark. On a GPU, ``benchmarks/call_walk.py`` walks a real replay. Run::

    PYTHONPATH=. python benchmarks/probes/replay_hit_cpu.py [--out /tmp/replay_hit]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ["GRAPHTREE_NATIVE"] = "0"  # (the stand-ins below are installed instead)

import torch

import graphtree
from graphtree import _native
from graphtree.tree import ambient, liveness, placement
from graphtree.tree import graphed as graphed_mod
from graphtree.tree import manager as manager_mod
from graphtree.tree.inputs import read_call

# the stand-ins the fast hit's tests use (tests/fakes/gt_fast_hit.py)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "fakes"))
from gt_fast_hit import plant_recording, stand_in_helpers

STAND_INS = stand_in_helpers(ambient=lambda: (1, torch.float32, None))


def _install() -> None:
    _native.loaded = STAND_INS  # type: ignore[assignment]
    ambient._checked = STAND_INS
    graphed_mod._cuda_ok = True
    placement._current_stream = abs
    liveness._storage_at = lambda ptr, dev, n: torch.UntypedStorage(n)
    liveness._tensor_on = lambda m, s: torch.empty(0).set_(s, 0, m["size"], m["stride"])


def _recording(gc: Any, x: torch.Tensor, grad: bool) -> tuple[Any, Any]:
    """The tree and a hand-built recording of ``gc`` for calls like ``gc(x)``, at the root."""
    with torch.set_grad_enabled(grad):
        call = read_call((x,), {}, None)
        reads = gc.free.part() if gc.free.active else None
        gc.numbers.rekey(call)
        graphed_mod._key_state(call, gc._module, reads, gc._step)
    getattr(manager_mod._tls, "managers", {}).clear()
    tree = manager_mod.tree_for(0)
    tree.order._raw_stream = abs
    tree.order._last_raw = 0
    node = plant_recording(tree, gc, call.key, x, int)
    return tree, node


def walk_hit(fn: Any, x: torch.Tensor, grad: bool) -> tuple[list[tuple[Any, ...]], int]:
    """The events of one hit of ``fn(x)`` (after five), and how many replays it counted."""
    gc = fn._graphtree_call if isinstance(fn, torch.nn.Module) else fn
    tree, _node = _recording(gc, x, grad)
    events: list[tuple[Any, ...]] = []
    depth = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            events.append((depth[0], "py", code.co_filename, code.co_firstlineno, code.co_name))
            depth[0] += 1
        elif event == "c_call":
            code = frame.f_code
            events.append((depth[0], "c", code.co_filename, getattr(arg, "__qualname__", repr(arg)), code.co_name))
        elif event == "return":
            depth[0] -= 1

    with torch.set_grad_enabled(grad):
        for _ in range(5):
            fn(x)
        before = tree.counters.replays
        sys.setprofile(profile)
        fn(x)
        sys.setprofile(None)
    return events, tree.counters.replays - before


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="a folder for the call trees (fn.txt, module.txt)")
    a = p.parse_args()
    _install()
    x = torch.randn(64, 64)
    for tag, fn, grad in (
        ("fn", graphtree.graphed(lambda x: x * 2 + 1), True),
        ("module", graphtree.graphed(torch.nn.Linear(64, 64)), False),
    ):
        events, replays = walk_hit(fn, x, grad)
        frames = [e for e in events if e[1] == "py" and e[2] != __file__]
        calls = sum(e[1] == "c" and e[2] != __file__ for e in events)
        print(
            f"{tag}: {len(frames)} Python frames, {calls} C calls (the stand-ins' excluded); replays counted: {replays}"
        )
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, f"{tag}.txt"), "w") as f:
                for depth, *rest in events:
                    f.write("  " * depth + " ".join(map(str, rest)) + "\n")


if __name__ == "__main__":
    main()
