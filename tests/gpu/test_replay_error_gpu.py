"""A planted fault inside a graph: the CUDA error that surfaces at graphtree's next replay names
the recording (graphtree.tree.replay_error). In a subprocess: the context dies."""

import subprocess
import sys

CODE = """
import time, torch, graphtree
table = torch.randn(8, device="cuda")
f = graphtree.graphed(lambda i: table[i] * 2, name="lookup")
idx = torch.zeros(4, dtype=torch.long, device="cuda")
for _ in range(3):  # warm-up, record, replay
    graphtree.mark_step()
    f(idx)
torch.cuda.synchronize()
graphtree.mark_step()
f(torch.full((4,), 1000, dtype=torch.long, device="cuda"))  # out of range: a device-side assert, reported later
time.sleep(1.0)  # the fault has happened: the next call that touches the GPU reports it
graphtree.mark_step()
try:
    f(idx)
    torch.cuda.synchronize()
    print("NO ERROR")
except RuntimeError as e:
    print("RAISED", type(e).__name__)
    print(e)
"""


def test_a_fault_inside_a_replay_is_reported_with_the_recordings_name():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300, check=False)
    text = out.stdout
    assert "RAISED GraphReplayError" in text, (text, out.stderr[-3000:])
    assert "replaying the recording of lookup(int64[4])" in text
    assert "graphtree debug rerun" in text
