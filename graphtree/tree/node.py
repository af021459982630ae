"""One recording: a CUDA graph, how its inputs get in, how its outputs come out, and the
allocator checkpoint its children are recorded from.

A node's position in the tree is what makes it safe: it was recorded right after its parent,
with its parent's (and all ancestors') outputs that were alive at that moment kept out of its
memory. It may therefore be replayed after its parent whenever every ancestor output that was
*dead* when it was recorded is still dead (the caller may have dropped more since; never fewer).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from graphtree import _torch
from graphtree.tree.inputs import InputPlan
from graphtree.tree.outputs import OutputPlan

_ids = itertools.count(1)
_storage_at, _tensor_on = _torch.storage_at, _torch.tensor_on
_weak_ref, _weak_free = _torch.weak_ref, _torch.weak_free


class Node:
    """A recording in the tree (the root is a node with no graph)."""

    def __init__(self, parent: "Node | None", name: str, key: Any, depth: int) -> None:
        self.id = f"n{next(_ids)}" if parent is not None else "root"
        self.parent = parent
        self.name = name  # the graphed function's name
        self.key = key  # (graphed id, signature)
        self.depth = depth  # index of this node on the path (root: -1)
        self.children: dict[Any, list[Node]] = {}
        self.graph: torch.cuda.CUDAGraph | None = None
        self.launch: Callable[[], None] = _no_graph
        self.inputs = InputPlan()
        self.outputs: OutputPlan | None = None
        self.checkpoint: Any = None
        # (depth, group) of path outputs held when the checkpoint was taken (own ones included)
        self.alive_at_checkpoint: list[tuple[int, int]] = []
        # (depth, group) of ancestor outputs that were dead while recording: must be dead to replay
        self.dead_before: list[tuple[int, int]] = []
        self.refs: list[int] = []  # weak refs (ints) to this step's output storages, per group; 0: none
        self.statics: list[torch.Tensor] = []  # module parameters/buffers read in place
        self.static_ptrs: list[int] = []
        self.static_idx: list[int] = []
        self.epoch = -1
        # Nothing to check before a replay: no in-place inputs, no parameters read in place, no
        # ancestor output that had to be dead. Such a node is always replayable under its parent.
        self.unconditional = False
        self.replays = 0
        self.capture_seconds = 0.0
        self.output_bytes = 0

    def can_replay(self, leaves: list[Any], path: list["Node"], check: Callable[..., bool]) -> bool:
        """Whether replaying here keeps every held output intact and reads the right inputs."""
        plan = self.inputs
        if plan.inplace_idx and not check(list(leaves), plan.inplace_ptrs, plan.inplace_idx):
            return False
        if self.static_idx and not check(self.statics, self.static_ptrs, self.static_idx):
            return False
        if self.dead_before:
            expired = _torch.weak_expired
            for d, g in self.dead_before:
                ref = path[d].refs[g]
                if ref and not expired(ref):
                    return False
        return True

    def replay(self, leaves: list[Any], n: int, device: torch.device) -> Any:
        """Copy inputs in, launch the graph, hand out fresh output tensors.

        The hot path of graphtree: keep it free of anything that is not needed on every call.
        """
        plan = self.inputs
        raw = plan.raw
        if raw is not None:  # the key fixes shape, dtype and strides: the input is contiguous too
            raw[3](raw[1], leaves[raw[0]].data_ptr(), raw[2], plan.device)
        elif plan.single is not None:
            plan.single[0].copy_(leaves[plan.single[1]])
        elif plan.copy_idx:
            plan.copy_in(leaves, n)
        self.launch()
        outs = self.outputs
        old = self.refs
        fast = outs.single  # type: ignore[union-attr]
        if fast is not None and n == plan.bucket:  # one output on a storage of its own
            st = _storage_at(fast[0], device, fast[1])
            self.refs = [_weak_ref(st)]
            result = _tensor_on(fast[2], st)
        else:
            out, self.refs = outs.rebuild(leaves, device)  # type: ignore[union-attr]
            result = outs.finish(out, n if n != plan.bucket else -1)  # type: ignore[union-attr]
        for r in old:
            if r:
                _weak_free(r)
        self.replays += 1
        return result

    def is_held(self, g: int) -> bool:
        """Whether the caller still holds output group ``g`` of this step."""
        r = self.refs[g] if g < len(self.refs) else 0
        return bool(r) and not _torch.weak_expired(r)

    def drop_refs(self) -> None:
        """Forget this step's outputs (releasing the weak references)."""
        for r in self.refs:
            if r:
                _torch.weak_free(r)
        self.refs = [0] * len(self.refs)

    def __del__(self) -> None:
        try:
            self.drop_refs()
        except Exception:  # interpreter shutdown
            pass


def _no_graph() -> None:
    raise RuntimeError("graphtree: the root of a tree has no graph to replay")
