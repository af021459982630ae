"""Where one tree's calls stand in the current step, and what ending a step does to their outputs.

A step (generation) is the unit of output lifetime (:mod:`graphtree.tree.manager`): within one,
calls walk down the tree from its root, each replayed or recorded node appended to the path, and
every output stays valid. Ending the step goes back to the root and invalidates the outputs of
the step that ended that the caller still holds (reading one raises, saying so); an input of the
call that starts the next step that is one of them is cloned first.

A failed capture leaves torch's pool unable to take another: the tree is given up whole
(:meth:`Walk.retire`) and recordings start again under a new root, while the old path is kept until
the step ends, as the caller may still hold its outputs.

Example (what :class:`~graphtree.tree.manager.TreeManager` does)::

    walk = Walk()
    walk.enter(node)                  # a node replayed or recorded in this step
    leaves = walk.end_step(leaves)    # back to the root: the step's held outputs invalidated
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.node import Node, Root, below, drop_subtree
from graphtree.tree.pool import Pool


class Walk:
    """The path of one tree's current step, from its root, and the trees retired during it."""

    # (slots: the native fast hit reads and writes them at their offsets, graphtree/_native/fast_hit.h)
    __slots__ = (
        "called", "current", "generation", "last_replayed", "path", "retired", "root", "step_requested", "warming",
    )  # fmt: skip

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Start again from an empty tree, at step 0 (every recording dropped)."""
        self.root = Root()
        self.current: Node | Root = self.root
        self.path: list[Node] = []
        self.last_replayed: Node | None = None  # the last node of an ended step (see replay_error)
        self.generation = 0
        self.step_requested = False
        self.warming = False  # once a step has warmed up, the rest of it warms up too
        self.called: set[int] = set()  # graphed functions called in this step
        # Trees given up after a failed capture, kept until the step ends: their outputs may still
        # be held. (torch leaves a pool it failed to capture into unable to take another capture.)
        self.retired: list[tuple[Pool | None, list[Node]]] = []

    def enter(self, node: Node) -> None:
        """``node`` was replayed or recorded: the step goes on below it."""
        self.path.append(node)
        self.current = node

    def held_outputs(self) -> list[tuple[int, str]]:
        """(weak ref, message) of every output of this step the caller still holds."""
        held = held_in(self.path)
        for _pool, path in self.retired:
            held.extend(held_in(path))
        return held

    def held_since(self, start: int) -> set[int]:
        """The storages of held outputs of the nodes the step entered after its first ``start``, or
        of a retired tree."""
        held = {r for r, _ in held_in(self.path[start:] if start <= len(self.path) else self.path)}
        held.update(r for _pool, path in self.retired for r, _ in held_in(path))
        return held

    def end_step(self, leaves: Sequence[Any]) -> Sequence[Any]:
        """Go back to the root; invalidate outputs of the step that ends (cloning ``leaves`` among
        them: the call that starts the next step still reads them)."""
        held: list[tuple[int, str]] = []  # invalidated below; the weak refs of the path's are freed too
        for node in self.path:
            node.live.release(held)
        release = [r for r, _ in held] if held else ()  # (the common case: the caller kept nothing)
        if self.retired:  # their nodes release their own refs when they are dropped
            for _pool, path in self.retired:
                held.extend(held_in(path))
            self.retired = []
        if held:
            doomed = {r for r, _ in held}
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor) and _torch.storage_id(x) in doomed:
                    leaves = list(leaves)
                    leaves[i] = x.clone()
            for r, msg in held:
                _torch.invalidate_storage(r, msg)
            for r in release:
                _torch.weak_free(r)
        if self.path:
            self.last_replayed = self.path[-1]
        self.path = []
        self.current = self.root
        self.warming = False
        self.called.clear()
        self.step_requested = False
        self.generation += 1
        return leaves

    def retire(self, pool: Pool | None) -> None:
        """Give the tree up (a failed capture): keep its path and pool until the step ends, and
        start again under a new root."""
        self.retired.append((pool, self.path))
        self.root = Root()
        self.current = self.root
        self.path = []

    def prune(self, dead: set[int]) -> None:
        """Drop the recordings of the graphed callables whose ids are in ``dead``, with everything
        recorded under them."""
        stack: list[Node | Root] = [self.root]
        while stack:
            parent = stack.pop()
            for key in [k for k in parent.children if k[0] in dead]:
                for node in parent.children.pop(key):
                    drop_subtree(node)
            stack.extend(below(parent))
        if self.last_replayed is not None and self.last_replayed.key[0] in dead:
            self.last_replayed = None

    def alive_siblings(self, key: Any) -> tuple[list[Node], int]:
        """The recordings of ``key`` under the current node, and how many dead ones (see
        :meth:`Node.dead_reason`) were dropped from them: those are replaced without counting as
        re-recordings, and the new recording reuses their memory (it starts from the same checkpoint)."""
        kids = self.current.children.get(key)
        if not kids:
            return [], 0
        alive = [n for n in kids if n.dead_reason() is None]
        if len(alive) < len(kids):
            self.current.children[key] = alive
        return alive, len(kids) - len(alive)

    def nodes(self) -> list[Node]:
        """Every recording of the tree."""
        out: list[Node] = []
        stack: list[Node | Root] = [self.root]
        while stack:
            kids = below(stack.pop())
            out.extend(kids)
            stack.extend(kids)
        return out


def held_in(path: list[Node]) -> list[tuple[int, str]]:
    """(weak ref, message) of the outputs of ``path`` the caller still holds."""
    return [pair for node in path for pair in node.live.held()]
