"""Outputs of a recording: rebuilding them on replay, and knowing which ones the caller holds.

Every replay hands out *new* tensor objects on the recording's output memory (storages that own
nothing), so an output from an earlier step is never silently the same object as a new one.
Outputs that share memory share one storage, as they did in eager mode. The tree keeps only
weak references to these storages: a storage nobody holds is *dead*, and its memory may be
reused by the next recording. When a new step starts, every output still held is
*invalidated*: reading it raises a ``RuntimeError`` that names the function, the output and
the fix, instead of returning values a later replay overwrote.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _torch
from graphtree.tree.capture import CaptureFailed
from graphtree.tree.object_state import HeldTensors, read_object
from graphtree.tree.readable import PLAIN_TYPES as _PLAIN
from graphtree.tree.readable import Unsupported


def _check_constant(value: Any, in_pool: Callable[[int], bool], fn_name: str) -> None:
    """Refuse an output object that holds tensors of this recording: a replay could not rebuild it."""
    if type(value) in _PLAIN:
        return
    held = HeldTensors()
    try:
        read_object(value, held)
    except Unsupported:
        return  # not state graphtree can see into; it is returned as it was
    mine = [
        t
        for t in held.tensors
        if t.is_cuda and t.untyped_storage().nbytes() and in_pool(t.untyped_storage().data_ptr())
    ]
    if mine:
        raise CaptureFailed(
            f"`{fn_name}` returns a {type(value).__name__} holding {len(mine)} tensor(s) it computed, which a "
            f"replay cannot rebuild: return tensors, tuples, lists or dicts of them, or register "
            f"{type(value).__name__} as a pytree node (torch.utils._pytree.register_pytree_node)"
        )


def stale_message(fn_name: str, outputs: Sequence[int], where: str) -> str:
    """The error a caller sees when reading an output whose memory was reused."""
    which = "output " + ", ".join(str(i) for i in outputs)
    return (
        f"graphtree: {which} of `{fn_name}` ({where}) was overwritten: a new step began "
        f"(graphtree.mark_step(), or `{fn_name}` was called again, which starts one) and the "
        f"graph reuses that memory. Fix: keep it with `.clone()` before the next step, or call "
        f"graphtree.mark_step() once per iteration so that calls within an iteration keep "
        f"their outputs."
    )


# --- what each output leaf is, and how a replay rebuilds it ----------------------------------------
# ``make(storages, in_leaves, done)``: the leaf for this replay, given the group storages, the
# caller's leaves and the leaves built so far.
class FromPool(NamedTuple):
    """A tensor on pool memory: output group ``group`` (one storage), with ``meta``'s layout and the
    conjugate and negative bits ``bits`` (:func:`graphtree._torch.lazy_bits`)."""

    group: int
    meta: dict[str, Any]
    bits: int = 0

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        t = _torch.tensor_on(self.meta, storages[self.group])
        return _torch.flip_bits(t, self.bits) if self.bits else t


class FromInput(NamedTuple):
    """A view of input ``leaf`` (the function returned its input, or a view of it) as ``dtype``
    (``view_as_real``, ``.imag``, ``Tensor.view(dtype)`` change it); ``offset`` counts bytes from the
    input's own storage offset (a copied input's placeholder starts its storage; the caller's tensor
    may be a view into a larger one); ``bits``: the conjugate and negative bits the view flips
    (:func:`graphtree._torch.lazy_bits`: ``torch.conj``)."""

    leaf: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    bits: int = 0

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        x = in_leaves[self.leaf]
        offset = x.storage_offset() * x.element_size() + self.offset
        if x.dtype != self.dtype:
            x = _retyped(x, self.dtype)
        t = x.as_strided(self.size, self.stride, offset // x.element_size())
        return _torch.flip_bits(t, self.bits) if self.bits else t


def _retyped(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A view of ``x``'s whole storage as ``dtype``, from its first byte (what a view that changed
    the dtype is an ``as_strided`` of)."""
    nbytes = x.untyped_storage().nbytes()
    whole = x.as_strided((nbytes // x.element_size(),), (1,), 0).view(torch.uint8)
    return whole[: nbytes - nbytes % dtype.itemsize].view(dtype)


class Constant(NamedTuple):
    """A value that is the same object on every call: a plain value, or a tensor the function
    holds elsewhere (a parameter, a global)."""

    value: Any

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        return self.value


class SameObject(NamedTuple):
    """The object the caller passed as leaf ``leaf`` (a cache, a module the function returns)."""

    leaf: int

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        return in_leaves[self.leaf]


class Repeat(NamedTuple):
    """The same object as output leaf ``leaf`` (returned twice)."""

    leaf: int

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        return done[self.leaf]


class Empty(NamedTuple):
    """A tensor with no bytes: made anew, it has no memory to share."""

    meta: dict[str, Any]

    def make(self, storages: list[torch.UntypedStorage], in_leaves: Sequence[Any], done: list[Any]) -> Any:
        m = self.meta
        return torch.empty_strided(m["size"], m["stride"], dtype=m["dtype"], device=m["device"])


Kind = FromPool | FromInput | Constant | SameObject | Repeat | Empty


class Group(NamedTuple):
    """One storage of pool memory that outputs live on."""

    ptr: int
    nbytes: int
    message: str  # what reading an invalidated output of this group says


class SingleOutput(NamedTuple):
    """The replay fast path: the output is one tensor with ``meta``'s layout on a storage of its own."""

    ptr: int
    nbytes: int
    meta: dict[str, Any]


class OutputPlan:
    """How to rebuild a recording's outputs from its memory on every replay.

    Built by :meth:`from_recording`. ``single`` is set when the outputs are one tensor on a
    storage of its own, which a replay builds inline; :meth:`emit` builds any outputs.
    """

    def __init__(
        self,
        spec: Any,
        kinds: list[Kind],
        groups: list[Group],
        slice_idx: list[int],
        pad_dim: int,
        bucket: int,
    ) -> None:
        self.spec = spec  # None: a single leaf; "tuple": a flat tuple; else a pytree spec
        self.kinds = kinds
        self.groups = groups
        self.slice_idx = slice_idx  # leaves to cut back to the real batch
        self.pad_dim = pad_dim
        self.bucket = bucket
        self.nbytes = sum(g.nbytes for g in groups)
        self.single: SingleOutput | None = None
        if spec is None and len(kinds) == 1 and isinstance(kinds[0], FromPool) and not kinds[0].bits and not slice_idx:
            self.single = SingleOutput(groups[0].ptr, groups[0].nbytes, kinds[0].meta)

    @classmethod
    def from_recording(
        cls,
        out: Any,
        in_leaves: Sequence[Any],
        in_pool: Callable[[int], bool],
        fn_name: str,
        bucket: int,
        pad_dim: int,
    ) -> tuple[OutputPlan, list[Any]]:
        """Describe ``out`` (the outputs of a capture) and return it flattened.

        ``in_leaves`` are the tensors the graph read (placeholders in place of copied inputs,
        the caller's tensors otherwise); ``in_pool(ptr)`` says whether an address is pool memory.
        """
        spec: Any
        if isinstance(out, torch.Tensor):
            leaves, spec = [out], None
        elif type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
            leaves, spec = list(out), "tuple"
        else:
            leaves, spec = _torch.flatten_outputs(out)
        input_storage: dict[int, int] = {}
        input_objects: dict[int, int] = {}
        for i, x in enumerate(in_leaves):
            if isinstance(x, torch.Tensor):
                if x.numel():
                    input_storage.setdefault(x.untyped_storage().data_ptr(), i)
            elif type(x) not in _PLAIN:
                input_objects.setdefault(id(x), i)
        kinds: list[Kind] = []
        slice_idx: list[int] = []
        group_of: dict[int, int] = {}  # storage address -> group
        group_outputs: list[list[int]] = []
        seen: dict[int, int] = {}
        for j, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                if id(t) in input_objects:
                    kinds.append(SameObject(input_objects[id(t)]))
                else:
                    _check_constant(t, in_pool, fn_name)
                    kinds.append(Constant(t))
                continue
            if id(t) in seen:
                kinds.append(Repeat(seen[id(t)]))
                continue
            seen[id(t)] = j
            if bucket >= 0 and t.dim() > pad_dim and t.shape[pad_dim] == bucket:
                slice_idx.append(j)
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if storage.nbytes() == 0:
                kinds.append(Empty(_torch.meta_of(t)))
            elif ptr in input_storage:
                x = in_leaves[input_storage[ptr]]
                offset = t.storage_offset() * t.element_size() - x.storage_offset() * x.element_size()
                bits = _torch.lazy_bits(t) ^ _torch.lazy_bits(x)
                kinds.append(FromInput(input_storage[ptr], tuple(t.shape), t.stride(), offset, t.dtype, bits))
            elif in_pool(ptr):
                g = group_of.setdefault(ptr, len(group_outputs))
                if g == len(group_outputs):
                    group_outputs.append([])
                group_outputs[g].append(j)
                kinds.append(FromPool(g, _torch.meta_of(t), _torch.lazy_bits(t)))
            else:  # memory the function holds elsewhere (a parameter, a global): same object
                kinds.append(Constant(t))
        groups = []
        for ptr, g in group_of.items():
            t = leaves[group_outputs[g][0]]
            where = f"{t.dtype} {list(t.shape)}".replace("torch.", "")
            groups.append(Group(ptr, t.untyped_storage().nbytes(), stale_message(fn_name, group_outputs[g], where)))
        return cls(spec, kinds, groups, slice_idx, pad_dim, bucket), leaves

    def adopt(self, leaves: list[Any], caller_leaves: Sequence[Any]) -> list[Any]:
        """Point outputs that alias an input at the caller's tensor, not at its placeholder."""
        leaves = list(leaves)
        for j, k in enumerate(self.kinds):
            if isinstance(k, (FromInput, SameObject, Repeat)):
                leaves[j] = k.make([], caller_leaves, leaves)
        return leaves

    def refs_of(self, leaves: Sequence[Any]) -> list[int]:
        """Weak references (see :func:`graphtree._torch.weak_ref`) to the pool outputs' storages."""
        refs: list[int] = [0] * len(self.groups)
        for j, k in enumerate(self.kinds):
            if isinstance(k, FromPool) and not refs[k.group]:
                refs[k.group] = _torch.weak_ref(leaves[j].untyped_storage())
        return refs

    def emit(self, caller_leaves: Sequence[Any], n: int, device: torch.device) -> tuple[Any, list[int]]:
        """This replay's outputs (cut back to ``n`` rows where bucketed) and weak references
        to their group storages."""
        storages = [_torch.storage_at(g.ptr, device, g.nbytes) for g in self.groups]
        done: list[Any] = []
        for k in self.kinds:
            done.append(k.make(storages, caller_leaves, done))
        return self.finish(done, n), [_torch.weak_ref(s) for s in storages]

    def finish(self, leaves: list[Any], n: int) -> Any:
        """Cut bucketed outputs back to the real batch ``n`` and rebuild the output structure."""
        if self.slice_idx and 0 <= n != self.bucket:
            for j in self.slice_idx:
                leaves[j] = leaves[j].narrow(self.pad_dim, 0, n)
            for j, k in enumerate(self.kinds):
                if isinstance(k, Repeat):
                    leaves[j] = leaves[k.leaf]
        if self.spec is None:
            return leaves[0]
        if self.spec == "tuple":
            return tuple(leaves)
        return _torch.tree_unflatten(leaves, self.spec)
