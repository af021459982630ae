"""A graphed call's outputs still held when graphtree.reset() runs, then dropped (the one-process
suite aborted with "invalid device pointer" when a failed test's traceback kept them): each case in
a child process, its exit status printed. Run on a GPU: ``python benchmarks/probes/held_after_reset.py``."""

import subprocess
import sys

CASES = {
    "single output": "g = graphtree.graphed(lambda x: x * 2)",
    "number operand": "g = graphtree.graphed(lambda x, k=2: x * k)",
    "number branch": "g = graphtree.graphed(lambda x, k=2: x * k if k > 0 else x)",
    "two outputs": "g = graphtree.graphed(lambda x: (x * 2, x + 1))",
}
BODY = """
import gc, torch, graphtree
{make}
held = []
for i in range(5):
    graphtree.mark_step()
    x = torch.randn(4, device="cuda")
    held.append(g(x))
graphtree.reset()
del g
gc.collect()
held.clear()
gc.collect()
torch.cuda.synchronize()
print("ok", graphtree.stats())
"""
for name, make in CASES.items():
    for order in ("outputs last", "outputs first"):
        body = BODY.format(make=make)
        if order == "outputs first":
            cleared = "held.clear()\ngc.collect()\n"
            body = body.replace("graphtree.reset()\n", "").replace(cleared, cleared + "graphtree.reset()\n")
        p = subprocess.run([sys.executable, "-c", body], check=False, capture_output=True, text=True, timeout=120)
        tail = (p.stdout + p.stderr).strip().splitlines()
        print(f"{name:16} {order:14} rc={p.returncode} {tail[-1][:160] if tail else ''}")
        if p.returncode:
            print("   ", "\n    ".join(line for line in tail if "Error" in line or "what()" in line)[:800])
