"""Workloads on the fake GPU shared by the graphtree.profile CPU tests.

Not marked internal (unlike ``gt_profile_testkit``): the profiler attributes the kernels launched
here to these lines, the same for every caller, so profiles of two runs compare equal.

Example::

    prof = mixed_workload(fake_cupti.SIM)
    assert digest(prof) == digest(mixed_workload(fake_cupti.SIM, vectorized=False))
"""

from __future__ import annotations

from typing import Any


def mixed_workload(sim: Any, **options: Any) -> Any:
    """Profile a mix on the fake GPU: a graph captured before profiling, one captured during it,
    runtime and driver graph launches, eager kernels, memcpy and memset; ``options`` go to
    ``ProfileOptions`` (small buffers, so that many of them complete)."""
    from graphtree.profile import Profile, ProfileOptions

    old = sim.capture(lambda: (sim.launch_kernel("o1"), sim.memcpy(64)))
    with Profile(ProfileOptions(buffer_size=2048, **options)) as prof:
        exe = sim.capture(lambda: (sim.launch_kernel("a"), sim.memcpy(128), sim.launch_kernel("b")))
        for i in range(30):
            sim.graph_launch(exe, api="cudaGraphLaunch_v10000" if i % 2 else "cuGraphLaunch")
            sim.launch_kernel("eager", api="cudaLaunchKernel_v7000")
            sim.memset(32)
            if i % 10 == 0:
                sim.graph_launch(old)
    return prof


def digest(prof: Any, strip_ids: bool = False) -> tuple:
    """Everything a profile concluded, comparable across buffer paths: kernel and graph stats,
    the summary (less buffer counts), launches and records (stack and correlation ids zeroed
    with ``strip_ids``, since paths may number them differently)."""
    stats = sorted(
        (
            st.kind,
            st.name,
            st.count,
            st.total_ns,
            st.min_ns,
            st.max_ns,
            prof.stack(st.stack_id)[-1:],
            st.graph_key,
            st.captured_before_profiling,
            st.label,
        )
        for st in prof.kernel_stats()
    )
    graphs = sorted(
        (g.graph_key, g.replays, g.kernels, g.total_ns, g.captured_before_profiling) for g in prof.graph_stats()
    )
    summary = {k: v for k, v in prof.summary().items() if k not in ("buffers_completed", "max_buffers_in_flight")}
    launches = [(lz.api, lz.kernels, lz.gpu_ns) for lz in prof.launches()]
    recs = sorted(prof.records, key=lambda r: (r.start, r.name))
    if strip_ids:
        recs = [r._replace(stack_id=0, correlation_id=0) for r in recs]
    return stats, graphs, summary, launches, recs
