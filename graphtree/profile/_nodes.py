"""The graph nodes the profiler saw created and cloned (:class:`GraphNodes`, a part of
``ProfileData``), and what each resolves to: the Python stack and graphtree recording that made it.

At instantiation CUDA first reports the exec graph's node as *created* (with the stack of the
instantiate call), then as *cloned* from the captured node; the kernel belongs to the code that was
captured, so a clone resolves through its chain to the original node's attribution.

Example::

    >>> nodes = GraphNodes()
    >>> nodes.created(graph_id=1, node_id=10, node_type=0, stack_id=5, label="step")
    >>> nodes.cloned(node_id=20, original_node_id=10)
    >>> nodes.resolve(20).stack_id
    5
"""

from __future__ import annotations

from graphtree.profile._records import NodeInfo

_MAX_CHAIN = 32  # clone chains followed at most this far
_MAX_RESOLVED = 1_000_000  # resolutions cached at most (then forgotten)


class GraphNodes:
    """Graph nodes by id, the clone mappings of nodes and graphs, and a cache of resolutions."""

    def __init__(self) -> None:
        self._nodes: dict[int, NodeInfo] = {}
        self._clones: dict[int, int] = {}  # node id -> the node it is a copy of
        self._resolved: dict[int, NodeInfo | None] = {}  # node id -> resolve() (cache)
        self._graph_clones: dict[int, int] = {}  # graph id -> the graph it is a copy of
        self.created_count = 0
        self.cloned_count = 0

    def created(self, graph_id: int, node_id: int, node_type: int, stack_id: int, label: str | None) -> None:
        """CUPTI created graph node ``node_id``, attributed to ``stack_id`` and ``label``."""
        self._nodes[node_id] = NodeInfo(graph_id, node_type, stack_id, label)
        self._resolved.pop(node_id, None)
        if self._clones:
            self._resolved.clear()  # a clone chain may end at this node
        self.created_count += 1

    def cloned(self, node_id: int, original_node_id: int) -> None:
        """Node ``node_id`` (of an instantiated or cloned graph) is a copy of ``original_node_id``:
        the mapping wins over what :meth:`created` said of ``node_id`` (see the module docstring)."""
        if node_id != original_node_id:
            self._clones[node_id] = original_node_id
            self._resolved.clear()
        self.cloned_count += 1

    def graph_cloned(self, graph_id: int, original_graph_id: int) -> None:
        """Graph ``graph_id`` is a copy of ``original_graph_id``."""
        if graph_id != original_graph_id:
            self._graph_clones[graph_id] = original_graph_id

    @property
    def any_graph_cloned(self) -> bool:
        """Whether some graph is known to be a copy of another."""
        return bool(self._graph_clones)

    def graph_origin(self, graph_id: int) -> int:
        """The graph ``graph_id`` is a copy of, or ``graph_id`` itself."""
        return self._graph_clones.get(graph_id, graph_id)

    def resolve(self, node_id: int) -> NodeInfo | None:
        """What node ``node_id`` is attributed to: a cloned node resolves through its clone chain
        to the original node (``None`` when the original is unknown: captured before profiling);
        a node that is no clone resolves to what :meth:`created` recorded for it."""
        try:
            return self._resolved[node_id]
        except KeyError:
            pass
        nid = node_id
        seen = 0
        while nid in self._clones and seen < _MAX_CHAIN:
            nid = self._clones[nid]
            seen += 1
        node = self._nodes.get(nid)
        if len(self._resolved) > _MAX_RESOLVED:
            self._resolved.clear()
        self._resolved[node_id] = node
        return node
