"""A recording's object state handed to a new object of the same layout: a fresh cache is no new recording.

Hugging Face's ``generate()`` makes a new ``StaticCache`` for every call. Its tensors are new
allocations, so the decode step's recording, which reads the old cache's tensors where they were,
no longer fits, and every ``generate()`` recorded the step again (a capture, tens of milliseconds).

A recording keeps the storages of the tensors it read in place from object arguments
(:class:`Adoption`). A later call with the same key whose object tensors live elsewhere *adopts*
them into those storages, when that is safe:

- nothing but the recording still holds the kept storage (the old cache was dropped): otherwise
  two live objects would share memory, and the call is recorded again, as before;
- the new tensor is the only tensor on its storage, of the same size, at the same offset (the
  key fixed its shape, dtype and strides); not a parameter, not one marked static, not a
  recording's output.

Then each new tensor's values are copied into the kept storage and the tensor is re-pointed at
it (``Tensor.set_``): one device copy of the cache, on the caller's stream, before the replay that
reads it, and no capture. The new tensor's own memory goes back to the allocator. The object the
caller holds sees every later write of the graph, as its own tensors would.

Before a new recording of a callable, the call's object tensors move the same way into storages
the callable's *other* recordings keep and nobody holds (:func:`adopt_orphans`): a prefill recorded
after the decode step reads the decode step's memory, and each fresh cache is copied once for both.

The cost: the recording keeps one object's worth of memory (a cache) after the caller dropped it,
for the next object of that layout, until the recording is dropped (``reset()``, the graphed
callable collected). A recording whose kept storages nobody else holds, and that could not adopt
(a new object laid out otherwise), is dead: a new recording replaces it and reuses its pool memory.

Example (what :meth:`graphtree.tree.manager.TreeManager.call` does when no recording fits)::

    if node.adoption is not None and node.adoption.fits(leaves) and <the rest of can_replay>:
        node.adoption.adopt(leaves)    # copy + set_: the leaves are now where the graph reads
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _torch
from graphtree.tree.placement import is_marked_static


class Kept(NamedTuple):
    """One object tensor a recording read in place, and the storage it keeps for it."""

    leaf: int  # index among the call's leaves
    n_args: int  # the call's own leaves before the objects': ``leaf - n_args`` is its place among the objects' tensors
    ptr: int  # the address the graph reads (data_ptr of the recorded tensor)
    offset: int  # storage offset, in elements
    storage: torch.UntypedStorage  # a strong reference: the memory stays the graph's


# The storages live recordings keep (by StorageImpl address), with how many keep each: two
# recordings of one callable may keep the same memory (a prefill and a decode step reading one
# cache). What tells a tensor already in kept memory (adopt_orphans leaves it where it is).
_holders: Counter[int] = Counter()
_holders_lock = threading.Lock()  # (trees of several threads record and drop recordings)


def _alone(ref: int) -> bool:
    """Whether only recordings hold the kept storage ``ref``: torch gives a storage one Python
    object however often it is asked for (``untyped_storage()``), so the recordings that keep it
    count once, and any tensor on it once more."""
    return _torch.storage_use_count(ref) == 1


class Adoption:
    """The storages a recording keeps for the object tensors it read in place; see the module docstring."""

    __slots__ = ("__weakref__", "_by_id", "_finalizer", "kept")

    def __init__(self, kept: Sequence[Kept]) -> None:
        self.kept = tuple(kept)
        self._by_id = {_torch.storage_ref(k.storage): k for k in self.kept}
        with _holders_lock:
            for ref in self._by_id:
                _holders[ref] += 1
        self._finalizer = weakref.finalize(self, _release, list(self._by_id))

    @staticmethod
    def of(
        leaves: Sequence[Any], inplace_idx: Sequence[int], n_args: int, skip: Callable[[int], bool]
    ) -> Adoption | None:
        """The adoption of a recording about to be made, or ``None`` when it has nothing to adopt.

        ``inplace_idx``: the leaves read in place; ``n_args``: the leaves before it are the call's
        own arguments (outputs held, tensors marked static: never adopted); ``skip(ptr)``: whether a
        storage address is not to be kept (outputs of recordings, the tree's pool).
        """
        kept: list[Kept] = []
        seen: set[int] = set()
        for i in inplace_idx:
            t = leaves[i]
            if i < n_args or is_marked_static(t):
                continue
            s = t.untyped_storage()
            if skip(s.data_ptr()):
                continue
            ref = _torch.storage_ref(s)
            if ref in seen:  # two tensors on one storage (views of one buffer): not re-pointed one by one
                return None
            seen.add(ref)
            kept.append(Kept(i, n_args, t.data_ptr(), t.storage_offset(), s))
        return Adoption(kept) if kept else None

    def orphaned(self) -> bool:
        """Whether nobody but recordings holds any storage this adoption keeps (the objects were dropped)."""
        return bool(self.kept) and all(_alone(ref) for ref in self._by_id)

    def release(self) -> None:
        """Stop keeping the storages (their memory goes back once nobody else holds it). The recording
        then reads whatever lies at those addresses, as a recording without adoption does: it is
        replayed only for tensors found there, else dead and replaced."""
        self.kept, self._by_id = (), {}
        self._finalizer()  # (once: the holders counted at the start are given back now, not again)

    def keeps_alone(self, ref: int) -> bool:
        """Whether ``ref`` (a weak reference to a storage) is one this adoption keeps and nothing else holds."""
        return ref in self._by_id and _alone(ref)

    def fits(self, leaves: Sequence[Any]) -> bool:
        """Whether every kept tensor is where the graph reads it, or can be adopted there (no change made)."""
        for ref, k in self._by_id.items():
            t = leaves[k.leaf]
            if t.data_ptr() == k.ptr:
                continue
            if not _alone(ref):
                return False  # another object still holds the old memory
            if t.storage_offset() != k.offset or not _movable(t, k.storage.nbytes()):
                return False
        return True

    def adopt(self, leaves: Sequence[Any]) -> int:
        """Copy each moved tensor's values into its kept storage and re-point it there; after :meth:`fits`.

        Returns how many tensors moved.
        """
        moved = 0
        for k in self.kept:
            t = leaves[k.leaf]
            if t.data_ptr() != k.ptr:
                _move(t, k.storage)
                moved += 1
        return moved


MAX_ORPHANED = 4
"""Sets of kept storages nobody else holds that one callable's recordings may keep in a tree; past
it the oldest are released (:func:`release_oldest_orphans`): generate() with prompts of many
lengths makes a cache layout per length, and each would otherwise keep a cache's memory for good."""


def release_oldest_orphans(adoptions: Sequence[Adoption]) -> int:
    """Release all but the last :data:`MAX_ORPHANED` of ``adoptions`` (oldest first) that are
    orphaned; returns how many were released."""
    seen: set[int] = set()
    orphans = []
    for a in adoptions:
        if id(a) not in seen and a.orphaned():
            seen.add(id(a))
            orphans.append(a)
    extra = orphans[: max(0, len(orphans) - MAX_ORPHANED)]
    for a in extra:
        a.release()
    return len(extra)


def adopt_orphans(leaves: Sequence[Any], n_args: int, others: Sequence[Adoption]) -> int:
    """Before a new recording of a callable: move the call's object tensors into storages its other
    recordings keep and nobody else holds, each into the one kept for the same place among the
    objects' tensors (the same cache met by a prefill and by a decode step), where sizes agree.
    The new recording then reads the same memory as the others: a later fresh cache is copied once
    for all of them. Returns how many tensors moved.
    """
    spare: dict[int, torch.UntypedStorage] = {}
    for a in others:
        for k in a.kept:
            ref = _torch.storage_ref(k.storage)
            if k.leaf - k.n_args not in spare and _alone(ref):
                spare[k.leaf - k.n_args] = k.storage
    moved = 0
    taken: set[int] = set()
    for i in range(n_args, len(leaves)):
        s = spare.get(i - n_args)
        t = leaves[i]
        if s is None or not isinstance(t, torch.Tensor) or t.device != s.device:
            continue
        ref = _torch.storage_ref(s)
        if ref in taken or _holders[_torch.storage_id(t)] or not _movable(t, s.nbytes()):
            continue  # (a tensor already in kept memory stays where it is)
        _move(t, s)
        taken.add(ref)
        moved += 1
    return moved


def _movable(t: torch.Tensor, nbytes: int) -> bool:
    """Whether ``t`` may be re-pointed at another storage of ``nbytes``: a plain tensor, alone on a
    storage of that size (another view of it would be left behind)."""
    if t.requires_grad or is_marked_static(t):
        return False
    s = t.untyped_storage()
    # (the count includes ``s`` itself: 2 means one tensor, ``t``, holds the storage)
    return s.nbytes() == nbytes and _torch.storage_use_count(_torch.storage_ref(s)) == 2


def _move(t: torch.Tensor, storage: torch.UntypedStorage) -> None:
    """Copy ``t``'s values into ``storage`` at ``t``'s own offset and re-point ``t`` there."""
    with torch.no_grad(), torch.inference_mode(t.is_inference()):
        into = torch.empty(0, dtype=t.dtype, device=t.device)
        into.set_(storage, t.storage_offset(), t.shape, t.stride())
        into.copy_(t)
        if t.is_cuda:  # its old memory, freed below, is read by the copy queued on this stream
            t.record_stream(torch.cuda.current_stream(t.device))
        t.set_(storage, t.storage_offset(), t.shape, t.stride())


def _release(refs: list[int]) -> None:
    with _holders_lock:
        for ref in refs:
            _holders[ref] -= 1
            if _holders[ref] <= 0:
                del _holders[ref]
