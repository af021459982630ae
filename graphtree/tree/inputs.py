"""Inputs of a graphed call: reading the call, the recording key, and how each input reaches the graph.

A recording is keyed by the call's *signature*: for each tensor its shape, dtype, strides and
device; for each plain Python value (int, float, bool, str, None, dtype, device) the value
itself, with its type. Each tensor input then reaches the graph one of two ways:

- **in place** (its address is baked into the graph and only checked on replay): tensors the
  caller marked static (:func:`graphtree.mark_static`), ``nn.Parameter`` s, and outputs of an
  earlier recording on the current path that are still at their recorded address;
- **copied** into a placeholder the graph reads, all of them in one fused copy before replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _torch

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_Tensor = torch.Tensor


class Unsupported(Exception):
    """The call cannot be graphed; ``str(self)`` is the reason shown in ``stats()``."""


def flatten(args: tuple, kwargs: dict) -> tuple[Sequence[Any], Any]:
    """The call's leaves and a spec to rebuild it (``None`` when it is plain positional).

    Plain positional calls hand back ``args`` itself: the leaves are only read, and code that
    needs to change one makes a list first.
    """
    if not kwargs:
        for a in args:
            if not isinstance(a, _Tensor) and type(a) not in _PLAIN:
                break
        else:
            return args, None
    return _torch.tree_flatten((args, kwargs))


def unflatten(leaves: Sequence[Any], spec: Any) -> tuple[tuple, dict]:
    """Inverse of :func:`flatten`."""
    if spec is None:
        return tuple(leaves), {}
    args, kwargs = _torch.tree_unflatten(list(leaves), spec)
    return args, kwargs


class Bucketing:
    """Pad dimension ``dim`` of the inputs up to the next of ``sizes`` (kept sorted ascending).

    Example::

        b = Bucketing([8, 1, 4], dim=0)
        b.bucket_for(3)   # 4
    """

    def __init__(self, sizes: Sequence[int], dim: int = 0) -> None:
        ok = isinstance(sizes, (list, tuple, range)) and len(sizes) > 0
        if not ok or any(type(s) is not int or s <= 0 for s in sizes):
            raise ValueError(f"buckets must be a non-empty list of positive ints (not bools), got {sizes!r}")
        if type(dim) is not int or dim < 0:
            raise ValueError(f"bucket_dim must be a non-negative int, got {dim!r}")
        self.sizes: list[int] = sorted(set(sizes))
        self.dim = dim

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket that holds ``n`` rows, or ``None`` if none does."""
        for s in self.sizes:
            if s >= n:
                return s
        return None


class Call:
    """One call, read once: its leaves, the recording key, the device and the padding."""

    __slots__ = ("bucket", "device", "key", "leaves", "n", "needs_grad", "padded", "spec")

    def __init__(
        self,
        leaves: Sequence[Any],
        spec: Any,
        key: tuple,
        device: int,
        needs_grad: bool,
        n: int = -1,
        bucket: int = -1,
        padded: tuple[int, ...] = (),
    ) -> None:
        self.leaves = leaves
        self.spec = spec  # None: plain positional (see flatten)
        self.key = key
        self.device = device  # -2: no tensor among the leaves
        self.needs_grad = needs_grad
        self.n = n  # the real size of the bucketed dimension (-1: no bucketing)
        self.bucket = bucket
        self.padded = padded  # indices of leaves padded to the bucket

    def arguments(self, leaves: Sequence[Any] | None = None) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of this call, optionally with other leaves in place of its own."""
        return unflatten(self.leaves if leaves is None else leaves, self.spec)


def read_call(args: tuple, kwargs: dict, bucketing: Bucketing | None) -> Call:
    """Flatten a call, build its recording key and check that it can be graphed at all.

    Raises :class:`Unsupported` for CPU tensors among CUDA ones, tensors on several GPUs,
    an argument of a type that has no stable value, or a batch larger than every bucket.
    """
    leaves, spec = flatten(args, kwargs)
    parts: list[Any] = []
    device = -2
    needs_grad = False
    if bucketing is None:  # the common case, kept lean: it runs on every call
        for x in leaves:
            if isinstance(x, _Tensor):
                d = x.get_device()
                if d != device:
                    if d < 0:
                        raise Unsupported("CPU tensor inputs" if device < 0 else "mixed-device inputs (CPU and CUDA)")
                    if device != -2:
                        raise Unsupported(f"mixed-device inputs (cuda:{device} and cuda:{d})")
                    device = d
                parts.append((x.shape, x.dtype, x.stride()))
                if x.requires_grad:
                    needs_grad = True
            elif type(x) in _PLAIN:
                parts.append((type(x), x))
            else:
                raise _unsupported_type(x)
        return Call(leaves, spec, tuple(parts), device, needs_grad)
    n = bucket = -1
    padded: list[int] = []
    dim = bucketing.dim
    for x in leaves:
        if isinstance(x, _Tensor) and x.dim() > dim:
            n = x.shape[dim]
            break
    if n >= 0:
        b = bucketing.bucket_for(n)
        if b is None:
            raise Unsupported(f"batch of {n} is larger than the largest bucket ({bucketing.sizes[-1]})")
        bucket = b
    for i, x in enumerate(leaves):
        if isinstance(x, _Tensor):
            d = x.get_device()
            if d < 0:
                raise Unsupported("CPU tensor inputs" if device < 0 else "mixed-device inputs (CPU and CUDA)")
            if device == -2:
                device = d
            elif d != device:
                raise Unsupported(f"mixed-device inputs (cuda:{device} and cuda:{d})")
            shape = x.shape
            if bucket >= 0 and x.dim() > dim and shape[dim] == n:
                padded.append(i)
                shape = (*shape[:dim], bucket, *shape[dim + 1 :])
                parts.append((shape, x.dtype, _contiguous_strides(shape)))  # padded: contiguous placeholder
            else:
                parts.append((shape, x.dtype, x.stride()))
            needs_grad = needs_grad or x.requires_grad
        elif type(x) in _PLAIN:
            parts.append((type(x), x))
        else:
            raise _unsupported_type(x)
    return Call(leaves, spec, tuple(parts), device, needs_grad, n, bucket, tuple(padded))


def _unsupported_type(x: Any) -> Unsupported:
    return Unsupported(f"argument of type {type(x).__name__} (graphtree keys recordings on tensors and plain values)")


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def is_marked_static(t: torch.Tensor) -> bool:
    """Whether the caller asked for ``t`` to be used in place (see :func:`graphtree.mark_static`)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_graphtree_static", False)


class RawCopy(NamedTuple):
    """The replay fast path for one contiguous copied input: ``copy(dst, leaves[leaf].data_ptr(), nbytes, device)``
    (a ``cudaMemcpyAsync``, see :func:`graphtree._torch.raw_copier`)."""

    leaf: int
    dst: int
    nbytes: int
    device: int
    copy: Callable[[int, int, int, int], None]


class InputPlan:
    """How a recording's tensor inputs reach its graph; built once, applied on every replay.

    ``raw`` is set when the whole copy-in is one ``cudaMemcpyAsync`` (one contiguous, unpadded
    copied input); :meth:`copy_in` does any plan.
    """

    def __init__(
        self,
        *,
        inplace_idx: list[int],
        inplace_ptrs: list[int],
        copy_idx: list[int],
        placeholders: list[torch.Tensor],
        padded: tuple[int, ...],
        pad_dim: int,
        bucket: int,
        device: int,
    ) -> None:
        self.inplace_idx = inplace_idx
        self.inplace_ptrs = inplace_ptrs  # aligned with the leaves; 0 elsewhere
        self.copy_idx = copy_idx
        self.placeholders = placeholders  # non-owning views into the pool
        self.padded = padded
        self.pad_dim = pad_dim
        self.bucket = bucket
        self.device = device
        self.raw = self._raw_copy()

    def _raw_copy(self) -> RawCopy | None:
        if len(self.copy_idx) != 1 or self.padded:
            return None
        ph = self.placeholders[0]
        # The key fixes shape, dtype and strides: a contiguous placeholder means a contiguous input.
        copy = _torch.raw_copier() if ph.is_contiguous() and ph.numel() else None
        if copy is None:
            return None
        return RawCopy(self.copy_idx[0], ph.data_ptr(), ph.numel() * ph.element_size(), self.device, copy)

    def copy_in(self, leaves: Sequence[Any], n: int) -> None:
        """Copy the copied inputs into their placeholders (padding rows past ``n`` are zeroed)."""
        if not self.copy_idx:
            return
        if not self.padded or n == self.bucket:
            if len(self.copy_idx) == 1:
                self.placeholders[0].copy_(leaves[self.copy_idx[0]])
            else:
                _torch.foreach_copy(self.placeholders, [leaves[i] for i in self.copy_idx])
            return
        dsts, srcs = [], []
        for ph, i in zip(self.placeholders, self.copy_idx):
            if i in self.padded:
                ph.narrow(self.pad_dim, n, self.bucket - n).zero_()
                ph = ph.narrow(self.pad_dim, 0, n)
            dsts.append(ph)
            srcs.append(leaves[i])
        _torch.foreach_copy(dsts, srcs)


def place_inputs(
    call: Call, held: set[int], device: int, pad_dim: int
) -> tuple[InputPlan, list[Any], list[torch.Tensor]]:
    """Decide how each tensor input of ``call`` reaches the graph about to be captured.

    Static-marked tensors, parameters and inputs whose storage address is in ``held`` (outputs
    of the current path) are read in place; the others get a placeholder, allocated here from
    the current allocation context (the tree's pool). Returns the plan, the leaves the capture
    runs on (placeholders in place of copied inputs) and the placeholders themselves, which the
    caller keeps alive until the capture is over.
    """
    leaves = call.leaves
    dev = torch.device("cuda", device)
    inplace_idx: list[int] = []
    inplace_ptrs = [0] * len(leaves)
    copy_idx: list[int] = []
    views: list[torch.Tensor] = []
    owning: list[torch.Tensor] = []
    graph_leaves = list(leaves)
    for i, x in enumerate(leaves):
        if not isinstance(x, _Tensor):
            continue
        if i not in call.padded and (is_marked_static(x) or x.untyped_storage().data_ptr() in held):
            inplace_idx.append(i)
            inplace_ptrs[i] = x.data_ptr()
            continue
        shape, dtype, stride = call.key[i]
        ph = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
        owning.append(ph)
        graph_leaves[i] = ph
        copy_idx.append(i)
        storage = ph.untyped_storage()
        views.append(_torch.tensor_on(_torch.meta_of(ph), _torch.storage_at(storage.data_ptr(), dev, storage.nbytes())))
    plan = InputPlan(
        inplace_idx=inplace_idx,
        inplace_ptrs=inplace_ptrs,
        copy_idx=copy_idx,
        placeholders=views,
        padded=call.padded,
        pad_dim=pad_dim,
        bucket=call.bucket,
        device=device,
    )
    return plan, graph_leaves, owning


def mutation_watch(leaves: Sequence[Any], idx: Sequence[int]) -> _torch.MutationWatch:
    """A dispatch mode that notes which of ``leaves[i]`` (i in idx) an operation writes to."""
    return _torch.MutationWatch({leaves[i].untyped_storage().data_ptr(): i for i in idx if leaves[i].numel()})
