"""One recording: a CUDA graph, how its inputs get in, how its outputs come out, and the
allocator checkpoint its children are recorded from.

A node's position in the tree is what makes it safe: it was recorded right after its parent,
with its parent's (and all ancestors') outputs that were alive at that moment kept out of its
memory. It may therefore be replayed after its parent whenever every ancestor output that was
*dead* when it was recorded is still dead (the caller may have dropped more since; never fewer).
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NamedTuple

import torch

from graphtree import _torch
from graphtree.tree import draws as _draws
from graphtree.tree import writes as _writes
from graphtree.tree.adoption import Adoption
from graphtree.tree.breaks import Segment
from graphtree.tree.liveness import OutputLiveness
from graphtree.tree.numbers import NUMBER
from graphtree.tree.outputs import OutputPlan
from graphtree.tree.placement import InputPlan
from graphtree.tree.readable import PLAIN_TYPES
from graphtree.tree.sites import Site
from graphtree.tree.training_step import set_grads

_ids = itertools.count(1)


def next_node_id() -> str:
    """A fresh node id ("n1", "n2", ...), taken before a capture so that events can name it."""
    return f"n{next(_ids)}"


_weak_free, _weak_expired, _weak_data_ptr = _torch.weak_free, _torch.weak_expired, _torch.weak_data_ptr


class OutputRef(NamedTuple):
    """Output group ``group`` of the node at ``depth`` on the path."""

    depth: int
    group: int


class External(NamedTuple):
    """A CUDA tensor a graph reads that was not passed in (a global, a closure, an attribute)."""

    ref: int  # weak reference to its storage
    ptr: int  # its data address at the recording
    nbytes: int
    origin: str  # where it was found, for messages ("global `W` of module m")


class Root:
    """The top of a tree: no graph, only children."""

    id = "root"
    depth = -1

    __slots__ = ("__weakref__", "children")  # (children read natively at its offset: graphtree/_native/fast_hit.h)

    def __init__(self) -> None:
        self.children: dict[Any, list[Node]] = {}


class Node:
    """A recording in the tree, built whole from what its capture produced.

    Args:
        id: from :func:`next_node_id`.
        parent: the node (or root) it was recorded under.
        key: ``(graphed id, signature)``, its place among its parent's children.
        name: the graphed function's name.
        depth: its index on the path from the root.
        graph: the captured graph.
        inputs, outputs: how inputs get in and outputs come out.
        refs: weak references to the output storages of the call that recorded it (``live``:
            this step's outputs, :class:`~graphtree.tree.liveness.OutputLiveness`).
        checkpoint: the allocator's state of the pool right after the recording.
        alive_at_checkpoint: path outputs held when the checkpoint was taken (its own included).
        dead_before: ancestor outputs that were dead while recording: must be dead to replay.
        statics: parameters and buffers read in place (their addresses are checked).
        epoch: the parameter-registration epoch in which ``statics`` were read.
        capture_seconds: how long the capture took.
        input_refs: weak references to the storages of inputs read in place (static-marked
            tensors, tensors of object arguments): when all have died (or only ``adoption``
            holds them), the node is dead.
        externals: tensors the graph reads that were not passed in (globals, closures,
            attributes); when one dies or moves, the node is dead.
        writes: plain values the call wrote into its object arguments, written again after each
            replay (:mod:`graphtree.tree.writes`).
        first: for a call that read values on the host, its first segment
            (:mod:`graphtree.tree.breaks`), shared with the recordings of the call's other values;
            ``graph`` is then its last segment's.
        reads: for such a call, each break as ``describe()`` shows it ("read True at file:line").
        graph_sites: each graph a replay launches, with the Python stacks that made its nodes
            (:mod:`graphtree.tree.sites`: how a profile started later names its kernels).
        adoption: the storages of the object tensors it read in place, kept so that a new
            object of the same layout can move into them (:mod:`graphtree.tree.adoption`).
        grads: a training step's (parameter, gradient tensor) pairs: the graph writes each
            gradient there, and a replay sets ``.grad`` to it (:mod:`graphtree.tree.training_step`).
    """

    # (slots: the native fast hit reads them at their offsets, graphtree/_native/fast_hit.h)
    __slots__ = (
        "__weakref__", "_external_ptrs", "_external_refs", "_launch", "_not_kept", "adoption",
        "alive_at_checkpoint", "capture_seconds", "checkpoint", "children", "dead_before", "depth", "epoch",
        "exec", "externals", "first", "grads", "graph", "graph_sites", "id", "input_refs", "inputs", "key",
        "live", "name", "outputs", "parent", "reads", "replays", "static_idx", "static_packed",
        "static_ptrs", "statics", "statics_only", "unconditional", "writes",
    )  # fmt: skip

    def __init__(
        self,
        *,
        id: str,
        parent: Node | Root,
        key: Any,
        name: str,
        depth: int,
        graph: torch.cuda.CUDAGraph,
        inputs: InputPlan,
        outputs: OutputPlan,
        refs: list[int],
        checkpoint: Any,
        alive_at_checkpoint: list[OutputRef],
        dead_before: list[OutputRef],
        statics: list[torch.Tensor],
        epoch: int,
        capture_seconds: float,
        input_refs: list[int],
        externals: Sequence[External],
        writes: _writes.Writes = (),
        first: Segment | None = None,
        reads: Sequence[str] = (),
        graph_sites: Sequence[tuple[torch.cuda.CUDAGraph, list[Site]]] = (),
        adoption: Adoption | None = None,
        grads: Sequence[tuple[torch.Tensor, torch.Tensor]] = (),
    ) -> None:
        self.id = id
        self.parent = parent
        self.key = key
        self.name = name
        self.depth = depth
        self.children: dict[Any, list[Node]] = {}
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs
        self.live = OutputLiveness(outputs, inputs.device, refs)  # this step's outputs, held or not
        self.checkpoint = checkpoint
        self.alive_at_checkpoint = alive_at_checkpoint
        self.dead_before = dead_before
        self.statics = list(statics)
        self.static_ptrs = [t.data_ptr() for t in statics]
        self.static_idx = list(range(len(statics)))
        self.static_packed = statics_packed(self.statics)  # for the native check
        self.epoch = epoch
        self.capture_seconds = capture_seconds
        self.input_refs = input_refs
        self.externals = externals
        # packed for the native check (graphtree/_native: weak_unchanged), as the statics are
        self._external_refs = array.array("Q", [e.ref for e in externals]).tobytes()
        self._external_ptrs = array.array("Q", [e.ptr for e in externals]).tobytes()
        self.writes = writes
        self.first = first
        self.reads = list(reads)
        self.graph_sites = list(graph_sites)
        self.adoption = adoption
        self.grads = list(grads)  # (parameter, the .grad the graph writes): set again on every replay
        kept = {k.leaf for k in adoption.kept} if adoption is not None else set()
        self._not_kept = [i for i in inputs.inplace_idx if i not in kept]  # checked before an adoption
        self.replays = 0
        # Nothing to check before a replay: no in-place inputs, no parameters read in place, no
        # tensor read from outside, no ancestor output that had to be dead. Such a node is always
        # replayable under its parent.
        # A broken recording is replayable when every recording of its other values is too.
        self.unconditional = not (inputs.inplace_idx or statics or dead_before or externals or first)
        self.statics_only = bool(statics) and not (inputs.inplace_idx or dead_before or externals or first)
        self._launch = _draws.launcher(graph)
        # what the native fast hit launches itself (cudaGraphLaunch) where the graph draws nothing; 0: _launch
        self.exec = _draws.plain_exec(graph)

    def can_replay(
        self, leaves: Sequence[Any], path: list[Node], check: Callable[..., bool], native: ModuleType | None
    ) -> bool:
        """Whether replaying here keeps every held output intact and reads the right inputs.

        ``check`` compares addresses (``_torch.data_ptrs_checker``); ``native``, where built,
        checks the statics against their packed addresses in one C++ loop (graphtree/_native).
        """
        plan = self.inputs
        if plan.inplace_idx and not check(list(leaves), plan.inplace_ptrs, plan.inplace_idx):
            return False
        return self._rest_fits(path, check, native)

    def can_adopt(
        self, leaves: Sequence[Any], path: list[Node], check: Callable[..., bool], native: ModuleType | None
    ) -> bool:
        """Whether a replay would fit once the object tensors that moved are adopted into the
        storages this recording keeps (:mod:`graphtree.tree.adoption`); changes nothing."""
        a = self.adoption
        if a is None or not a.kept:  # (none, or released: tree/adoption.py's MAX_ORPHANED)
            return False
        if self._not_kept and not check(list(leaves), self.inputs.inplace_ptrs, self._not_kept):
            return False
        return a.fits(leaves) and self._rest_fits(path, check, native)

    def statics_in_place(self, check: Callable[..., bool], native: ModuleType | None) -> bool:
        """Whether the state it reads in place (a module's parameters and buffers) is where it was
        recorded: one native call where the helpers are built, else ``check`` (``ptrs_equal``'s)."""
        if native is not None:
            return bool(native.addresses_unchanged(self.statics, self.static_packed))
        return bool(check(self.statics, self.static_ptrs, self.static_idx))

    def _rest_fits(self, path: list[Node], check: Callable[..., bool], native: ModuleType | None) -> bool:
        if self.static_idx and not self.statics_in_place(check, native):
            return False
        for d, g in self.dead_before:
            if path[d].live.is_held(g):
                return False
        if not self.externals:
            return True
        if native is not None and hasattr(native, "weak_unchanged"):  # (a build from before it: the twin)
            return bool(native.weak_unchanged(self._external_refs, self._external_ptrs))
        return self._externals_in_place()

    def _externals_in_place(self) -> bool:
        return all(_weak_data_ptr(e.ref) == e.ptr for e in self.externals)

    def dead_reason(self) -> str | None:
        """Why this node can never be replayed again, or ``None``: all its in-place inputs died
        (a cache that was dropped), or a tensor it reads from outside died or moved."""
        for e in self.externals:
            if _weak_data_ptr(e.ref) != e.ptr:
                return f"{e.origin} was freed or moved since the recording"
        a = self.adoption
        if self.input_refs and all(_weak_expired(r) or (a is not None and a.keeps_alone(r)) for r in self.input_refs):
            return "every tensor it read in place was freed"  # (or is held by the recording alone)
        return None

    def replay(self, leaves: Sequence[Any], n: int) -> Any:
        """Copy inputs in, launch the graph, hand out fresh output tensors.

        The hot path of graphtree: keep it free of anything that is not needed on every call.
        A single output the caller dropped last time is handed out as ``base.detach()``: a new
        tensor object on the storage of a base tensor the node keeps, which costs a third of
        building a storage and a tensor (:mod:`graphtree.tree.liveness`). A caller that keeps
        each output until the next step (``y = f(x)`` in a loop) gets outputs built anew, as the
        held output is invalidated when its step ends, and the base with it.
        """
        self.inputs.copy_in(leaves, n)
        self._launch()
        return self.hand_out(leaves, n)

    def run_segments(self, leaves: Sequence[Any], n: int) -> tuple[Node | None, list[tuple[Segment, Any]]]:
        """A broken recording's replay up to its outputs: copy the inputs in, launch the first
        segment and, after each host read, the segment recorded for the value read.

        Returns the recording whose last segment ran (hand its outputs out with :meth:`hand_out`)
        and the segments that read values with those values; ``None`` when the last value read
        has no segment recorded after it (the segments that ran are then recorded on from there).
        """
        self.inputs.copy_in(leaves, n)
        seg = self.first
        assert seg is not None
        read: list[tuple[Segment, Any]] = []
        while True:
            seg.launch()
            if seg.read is None:
                return seg.node, read
            value = seg.read.value()
            read.append((seg, value))
            after = seg.next.get(seg.read.key(value))
            if after is None:
                return None, read
            seg = after

    def branches(self) -> list[Node]:
        """The recordings of a broken call's other values (those sharing its first segment)."""
        return [n for n in self.first.leaves if n is not self] if self.first is not None else []

    def hand_out(self, leaves: Sequence[Any], n: int) -> Any:
        """After the launch: the call's writes into its object arguments, and its outputs (see :meth:`replay`)."""
        self.replays += 1
        if self.writes:  # the Python side of the call: what it wrote into its object arguments
            _writes.apply(leaves, self.writes)
        if self.grads:  # a training step's: each parameter's .grad as the step leaves it
            set_grads(self.grads)
        return self.live.hand_out(leaves, n)

    def __del__(self) -> None:
        try:
            for r in (*self.live.refs, *self.input_refs, *(e.ref for e in self.externals)):
                if r:
                    _weak_free(r)
        except Exception:  # noqa: BLE001 - interpreter shutdown: torch may be gone
            pass


def below(parent: Node | Root) -> list[Node]:
    """The recordings right below ``parent``: its children, and beside each recording of a call
    broken at host reads, the recordings of the call's other values (found through the first
    segment they share, not among the children: :mod:`graphtree.tree.breaks`)."""
    return [x for kids in parent.children.values() for k in kids for x in (k, *k.branches())]


def statics_packed(statics: Sequence[torch.Tensor]) -> bytes:
    """What the native ``addresses_unchanged`` checks ``statics`` against: each tensor's
    ``TensorImpl`` and address, as native-endian uint64 pairs.

    Example::

        packed = statics_packed(params)
        assert _native.loaded.addresses_unchanged(params, packed)
    """
    pairs = ((_torch.tensor_impl(t), t.data_ptr()) for t in statics)
    return array.array("Q", itertools.chain.from_iterable(pairs)).tobytes()


def drop_subtree(node: Node) -> None:
    """Unlink a dropped recording and all below it, so that reference counting frees their graphs
    (a node and its children refer to each other) without waiting for the collector."""
    stack = [node, *node.branches()]  # (and the recordings of its call's other values: tree/breaks.py)
    while stack:
        n = stack.pop()
        stack.extend(below(n))
        n.children = {}
        n.parent = None  # type: ignore[assignment]
        if n.first is not None:
            n.first.unlink()


def signature(node: Node) -> str:
    """A recording as people read it: its function and the call's signature, e.g. ``step(float32[4, 8], 2)``
    (for messages, ``describe()`` and the replay-error explanation)."""
    parts: list[str] = []
    reads = ""
    for p in node.key[1]:
        if len(p) == 3 and isinstance(p[0], int):  # the ambient state (tree/ambient.py): not shown
            continue
        if p[0] == "reads":  # plain values its code reads from globals and closures (tree/reach.py)
            shown = [f"{n}={v!r}" for n, t, v in p[1] if t in PLAIN_TYPES]  # (not what is keyed by identity)
            reads = " [" + ", ".join(shown) + "]" if shown else ""
            continue
        if len(p) == 3 and p[2] is NUMBER:  # a Python number read as a device scalar (tree/host_scalars.py)
            parts.append(f"{'float' if p[1] is torch.float64 else 'int'} (device scalar)")
        elif len(p) == 3 or (len(p) == 4 and isinstance(p[1], torch.dtype)):  # tensor: (shape, dtype, stride[, bits])
            bits = p[3] if len(p) == 4 else 0
            lazy = ("conj " if bits & _torch.CONJ else "") + ("neg " if bits & _torch.NEG else "")
            parts.append(f"{'cpu ' if p[2] is None else ''}{lazy}{str(p[1]).replace('torch.', '')}{list(p[0])}")
        elif p[0] == "training":  # a graphed module's mode
            parts.append("train" if p[1] else "eval")
        elif p[0] == "keywords":  # the last len(names) leaves were passed by keyword
            k = len(p[1])
            parts[len(parts) - k :] = [f"{n}={v}" for n, v in zip(p[1], parts[len(parts) - k :], strict=True)]
        elif p[0] == "structure":  # containers among the arguments: their leaves are shown flat
            continue
        elif isinstance(p[0], type) and p[0] in PLAIN_TYPES:  # a plain value
            parts.append(repr(p[1]))
        else:  # an object argument: its type (its state is in the key, too long to show)
            parts.append(p[0].__name__ if isinstance(p[0], type) else "?")
    return f"{node.name}(" + ", ".join(parts) + ")" + reads
