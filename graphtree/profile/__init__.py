"""graphtree.profile: kernel-level profiling of CUDA graph replays through CUPTI.

Every kernel, memcpy and memset on the GPU is timed - eager launches and each kernel inside a
graph replay - and attributed to the Python line that produced it: for a kernel inside a replay,
the code that was *captured* (graphtree recordings and ``torch.cuda.graph`` captures made while
profiling), not the ``replay()`` call. Graph launches through the runtime (``cudaGraphLaunch``,
what ``torch.cuda.CUDAGraph.replay`` uses) and through the driver (``cuGraphLaunch``, as C++
runtimes such as TensorRT-LLM do) are both seen.

Needs NVIDIA's CUPTI Python bindings: ``pip install 'graphtree[profile]'``. Nothing of CUPTI is
imported until a profile starts, so ``import graphtree.profile`` works without them.

Example::

    import graphtree

    with graphtree.profile() as prof:            # CLI: graphtree profile -o trace.json -- python train.py
        for _ in range(10):
            step(x)
    print(prof.table())                           # top kernels and graphs by GPU time, with call sites
    prof.export_chrome("trace.json")              # Perfetto / chrome://tracing
    prof.export_pprof("gpu.pb.gz")                # GPU time per Python stack (pprof, Parca, Pyroscope)

See ``DESIGN.md`` in this package for how it works and why it is safe around CUDA graphs.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from graphtree.profile._errors import ProfilerBusyError, ProfilerError, ProfilerUnavailableError
from graphtree.profile._model import ProfileOptions
from graphtree.profile._profile import Profile
from graphtree.profile._sampling import Sampling, WindowReport

__all__ = [
    "Profile",
    "ProfileOptions",
    "ProfilerBusyError",
    "ProfilerError",
    "ProfilerUnavailableError",
    "Sampling",
    "WindowReport",
    "prepare",
    "profile",
]


def profile(
    *,
    keep_records: bool = True,
    max_records: int = 200_000,
    memcpy: bool = True,
    buffer_size: int = 8 << 20,
    flush_period_ms: int = 1000,
    stack_depth: int = 64,
    finalize: bool = False,
    tap: Callable[[Any], Any] | None = None,
    raw_buffers: bool = True,
    sample: Sampling | None = None,
    **advanced: Any,
) -> Profile:
    """A GPU profile to use as a context manager (or with ``start()`` / ``stop()``).

    Arguments:
        keep_records: keep every GPU record for the Chrome trace (aggregates are always kept).
        max_records: at most this many records are kept individually; past it, records are only
            aggregated (the table and pprof stay complete; the trace notes what it lacks).
        memcpy: also collect memcpy and memset activity.
        buffer_size: bytes per CUPTI activity buffer.
        flush_period_ms: CUPTI flushes full buffers at least this often (0: only when full).
        stack_depth: Python frames walked per captured stack.
        finalize: call ``cuptiFinalize`` at stop (off: re-initialising CUPTI after a teardown
            is what crashes CUDA graphs on some drivers).
        tap: a ``tap(data) -> sink`` that sees every normalized CUPTI event (fixture recording).
        raw_buffers: read CUPTI's activity buffers straight from libcupti (ctypes, numpy; no
            Python object per record); False: through cupti-python's buffer callbacks.
        sample: always-on sampled mode (:class:`Sampling`): GPU activity is traced only inside
            short windows (default 200 ms every 20 s); each window's kernels are reported in
            ``prof.windows`` and to ``Sampling.on_window``. Call sites are attributed as in full mode.
        advanced: further :class:`ProfileOptions` fields (``defer_records``, ``buffer_pool``,
            ``vectorized``, ``launch_generation``).

    Raises (on start): :class:`ProfilerUnavailableError` without CUPTI bindings or driver,
    :class:`ProfilerBusyError` when another CUPTI user (torch.profiler, Nsight, compute-sanitizer,
    another graphtree profile) is active.

    Example::

        with graphtree.profile(keep_records=False) as prof:   # long runs: aggregate only
            train(epochs=1)
        print(prof.table())

        prof = graphtree.profile(sample=graphtree.profile.Sampling(on_window=lambda w: print(w.table(5))))
        prof.start()                                           # a server: keep it on
    """
    return Profile(
        ProfileOptions(
            keep_records=keep_records,
            max_records=max_records,
            memcpy=memcpy,
            buffer_size=buffer_size,
            flush_period_ms=flush_period_ms,
            stack_depth=stack_depth,
            finalize=finalize,
            tap=tap,
            raw_buffers=raw_buffers,
            sample=sample,
            **advanced,
        )
    )


def prepare() -> bool:
    """Initialise CUPTI now, before CUDA graphs are captured; returns whether it worked.

    On older drivers, CUPTI initialised for the first time *after* a graph was captured made the
    graph's replays fault (pytorch/pytorch#75504); the known cure is to start and stop a profiler
    before capturing. graphtree never tears CUPTI down afterwards, so later profiles replay those
    graphs without re-initialising it. Never raises: busy or unavailable CUPTI returns False.

    Example::

        graphtree.profile.prepare()      # at start-up, before the first capture
        ...                               # capture / record graphs
        with graphtree.profile() as prof:
            step(x)
    """
    try:
        profile(memcpy=False).start().stop()
        return True
    except ProfilerError:
        return False


class _CallableModule(types.ModuleType):
    """``graphtree.profile`` is this package, and ``graphtree.profile()`` starts a profile:
    calling the module calls :func:`profile`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Profile:
        return profile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
