"""The outputs one recording handed out in the current step, and whether the caller still holds them.

A recording's outputs live in the tree's pool, at the addresses its graph writes on every replay.
While a step lasts, the caller may hold them; when it ends, those still held are invalidated
(reading one raises, saying so), and a recording made later may be placed over those dropped.
Whether an output is held is read from weak references to its storage, one per output group, or,
for a single output the caller dropped last time, from the holders of a *base* tensor the node
keeps on its memory between replays (cheaper to hand out as ``base.detach()`` than a storage and a
tensor built anew): the caller holds it while the storage has more holders than the base.

Example (what :class:`~graphtree.tree.node.Node` does after each launch)::

    live = OutputLiveness(plan, device=0, refs=plan.refs_of(first_outputs))
    out = live.hand_out(leaves, n)      # after a replay: the call's outputs
    live.is_held(0)                     # does the caller still hold the first group?
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.outputs import OutputPlan

_storage_at, _tensor_on = _torch.storage_at, _torch.tensor_on
_weak_ref, _weak_free, _weak_expired = _torch.weak_ref, _torch.weak_free, _torch.weak_expired
_use_count = _torch.storage_use_count
_refcount = sys.getrefcount


class OutputLiveness:
    """The outputs of one recording in this step: ``refs``, weak references (ints) to each output
    group's storage (0: none, or released), and the base tensor of a single output.

    Args:
        plan: how the recording's outputs are built (:class:`~graphtree.tree.outputs.OutputPlan`).
        device: the CUDA device of its pool.
        refs: the weak references of the outputs of the call that recorded it.
    """

    # (slots: the native fast hit reads and writes them at their offsets, graphtree/_native/fast_hit.h)
    __slots__ = ("_base", "_base_holders", "_base_storage", "_device", "_keep_base", "_single", "plan", "refs")

    def __init__(self, plan: OutputPlan, device: int, refs: list[int]) -> None:
        self.plan = plan
        self.refs = refs
        self._device = torch.device("cuda", device)
        self._single = plan.single  # a replay fast path (see OutputPlan.single)
        # With a single output: a tensor on its memory, and that tensor's storage object, which
        # is kept between replays while they own nothing. None until the first replay, and
        # whenever the caller may still hold the previous output.
        self._base: torch.Tensor | None = None
        self._base_storage: torch.UntypedStorage | None = None
        self._base_holders = (0, 0)  # (storage use count, storage object refcount) with only the base
        self._keep_base = False  # the caller dropped the last output before its step ended

    def hand_out(self, leaves: Sequence[Any], n: int) -> Any:
        """The outputs of a replay that just ran, built on the recording's memory (see the module)."""
        base = self._base
        if base is not None:
            return base.detach()
        one = self._single
        if one is not None:
            if self._keep_base:
                return self._new_base().detach()
            storage = _storage_at(one.ptr, self._device, one.nbytes)
            result, refs = _tensor_on(one.meta, storage), [_weak_ref(storage)]
        else:
            result, refs = self.plan.emit(leaves, n, self._device)
        self._free_refs()
        self.refs = refs
        return result

    def _new_base(self) -> torch.Tensor:
        one = self._single
        assert one is not None
        self._base_storage = _storage_at(one.ptr, self._device, one.nbytes)
        self._base = _tensor_on(one.meta, self._base_storage)
        self._free_refs()
        self.refs = [_weak_ref(self._base_storage)]
        self._base_holders = (_use_count(self.refs[0]), _refcount(self._base_storage))
        return self._base

    def _base_shared(self) -> bool:
        """Whether anything but the base holds the single output's storage: a tensor or view on it
        (its use count grows) or its storage object (``t.untyped_storage()`` hands out the base's
        own object: its Python refcount grows). Both counts are compared with those taken when
        the base was built, in the same way, so the interpreter's own references cancel out."""
        return (_use_count(self.refs[0]), _refcount(self._base_storage)) != self._base_holders

    def _free_refs(self) -> None:
        for r in self.refs:
            if r:
                _weak_free(r)

    def drop_base(self) -> None:
        """Stop keeping a tensor on the single output's memory (its storage is about to own its
        pool block: :meth:`TreeMemory.sync <graphtree.tree.memory.TreeMemory.sync>`); the weak
        reference stays."""
        self._base = self._base_storage = None

    def is_held(self, g: int) -> bool:
        """Whether the caller still holds output group ``g`` of this step."""
        r = self.refs[g] if g < len(self.refs) else 0
        if not r:
            return False
        if self._base is not None:
            return self._base_shared()
        return not _weak_expired(r)

    def held(self) -> list[tuple[int, str]]:
        """(weak ref, stale message) of each output group of this step the caller still holds."""
        groups = self.plan.groups
        return [(r, groups[g].message) for g, r in enumerate(self.refs) if self.is_held(g)]

    def release(self, held: list[tuple[int, str]]) -> None:
        """Forget this step's outputs, adding (weak ref, message) of those still held to ``held``.

        The weak references of dead outputs are freed here, except the base's, kept for the
        next replay; the caller owns those it was given (and the base goes: the storage is
        about to be invalidated).
        """
        refs = self.refs
        if self._base is not None:
            if self._base_shared():
                held.append((refs[0], self.plan.groups[0].message))
                refs[0] = 0
                self._base = self._base_storage = None
                self._keep_base = False
            return
        dropped = True
        for g, r in enumerate(refs):
            if r:
                if _weak_expired(r):
                    _weak_free(r)
                else:
                    held.append((r, self.plan.groups[g].message))
                    dropped = False
                refs[g] = 0
        self._keep_base = dropped and self._single is not None
