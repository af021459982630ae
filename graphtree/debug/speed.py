"""``graphtree doctor --speed``: is this GPU as fast as it should be? Under a minute.

Measures bf16 and fp32 matmul TFLOP/s, device-to-device bandwidth, pinned host-to-device and
device-to-host bandwidth, the CPU cost of one kernel launch, and the cost per kernel of a CUDA
graph replay; compares each with the GPU's nominal peak where it is known (:data:`PEAKS`) and
ends with a verdict line. GPU times come from CUDA events, launch costs from the host clock.

fp32 is measured as PyTorch computes it by default (``torch.backends.cuda.matmul.allow_tf32`` is
False): the CUDA cores' FP32 rate, not TF32.

Example::

    $ graphtree doctor --speed
    $ graphtree doctor --speed --json
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["PEAKS", "Figure", "SpeedReport", "peaks_for", "speed_test", "verdict"]

# Nominal dense peaks from NVIDIA's data sheets (bf16 and fp32 TFLOP/s without sparsity, memory
# and PCIe GB/s). First match wins, so the more specific names come first.
PEAKS: list[tuple[str, dict[str, float]]] = [
    ("H100 PCIe", {"matmul_bf16": 756.0, "matmul_fp32": 51.0, "copy_d2d": 2000.0, "pcie": 64.0}),
    ("H100", {"matmul_bf16": 989.0, "matmul_fp32": 67.0, "copy_d2d": 3350.0, "pcie": 64.0}),
    ("H200", {"matmul_bf16": 989.0, "matmul_fp32": 67.0, "copy_d2d": 4800.0, "pcie": 64.0}),
    ("A100", {"matmul_bf16": 312.0, "matmul_fp32": 19.5, "copy_d2d": 2039.0, "pcie": 32.0}),
    ("L4", {"matmul_bf16": 121.0, "matmul_fp32": 30.3, "copy_d2d": 300.0, "pcie": 32.0}),
]
"""``(name substring, peaks)``: what the figures are compared with, per GPU."""

# A figure below this share of its peak is called slow (matmul and copies rarely pass 80-90 %).
_HEALTHY = {"matmul_bf16": 0.5, "matmul_fp32": 0.6, "copy_d2d": 0.6, "h2d": 0.5, "d2h": 0.5}
_PEAK_KEY = {"h2d": "pcie", "d2h": "pcie"}


@dataclass
class Figure:
    """One measurement: its value and unit, and its share of the nominal peak when known."""

    name: str
    value: float
    unit: str
    peak: float | None = None

    @property
    def share(self) -> float | None:
        return self.value / self.peak if self.peak else None


@dataclass
class SpeedReport:
    """What :func:`speed_test` measured, on which GPU, and the verdict."""

    device: str
    torch: str
    figures: list[Figure] = field(default_factory=list)
    verdict: str = ""
    slow: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for f, fig in zip(d["figures"], self.figures):
            f["share_of_peak"] = fig.share
        return d

    def render(self) -> str:
        lines = [f"{self.device}, torch {self.torch} ({self.seconds:.0f} s)"]
        for f in self.figures:
            peak = f"  ({100 * f.share:.0f} % of {f.peak:g} {f.unit})" if f.share is not None else ""
            lines.append(f"  {_LABELS.get(f.name, f.name):34} {f.value:10.2f} {f.unit}{peak}")
        lines.append(self.verdict)
        return "\n".join(lines)


_LABELS = {
    "matmul_bf16": "matmul bf16",
    "matmul_fp32": "matmul fp32 (no TF32)",
    "copy_d2d": "device-to-device copy",
    "h2d": "host-to-device (pinned)",
    "d2h": "device-to-host (pinned)",
    "launch": "kernel launch, CPU cost",
    "graph_per_kernel": "graph replay, per kernel",
}


def peaks_for(device_name: str) -> dict[str, float] | None:
    """Nominal peaks of a GPU by its name (``torch.cuda.get_device_name()``), or None.

    Example::

        peaks_for("NVIDIA H100 80GB HBM3")["matmul_bf16"]   # 989.0
    """
    for key, peaks in PEAKS:
        if key in device_name:
            return peaks
    return None


def verdict(device_name: str, figures: list[Figure]) -> tuple[str, list[str]]:
    """The verdict line and the names of the figures below their healthy share of the peak."""
    if peaks_for(device_name) is None:
        known = ", ".join(k for k, _ in PEAKS)
        return f"verdict: no nominal peaks for {device_name} (known: {known}); figures only", []
    slow = [f for f in figures if f.share is not None and f.share < _HEALTHY.get(f.name, 0.0)]
    if not slow:
        return "verdict: as fast as this GPU should be", []
    what = ", ".join(f"{_LABELS[f.name]} at {100 * (f.share or 0.0):.0f} %" for f in slow)
    return (
        f"verdict: SLOW - {what} of the nominal peak (clocks, power cap, PCIe link, another process?)",
        [f.name for f in slow],
    )


def _gpu_seconds(fn: Callable[[], object], reps: int) -> float:
    """GPU time of one ``fn()``, by CUDA events around ``reps`` calls after one warm-up call."""
    import torch

    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def _matmul(dtype: Any, n: int, reps: int) -> float:
    import torch

    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    s = _gpu_seconds(lambda: torch.mm(a, b), reps)
    return 2 * n**3 / s / 1e12


def _copy_d2d(nbytes: int, reps: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    s = _gpu_seconds(lambda: dst.copy_(src), reps)
    return 2 * nbytes / s / 1e9  # read and written


def _copy_host(nbytes: int, reps: int, to_device: bool) -> float:
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    fn = (lambda: dev.copy_(host, non_blocking=True)) if to_device else (lambda: host.copy_(dev, non_blocking=True))
    return nbytes / _gpu_seconds(fn, reps) / 1e9


def _launch_us(n: int) -> float:
    import torch

    x = torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        x.add_(1)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def _graph_per_kernel_us(kernels: int, replays: int) -> float:
    import torch

    x = torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        x.add_(1)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(kernels):
            x.add_(1)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(replays):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (replays * kernels) * 1e6


def speed_test(progress: bool = True, quick: bool = False) -> SpeedReport:
    """Run the measurements on the current GPU (raises ``RuntimeError`` without CUDA).

    ``quick`` uses small sizes (a few seconds; for tests). A progress bar (tqdm) shows the step.

    Example::

        report = speed_test()
        print(report.render())
    """
    import torch
    from tqdm import tqdm

    if not torch.cuda.is_available():
        raise RuntimeError("the speed test needs a CUDA GPU, and torch sees none")
    name = torch.cuda.get_device_name()
    peaks = peaks_for(name) or {}
    n, reps, big = (1024, 3, 16 << 20) if quick else (8192, 20, 1 << 30)
    steps: list[tuple[str, str, Callable[[], float]]] = [
        ("matmul_bf16", "TFLOP/s", lambda: _matmul(torch.bfloat16, n, reps)),
        ("matmul_fp32", "TFLOP/s", lambda: _matmul(torch.float32, n, reps)),
        ("copy_d2d", "GB/s", lambda: _copy_d2d(big, reps)),
        ("h2d", "GB/s", lambda: _copy_host(big // 4, reps, True)),
        ("d2h", "GB/s", lambda: _copy_host(big // 4, reps, False)),
        ("launch", "us", lambda: _launch_us(200 if quick else 20000)),
        ("graph_per_kernel", "us", lambda: _graph_per_kernel_us(100, 20 if quick else 500)),
    ]
    report = SpeedReport(device=name, torch=torch.__version__)
    t0 = time.perf_counter()
    bar = tqdm(steps, desc="speed test", unit="step", disable=not progress, leave=False)
    for key, unit, measure in bar:
        bar.set_postfix_str(_LABELS[key])
        report.figures.append(Figure(key, measure(), unit, peaks.get(_PEAK_KEY.get(key, key))))
    report.seconds = time.perf_counter() - t0
    report.verdict, report.slow = verdict(name, report.figures)
    return report
