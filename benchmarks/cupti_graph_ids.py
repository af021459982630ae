"""Which ids CUPTI's kernel records carry for a graph captured before profiling (issue 29).

Captures a small graph with ``keep_graph=True`` (no CUPTI subscribed), then traces kernel activity
during replays and prints, for each kernel record, its ``graph_node_id`` next to the template
nodes' CUPTI ids rekeyed with the executable graph's id (``(exec id << 32) | (node id &
0xFFFFFFFF)``, as PyTorch does with CUDA 13.1's tools ids). It also prints the nodes' order, the
capture frontier after each operation, and the original → clone map that ``GRAPHNODE_CLONED``
gives at a second ``instantiate()``. Run on a GPU with cupti-python and cuda-bindings::

    python benchmarks/cupti_graph_ids.py

See ``docs/cupti-graph-node-ids.md`` for what it decides.
"""

from __future__ import annotations

import cupti.cupti as cupti
import torch
from cuda.bindings import driver


def template_nodes(graph: int) -> list[object]:
    count = driver.cuGraphGetNodes(driver.CUgraph(graph), 0)[2]
    return list(driver.cuGraphGetNodes(driver.CUgraph(graph), count)[1][:count])


def frontier() -> list[int]:
    """The capture's current dependencies (the nodes the last operation added)."""
    info = driver.cuStreamGetCaptureInfo(driver.CUstream(torch.cuda.current_stream().cuda_stream))
    deps = next(x for x in info[1:] if isinstance(x, list))
    return [int(d) for d in deps if d and int(d)]


def main() -> None:
    x = torch.randn(512, 512, device="cuda")
    for _ in range(3):  # warm up: kernels loaded, cuBLAS ready
        ((x @ x).relu() + x * 2).sum()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    side = torch.cuda.Stream()
    steps: list[tuple[str, list[int]]] = []
    with torch.cuda.graph(graph):
        a = x @ x
        steps.append(("mm", frontier()))
        b = a.relu()
        steps.append(("relu", frontier()))
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            c = x * 2
            steps.append(("mul on a side stream", frontier()))
        torch.cuda.current_stream().wait_stream(side)
        d = b + c
        steps.append(("add", frontier()))
        d.sum()
        steps.append(("sum", frontier()))
    template = graph.raw_cuda_graph()
    nodes = template_nodes(template)
    index = {int(n): i for i, n in enumerate(nodes)}
    print("nodes in cuGraphGetNodes order:", [(i, driver.cuGraphNodeGetType(n)[1].name) for i, n in enumerate(nodes)])
    print("frontier after each op:", [(op, [index.get(h) for h in f]) for op, f in steps])
    for name in ("cuGraphNodeGetLocalId", "cuGraphNodeGetToolsId"):  # CUDA 13.1 calls
        try:
            print(name, getattr(driver, name)(nodes[0]) if hasattr(driver, name) else "not in these bindings")
        except RuntimeError as e:  # in the bindings, not in the driver
            print(name, "not in this driver:", e)
    node_ids = [cupti.get_graph_node_id(int(n)) for n in nodes]
    print("template graph id", cupti.get_graph_id(template), "node ids", [hex(t) for t in node_ids])

    graph.instantiate()
    records: list[tuple[str, int, int]] = []
    kernel = cupti.ActivityKind.CONCURRENT_KERNEL
    cupti.activity_register_callbacks(
        lambda: (8 << 20, 0),
        lambda acts: records.extend((a.name, a.graph_id, a.graph_node_id) for a in acts if a.kind == kernel),
    )
    cupti.activity_enable(kernel)

    def replay(label: str) -> None:
        exec_id = cupti.get_graph_exec_id(graph.raw_cuda_graph_exec())
        records.clear()
        graph.replay()
        torch.cuda.synchronize()
        cupti.activity_flush_all(1)
        rekeyed = {(exec_id << 32) | (t & 0xFFFFFFFF): i for i, t in enumerate(node_ids)}
        for name, graph_id, node_id in records:
            print(
                f"{label}: exec {exec_id} kernel {name[:40]} graph {graph_id} node {hex(node_id)} "
                f"-> template node {rekeyed.get(node_id)} (a template id itself: {node_id in node_ids})"
            )

    replay("first instantiate")
    clones: list[tuple[str, str]] = []

    def on_resource(userdata: object, domain: int, cbid: int, data: object) -> None:
        if cbid == cupti.CallbackIdResource.GRAPHNODE_CLONED:
            res = data if hasattr(data, "resource_descriptor") else cupti.ResourceData.from_ptr(data)
            g = cupti.GraphData.from_ptr(res.resource_descriptor)
            clones.append((hex(cupti.get_graph_node_id(g.original_node)), hex(cupti.get_graph_node_id(g.node))))

    subscriber = cupti.subscribe(on_resource, None)
    cupti.enable_callback(1, subscriber, cupti.CallbackDomain.RESOURCE, cupti.CallbackIdResource.GRAPHNODE_CLONED)
    graph.instantiate()
    print("GRAPHNODE_CLONED at the second instantiate (original -> clone):", clones)
    replay("second instantiate")


if __name__ == "__main__":
    main()
