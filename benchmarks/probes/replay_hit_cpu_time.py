"""Microseconds of graphtree's own work per replay hit on a machine without a GPU, with the stand-ins
of ``replay_hit_cpu.py`` for the launch and the copies (the ambient state read in Python by the
Python paths, in C++ by the native one). Modes: ``main`` (run with main's checkout first on
``PYTHONPATH``: its Python path), ``twin`` (the fast hit's Python twin), ``native``
(``_native.fast_replay``). Run::

    PYTHONPATH=.:benchmarks/probes python benchmarks/probes/replay_hit_cpu_time.py twin,native
"""

from __future__ import annotations

import importlib
import statistics
import sys
import time
from typing import Any

import torch

import graphtree
from graphtree import _native
from graphtree.tree import ambient
from graphtree.tree import walk as walk_mod


def bench(
    p: Any, real: Any, fn: Any, x: torch.Tensor, grad: bool, mode: str, kept: bool = False, n: int = 20000
) -> float:
    """Median µs per call of ``fn(x)`` over 9 runs of ``n`` calls, all replay hits; ``kept``:
    each output held until the next call returns (``y = fn(x)``), so every call invalidates it."""
    gc = fn._graphtree_call if isinstance(fn, torch.nn.Module) else fn
    p._recording(gc, x, grad)
    for name in ("fast_replay", "module_entry"):  # (the native replay, a module's native entry)
        if mode == "native":
            setattr(p.STAND_INS, name, getattr(real, name))
        elif hasattr(p.STAND_INS, name):
            delattr(p.STAND_INS, name)
    out = []
    with torch.set_grad_enabled(grad):
        for _ in range(10):
            fn(x)
        for _ in range(9):
            y = None
            t0 = time.perf_counter()
            if kept:
                for _ in range(n):
                    y = fn(x)
            else:
                for _ in range(n):
                    fn(x)
            out.append((time.perf_counter() - t0) / n * 1e6)
            del y
    return statistics.median(out)


def _twice(t: torch.Tensor) -> torch.Tensor:
    return t * 2 + 1


class _ReadsAGlobal(torch.nn.Module):
    """A module whose forward calls a global function (``benchmarks/per_call.py``'s modules do):
    graphtree keys the function read, so each hit asks whether it was rebound."""

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _twice(t)


class _HundredParameters(torch.nn.Module):
    """``benchmarks/per_call.py``'s module of 100 parameters: a hit checks their 100 addresses."""

    def __init__(self, n: int = 100) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(n)])

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return _twice(t)


def main() -> None:
    real = _native.wait(600)  # (before the probe turns the helpers off for its own process)
    p = importlib.import_module("replay_hit_cpu")
    p.STAND_INS.ambient = ambient._python_state
    p._install()
    x = torch.randn(64, 64)
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["twin", "native"]
    # (a held output is invalidated through torch's CUDA bindings: a stand-in here, as the tests' is)
    walk_mod._torch.invalidate_storage = lambda ref, msg: None  # type: ignore[assignment]
    cases = (
        ("module reading a global", lambda: graphtree.graphed(_ReadsAGlobal()), False, False),
        ("function", lambda: graphtree.graphed(lambda t: t * 2 + 1), True, False),
        ("function, output kept", lambda: graphtree.graphed(lambda t: t * 2 + 1), True, True),
        ("nn.Linear", lambda: graphtree.graphed(torch.nn.Linear(64, 64)), False, False),
        ("module without parameters", lambda: graphtree.graphed(_HundredParameters(0)), False, False),
        ("module of 100 parameters", lambda: graphtree.graphed(_HundredParameters()), False, False),
    )
    for tag, make, grad, kept in cases:
        print(tag, {m: round(bench(p, real, make(), x, grad, m, kept), 2) for m in modes}, "µs per hit")


if __name__ == "__main__":
    main()
