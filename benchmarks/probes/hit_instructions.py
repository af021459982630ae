"""Instructions a native replay hit costs, counted by valgrind's callgrind on a machine without a GPU.

Timings on the CI machine's two shared cores move by ±10 % between runs; instruction counts do not.
This runs a graphed call ``--calls`` times under callgrind, with the stand-ins of
``replay_hit_cpu.py`` for the recording, the stream and the launch (the native ``fast_replay``,
``fast_entry`` and a module's ``module_entry`` are the real ones, with the stand-in signature for
CPU tensors), collecting only inside the native entry, and prints each native function's
instructions per hit. The stand-ins' own Python (the signature, the copy-in, the launch) is counted
too: compare two checkouts, not the absolute figures. Needs ``valgrind``. Run::

    PYTHONPATH=.:benchmarks/probes:tests/fakes python benchmarks/probes/hit_instructions.py [--case module100]

Each case runs twice, N and 2N calls, side by side; the figures are their difference over N.
Cases: ``function`` (a lambda), ``module0`` (``per_call.py``'s module without parameters),
``module100`` (with its 100 parameters).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import itertools
import os
import re
import subprocess
import sys
import tempfile

# (collected inside these: the first native function of each entry)
_ENTRY = {"function": "graphtree_native::entry_call(*", "module": "graphtree_native::module_call(*"}
_SHOWN = ("module_call", "entry_call", "fast_call", "fast_replay", "end_step_natively", "addresses_unchanged")


def _child(case: str, calls: int, whole: bool) -> None:
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
    if whole:  # (the loop in deque.extend: callgrind collects in it, the whole call from Python)
        collections.deque(maxlen=0).extend(map(fn, itertools.repeat(x, calls)))
        return
    for _ in range(calls):
        fn(x)


def _counts(report: str) -> dict[str, int]:
    """Instructions by function (its bare name) in a ``callgrind_annotate`` report."""
    counts: dict[str, int] = {}
    for m in re.finditer(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(.+?)(?: \[.*\])?$", report, re.M):
        where = re.sub(r"^(\?\?\?|\S+?\.\w+):", "", m.group(2)).replace("(anonymous namespace)::", "")
        name = where.split("(")[0].split("::")[-1].rstrip("'0123456789")
        counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    return counts


def _run(case: str, calls: int, whole: bool, tmp: str) -> subprocess.Popen:
    entry = "deque_extend" if whole else _ENTRY["function" if case == "function" else "module"]
    out = os.path.join(tmp, f"callgrind.{calls}")
    return subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no", f"--toggle-collect={entry}",
         f"--callgrind-out-file={out}", sys.executable, __file__, "--child", "--case", case,
         "--calls", str(calls), *(["--whole"] if whole else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={"PYTHONHASHSEED": "0", **os.environ},  # (dicts laid out alike in every run: counts that repeat)
    )  # fmt: skip


def _report(path: str, inclusive: bool) -> dict[str, int]:
    annotate = ["callgrind_annotate", f"--inclusive={'yes' if inclusive else 'no'}", "--threshold=100", path]
    return _counts(subprocess.run(annotate, capture_output=True, text=True, check=True).stdout)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--case", choices=("function", "module0", "module100"), default="module100")
    a.add_argument("--calls", type=int, default=1000)
    a.add_argument("--whole", action="store_true", help="count the whole call from Python, the entry's frame included")
    a.add_argument("--top", type=int, default=0, help="also list the N functions of most instructions of their own")
    a.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = a.parse_args()
    if args.child:
        _child(args.case, args.calls, args.whole)
        return
    # Two runs, of N and 2N calls, side by side: their difference is N steady hits, with no
    # first-call cost (the recording, a lazy import) spread over them.
    with tempfile.TemporaryDirectory() as tmp:
        runs = [_run(args.case, n, args.whole, tmp) for n in (args.calls, 2 * args.calls)]
        for r in runs:
            if r.wait() != 0:
                raise SystemExit(f"valgrind exited with {r.returncode}")
        short, long = (os.path.join(tmp, f"callgrind.{n}") for n in (args.calls, 2 * args.calls))
        inc = [_report(short, True), _report(long, True)]
        own = [_report(short, False), _report(long, False)] if args.top else []
    per_hit = {k: (inc[1][k] - inc[0].get(k, 0)) / args.calls for k in inc[1]}
    print(f"{args.case}: instructions per steady hit, inclusive ({sys.version.split()[0]}, {args.calls} hits)")
    for name in ("deque_extend", *_SHOWN) if args.whole else _SHOWN:
        if name in per_hit:
            print(f"  {name:24} {per_hit[name]:10,.0f}")
    if own:
        mine = {k: (own[1][k] - own[0].get(k, 0)) / args.calls for k in own[1]}
        print("their own instructions, the most first:")
        for name, n in sorted(mine.items(), key=lambda kv: -kv[1])[: args.top]:
            print(f"  {name[:60]:60} {n:10,.0f}")


if __name__ == "__main__":
    main()
