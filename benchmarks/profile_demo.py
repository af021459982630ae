"""Profile `graphtree demo` with graphtree.profile and report what the issue asks for.

Run on a GPU with cupti-python installed:

    python benchmarks/profile_demo.py --out DIR [--steps 32]

Prints the profile table, the kernel count, the share of graph kernels attributed to a source
line of the captured code, and whether the Chrome trace passes the format checks; writes
``trace.json`` and ``gpu.pb.gz`` under DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import graphtree
from graphtree.cli import main as cli_main
from graphtree.profile.exporters import check_chrome_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=32)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    with graphtree.profile() as prof:
        rc = cli_main(["demo", "--steps", str(a.steps)])
    print(prof.table(limit=12))
    s = prof.summary()
    # A graph kernel is attributed when its stack is the captured code's, not the replay's.
    replay_stack = {launch.correlation_id: launch.stack_id for launch in prof.launches()}
    graph_kernels = [r for r in prof.records if r.kind == "kernel" and r.graph_id]
    attributed = [
        r
        for r in graph_kernels
        if not r.captured_before_profiling
        and prof.stack(r.stack_id)
        and r.stack_id != replay_stack.get(r.correlation_id)
    ]
    lines = sorted({f"{f[0].rsplit('/', 1)[-1]}:{f[1]}" for r in attributed for f in prof.stack(r.stack_id)[-1:]})
    trace = prof.export_chrome(os.path.join(a.out, "trace.json"))
    prof.export_pprof(os.path.join(a.out, "gpu.pb.gz"))
    with open(trace) as f:
        problems = check_chrome_trace(json.load(f))
    share = len(attributed) / len(graph_kernels) if graph_kernels else 0.0
    print(
        f"demo exit code {rc}; kernels {s['kernels']} (graph launches {s['graph_launches']}, "
        f"records kept {s['records_kept']}, dropped {s['dropped_records']})"
    )
    print(f"graph kernels {len(graph_kernels)}, attributed to a captured source line {len(attributed)} ({share:.1%})")
    print(f"captured lines the graph kernels point at: {', '.join(lines[:12])}{' ...' if len(lines) > 12 else ''}")
    print(f"chrome trace {trace}: {'passes the format checks' if not problems else problems[:5]}")
    return 0 if rc == 0 and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
