"""Planted faults for the debugging acceptance tests (tests/gpu/test_planted_faults_gpu.py).

Importable by name (``_faults:lookup``), so a dump of them can be re-run in a fresh process
with this folder on ``PYTHONPATH``. Both take the bad value as a *tensor*, so a recording made
with good values replays the fault inside a CUDA graph.
"""

import torch
import triton
import triton.language as tl


def lookup(table, idx):
    """An index past the end: torch's index kernel fails a device-side assertion."""
    return table[idx] * 2


@triton.jit
def _write_past_end(ptr, offset_ptr, BLOCK: tl.constexpr):
    offset = tl.load(offset_ptr)
    i = tl.arange(0, BLOCK)
    tl.store(ptr + offset + i, 1.0)  # no mask: writes wherever offset points


def scribble(x, offset):
    """A Triton kernel that writes ``offset`` elements past a fresh tensor: out of bounds when large."""
    out = torch.zeros_like(x)
    _write_past_end[(1,)](out, offset, BLOCK=32)
    return out + x


def conv(x, w):
    """No fault: a cuDNN convolution and a cuBLAS matmul, whose sanitizer reports are noise."""
    y = torch.nn.functional.conv2d(x, w, padding=1)
    return y.flatten(1) @ y.flatten(1).T
