"""Instructions a native replay hit costs, counted by valgrind's callgrind on a machine without a GPU.

Timings on the CI machine's two shared cores move by ±10 % between runs; instruction counts do not.
This runs a graphed call ``--calls`` times under callgrind, with the stand-ins of
``replay_hit_cpu.py`` for the recording, the stream and the launch (the native ``fast_replay``,
``fast_entry`` and a module's ``module_entry`` are the real ones, with the stand-in signature for
CPU tensors), collecting only inside the native entry, and prints each native function's
instructions per hit. The stand-ins' own Python (the signature, the copy-in, the launch) is counted
too: compare two checkouts, not the absolute figures. Needs ``valgrind``. Run::

    PYTHONPATH=.:benchmarks/probes:tests/fakes python benchmarks/probes/hit_instructions.py [--case module100]

Cases: ``function`` (a lambda), ``module0`` (``per_call.py``'s module without parameters),
``module100`` (with its 100 parameters).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import tempfile

# (collected inside these: the first native function of each entry)
_ENTRY = {"function": "graphtree_native::entry_call(*", "module": "graphtree_native::module_call(*"}
_SHOWN = ("module_call", "entry_call", "fast_call", "fast_replay", "end_step_natively", "addresses_unchanged")


def _child(case: str, calls: int) -> None:
    """The loop callgrind counts (run in the child process)."""
    import torch

    import graphtree
    from graphtree import _native
    from graphtree.tree import walk as walk_mod

    real = _native.wait(600)
    if real is None:
        raise SystemExit(f"no native helpers: {_native.status()}")
    timed = importlib.import_module("replay_hit_cpu_time")
    p = importlib.import_module("replay_hit_cpu")
    stand_ins = p.STAND_INS
    stand_ins.ambient = timed.ambient._python_state
    p._install()
    importlib.import_module("gt_fast_hit").with_native_hit(stand_ins, real)
    walk_mod._torch.invalidate_storage = lambda ref, msg: None  # type: ignore[assignment]
    torch.set_grad_enabled(False)
    if case == "function":
        fn = graphtree.graphed(lambda t: t * 2 + 1)
        gc = fn
    else:
        fn = graphtree.graphed(timed._HundredParameters(0 if case == "module0" else 100))
        gc = fn._graphtree_call
    x = torch.randn(64, 64)
    p._recording(gc, x, False)
    for _ in range(20):
        fn(x)
    for _ in range(calls):
        fn(x)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--case", choices=("function", "module0", "module100"), default="module100")
    a.add_argument("--calls", type=int, default=2000)
    a.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = a.parse_args()
    if args.child:
        _child(args.case, args.calls)
        return
    entry = _ENTRY["function" if args.case == "function" else "module"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={entry}",
             f"--callgrind-out-file={out}", sys.executable, __file__, "--child", "--case", args.case,
             "--calls", str(args.calls)],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        annotate = ["callgrind_annotate", "--inclusive=yes", "--threshold=100", out]
        report = subprocess.run(annotate, capture_output=True, text=True, check=True).stdout
    hits = args.calls + 20
    print(f"{args.case}: instructions per hit, inclusive, over {hits} hits ({sys.version.split()[0]})")
    for name in _SHOWN:
        m = re.search(rf"^\s*([\d,]+) .*::{name}\(", report, re.M)
        if m:
            print(f"  {name:20} {int(m.group(1).replace(',', '')) / hits:10,.0f}")


if __name__ == "__main__":
    main()
