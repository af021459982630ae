"""graphtree.profile's in-memory model, fed directly through its ingest methods (CPU only)."""

from __future__ import annotations

import random

import pytest

from graphtree.profile._model import KERNEL, MEMCPY, MEMSET, ProfileData

RT, DRV = 2, 1
RUNTIME_GRAPH, DRIVER_GRAPH, RUNTIME_KERNEL, DRIVER_KERNEL = 311, 514, 211, 307


def _stack(data, name):
    return lambda: data.stacks.intern((("user.py", 1, name),))


def test_nested_driver_call_is_an_alias_of_the_runtime_launch():
    d = ProfileData()
    d.api_enter(RT, RUNTIME_GRAPH, 10, 1, 100, _stack(d, "replay_site"))
    d.api_enter(DRV, DRIVER_GRAPH, 11, 1, 101, lambda: pytest.fail("nested calls capture no stack"))
    d.api_exit(DRV, DRIVER_GRAPH, 11, 1, 102)
    d.api_exit(RT, RUNTIME_GRAPH, 10, 1, 103)
    d.node_created(5, 50, 0, 1, _stack(d, "captured"))
    d.record(KERNEL, "k", 1000, 1100, 0, 7, 11, 5, 50, 0)  # carries the driver's id
    d.record(KERNEL, "k", 1200, 1300, 0, 7, 10, 5, 50, 0)  # or the runtime's
    s = d.summary()
    assert s["graph_launches"] == 1 and s["api_counts"] == {"cudaGraphLaunch": 1} and s["nested_calls"] == 1
    (launch,) = d.launches()
    assert launch.kernels == 2 and launch.aliases == (11,) and launch.t_exit == 103
    (g,) = d.graph_stats()
    assert g.replays == 1 and g.kernels == 2


def test_threads_nest_independently():
    d = ProfileData()
    d.api_enter(RT, RUNTIME_KERNEL, 1, 100, 0, _stack(d, "a"))
    d.api_enter(RT, RUNTIME_KERNEL, 2, 200, 0, _stack(d, "b"))  # another thread: not nested
    d.api_exit(RT, RUNTIME_KERNEL, 2, 200, 0)
    d.api_exit(RT, RUNTIME_KERNEL, 1, 100, 0)
    assert d.summary()["kernel_launches"] == 2 and d.summary()["nested_calls"] == 0


def test_node_created_inside_a_launch_marks_it_captured_and_inherits_its_stack():
    d = ProfileData()
    d.api_enter(RT, RUNTIME_KERNEL, 1, 1, 0, _stack(d, "forward"))
    d.api_enter(DRV, DRIVER_KERNEL, 2, 1, 0, lambda: 0)
    d.node_created(9, 90, 0, 1, lambda: pytest.fail("the launch's stack is reused"))
    d.api_exit(DRV, DRIVER_KERNEL, 2, 1, 0)
    d.api_exit(RT, RUNTIME_KERNEL, 1, 1, 0)
    assert d.summary()["kernel_launches"] == 0 and d.summary()["capture_calls"] == 1
    assert d.stack(d.node(90).stack_id) == (("user.py", 1, "forward"),)


def test_clone_chains_resolve_to_the_captured_node():
    d = ProfileData()
    d.node_created(1, 10, 0, 1, _stack(d, "captured"))
    d.node_cloned(20, 10)  # instantiate
    d.node_cloned(30, 20)  # clone of the clone
    assert d.node(30).stack_id == d.node(10).stack_id and d.node(99) is None


def test_unknown_nodes_are_before_profiling_and_use_the_replay_stack():
    d = ProfileData()
    d.graph_cloned(77, 7)
    d.api_enter(RT, RUNTIME_GRAPH, 5, 1, 0, _stack(d, "replay"))
    d.api_exit(RT, RUNTIME_GRAPH, 5, 1, 0)
    d.record(KERNEL, "old", 10, 20, 0, 7, 5, 77, 700, 0)
    (st,) = d.kernel_stats()
    assert st.captured_before_profiling and st.graph_key == 7
    assert d.stack(st.stack_id)[-1][2] == "replay"
    assert d.summary()["records_before_profiling"] == 1


def test_launch_table_is_bounded():
    d = ProfileData(launch_generation=16)
    for c in range(100):
        d.api_enter(RT, RUNTIME_KERNEL, c, 1, 0, lambda: 0)
        d.api_exit(RT, RUNTIME_KERNEL, c, 1, 0)
    assert len(d._calls.table) <= 32 and d.summary()["launches_evicted"] > 0
    d.record(KERNEL, "k", 1, 2, 0, 0, 0, 0, 0, 0)  # its launch was evicted long ago
    assert d.summary()["records_without_launch"] == 1


def test_record_cap_and_aggregates_stay_exact():
    d = ProfileData(max_records=10)
    for i in range(100):
        d.record(KERNEL, "k" + str(i % 2), 100 * i + 1, 100 * i + 1 + i, 0, 7, i, 0, 0, 0)
    s = d.summary()
    assert s["records_kept"] == 10 and s["records_not_kept"] == 90 and len(d.records) == 10
    stats = {st.name: st for st in d.kernel_stats()}
    assert stats["k0"].count == 50 and stats["k0"].total_ns == sum(range(0, 100, 2))
    assert stats["k1"].min_ns == 1 and stats["k1"].max_ns == 99


def test_memcpy_and_memset_without_launch_are_not_anomalies():
    d = ProfileData()
    d.record(MEMCPY, "Memcpy HtoD", 1, 5, 0, 7, 3, 0, 0, 4096)
    d.record(MEMSET, "Memset", 6, 8, 0, 7, 4, 0, 0, 64)
    s = d.summary()
    assert s["records_without_launch"] == 0 and s["memcpys"] == 1 and s["memsets"] == 1
    assert d.records[0].bytes == 4096


def _random_workload(seed):
    """Realistic shapes: a graph launch's records all come from one graph's nodes, an eager launch
    has one kernel, memcpy/memset outside graphs have no launch; order shuffled like buffers."""
    rng = random.Random(seed)
    nodes = {g: [(100 * g + n, rng.choice([KERNEL, KERNEL, MEMCPY, MEMSET])) for n in range(4)] for g in (1, 2, 3)}
    calls, recs = [], []

    def rec(kind, corr, g, n):
        start = rng.randrange(1, 10_000) if rng.random() > 0.02 else 0
        end = start + rng.randrange(0, 500) if start else 0
        recs.append(
            (
                kind,
                rng.choice(["a", "b", "c"]),
                start,
                end,
                rng.randrange(2),
                rng.randrange(3),
                corr,
                g,
                n,
                rng.randrange(100),
            )
        )

    for c in range(1, 40):
        kind = rng.choice([RUNTIME_GRAPH, RUNTIME_KERNEL, DRIVER_GRAPH])
        calls.append(("launch", kind, c))
        if kind == RUNTIME_KERNEL:
            rec(KERNEL, c, 0, 0)
        else:
            g = rng.choice([1, 2, 3])  # graph 3 was captured before profiling
            for n, k in nodes[g]:
                rec(k, c, g, n)
    for c in range(40, 60):  # no launch callback: eager copies, and a few orphans
        r = rng.random()
        if r < 0.6:
            rec(rng.choice([MEMCPY, MEMSET]), c, 0, 0)
        elif r < 0.8:
            rec(KERNEL, c, 0, 0)
        else:
            for n, k in nodes[2]:
                rec(k, c, 2, n)
    rng.shuffle(recs)
    return calls, [(g, n) for g in (1, 2) for n, _ in nodes[g]], recs


def _feed_common(d, calls, nodes):
    d.graph_cloned(3, 33)
    for g, n in nodes:
        d.set_label(9, "graphtree:f" if g == 1 else None)
        d.node_created(g, n, 0, 9, lambda n=n: d.stacks.intern((("m.py", n % 2, "f"),)))
    for _, kind, c in calls:
        dom = DRV if kind == DRIVER_GRAPH else RT
        d.api_enter(dom, kind, c, 1, c, lambda c=c: d.stacks.intern((("m.py", c, "call"),)))
        d.api_exit(dom, kind, c, 1, c)


@pytest.mark.parametrize("seed", range(5))
def test_batch_ingest_equals_record_by_record(seed):
    np = pytest.importorskip("numpy")
    calls, nodes, recs = _random_workload(seed)
    a, b = ProfileData(max_records=300), ProfileData(max_records=300)
    _feed_common(a, calls, nodes)
    _feed_common(b, calls, nodes)
    for r in recs:
        a.record(*r)
    for kind in (KERNEL, MEMCPY, MEMSET):  # the session batches per kind and buffer
        part = [r for r in recs if r[0] == kind]
        for lo in range(0, len(part), 64):
            chunk = part[lo : lo + 64]
            names = sorted({r[1] for r in chunk})
            idx = [names.index(r[1]) for r in chunk]
            cols = [np.array([r[i] for r in chunk], dtype=np.int64) for i in range(2, 10)]
            b.record_batch(kind, names, np.array(idx), *cols)

    def digest(d):
        stats = sorted(
            (
                st.kind,
                st.name,
                st.stack_id,
                st.graph_key,
                st.captured_before_profiling,
                st.label,
                st.count,
                st.total_ns,
                st.min_ns,
                st.max_ns,
            )
            for st in d.kernel_stats()
        )
        graphs = sorted(
            (
                g.graph_key,
                g.label,
                g.captured_before_profiling,
                g.replays,
                g.kernels,
                g.total_ns,
                tuple(sorted(g.apis.items())),
            )
            for g in d.graph_stats()
        )
        launches = [(lz.correlation_id, lz.kernels, lz.gpu_ns, lz.graph_key) for lz in d.launches()]
        s = dict(d.summary())
        return stats, graphs, launches, s

    assert digest(a) == digest(b)
    assert len(a.records) == len(b.records) == min(300, len(recs))
    if len(recs) <= 300:
        assert sorted(a.records) == sorted(b.records)


def test_created_then_cloned_node_takes_the_originals_attribution():
    # the order recorded on an H200: the exec node is CREATED (outside any launch, with the stack of
    # the instantiate call), then CLONED from the captured node; the clone mapping wins
    d = ProfileData()
    d.api_enter(RT, RUNTIME_KERNEL, 1, 1, 0, _stack(d, "captured_region"))
    d.node_created(4, 40, 0, 1, lambda: pytest.fail("the launch's stack is reused"))
    d.api_exit(RT, RUNTIME_KERNEL, 1, 1, 0)
    d.node_created(5, 50, 0, 1, _stack(d, "instantiate"))
    assert d.stack(d.node(50).stack_id)[-1][2] == "instantiate"  # before its clone event: its own
    d.node_cloned(50, 40)
    assert d.stack(d.node(50).stack_id)[-1][2] == "captured_region"
    d.api_enter(RT, RUNTIME_GRAPH, 2, 1, 0, _stack(d, "replay"))
    d.api_exit(RT, RUNTIME_GRAPH, 2, 1, 0)
    d.record(KERNEL, "k", 10, 20, 0, 7, 2, 5, 50, 0)
    (st,) = d.kernel_stats()
    assert d.stack(st.stack_id)[-1][2] == "captured_region" and st.graph_key == 4
    assert not st.captured_before_profiling


def test_clone_of_a_node_captured_before_profiling_is_before_profiling():
    # graph captured before profiling, instantiated while profiling: the exec node's own creation
    # stack (the instantiate call) is not where its kernel came from
    d = ProfileData()
    d.node_created(5, 50, 0, 1, _stack(d, "instantiate"))
    d.node_cloned(50, 999)  # 999: never seen
    d.api_enter(RT, RUNTIME_GRAPH, 2, 1, 0, _stack(d, "replay"))
    d.api_exit(RT, RUNTIME_GRAPH, 2, 1, 0)
    d.record(KERNEL, "k", 10, 20, 0, 7, 2, 5, 50, 0)
    (st,) = d.kernel_stats()
    assert st.captured_before_profiling and d.stack(st.stack_id)[-1][2] == "replay"


def test_node_resolution_cache_follows_late_clone_events():
    d = ProfileData()
    d.node_created(1, 10, 0, 1, _stack(d, "a"))
    d.node_created(2, 20, 0, 1, _stack(d, "b"))
    assert d.stack(d.node(20).stack_id)[-1][2] == "b"
    d.node_cloned(20, 10)
    assert d.stack(d.node(20).stack_id)[-1][2] == "a"
