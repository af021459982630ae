"""Timers for the benchmark: CPU time per call, wall time per call, and GPU-only time.

Each timer takes a zero-argument callable and returns one sample in seconds; give it to
:func:`graphtree.bench.harness.interleaved` (through ``functools.partial``) to get medians over
interleaved repeats.

- :func:`cpu_per_call` -- ``perf_counter`` around ``calls`` back-to-back calls with no
  synchronization inside the timed region, divided by ``calls``: the CPU cost of issuing the
  work (the device queue is drained before the clock starts, outside the timed region).
- :func:`wall_per_call` -- synchronize, ``perf_counter`` around ``calls`` calls, synchronize,
  divided by ``calls``: the real throughput per call, whichever of CPU or GPU is the bottleneck.
- :func:`gpu_time` -- CUDA events around one call, after a GPU spin kernel
  (``torch.cuda._sleep``) long enough that the CPU has issued the whole call before the GPU
  reaches the start event: the events then bracket only GPU execution, the physical floor.

Example::

    from functools import partial
    from graphtree.bench import timing
    from graphtree.bench.harness import interleaved

    t = interleaved({"eager": f, "graph": g}, repeats=15, warmup=3,
                    timer=partial(timing.wall_per_call, calls=100, sync=torch.cuda.synchronize))
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def _noop() -> None:
    return None


def _timed_calls(fn: Callable[[], Any], calls: int, sync: Callable[[], None], sync_after: bool) -> float:
    """Seconds per call of ``calls`` calls, after one ``sync``; with ``sync_after``, the clock
    also waits for the device at the end."""
    if calls < 1:
        raise ValueError("calls must be >= 1")
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if sync_after:
        sync()
    return (time.perf_counter() - t0) / calls


def cpu_per_call(fn: Callable[[], Any], calls: int = 100, sync: Callable[[], None] = _noop) -> float:
    """Seconds of CPU time per call: ``perf_counter`` around ``calls`` calls, no sync inside.

    ``sync`` runs once *before* the clock starts so that earlier work does not throttle this
    sample; nothing waits for the device while the clock runs.

    Example::

        cpu_per_call(lambda: step(x), calls=200, sync=torch.cuda.synchronize)
    """
    return _timed_calls(fn, calls, sync, sync_after=False)


def wall_per_call(fn: Callable[[], Any], calls: int = 100, sync: Callable[[], None] = _noop) -> float:
    """Seconds of wall time per call: sync, ``calls`` calls, sync, divided by ``calls``.

    Example::

        wall_per_call(lambda: step(x), calls=200, sync=torch.cuda.synchronize)
    """
    return _timed_calls(fn, calls, sync, sync_after=True)


def per_unit(timer: Callable[[Callable[[], Any]], float], units: int) -> Callable[[Callable[[], Any]], float]:
    """Wrap ``timer`` so its sample is divided by ``units`` (e.g. decode steps in one run).

    Example::

        timer = per_unit(partial(wall_per_call, calls=1, sync=torch.cuda.synchronize), 64)
    """
    if units < 1:
        raise ValueError("units must be >= 1")

    def timed(fn: Callable[[], Any]) -> float:
        return timer(fn) / units

    return timed


def spin_cycles_for(seconds: float, clock_hz: float) -> int:
    """GPU clock cycles for ``torch.cuda._sleep`` to keep the GPU busy for about ``seconds``.

    Example::

        >>> spin_cycles_for(1e-3, 1.5e9)
        1500000
    """
    return max(int(seconds * clock_hz), 0)


def calibrate_spin(cycles: int = 1_000_000) -> float:
    """Measured GPU clock rate (cycles per second) of ``torch.cuda._sleep``, via CUDA events.

    Example::

        hz = calibrate_spin()
        cycles = spin_cycles_for(2e-3, hz)
    """
    import torch

    from graphtree import _torch

    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        _torch.gpu_spin(cycles)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return cycles / best if best > 0 else 1.5e9


def gpu_time(fn: Callable[[], Any], spin_cycles: int = 0) -> float:
    """Seconds of GPU execution of one ``fn()`` call, measured with CUDA events.

    Before the start event a spin kernel of ``spin_cycles`` keeps the GPU busy, so the CPU has
    issued all of ``fn``'s work by the time the GPU reaches the start event; the interval then
    holds GPU execution only (kernels, copies and the gaps between them on the device), not
    CPU launch cost. Choose ``spin_cycles`` to cover a few times the CPU time of one call.

    Example::

        hz = calibrate_spin()
        gpu_time(lambda: g.replay(), spin_cycles=spin_cycles_for(1e-3, hz))
    """
    import torch

    from graphtree import _torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    if spin_cycles > 0:
        _torch.gpu_spin(spin_cycles)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
