"""Inputs of a graphed call: flattening, the recording key, and how each input reaches the graph.

A recording is keyed by the call's *signature*: for each tensor its shape, dtype, strides and
device; for each plain Python value (int, float, bool, str, None, dtype, device) the value
itself, with its type. Each tensor input then reaches the graph one of two ways:

- **in place** (its address is baked into the graph and only checked on replay): tensors the
  caller marked static (:func:`graphtree.mark_static`), ``nn.Parameter`` s, and outputs of an
  earlier recording on the current path that are still at their recorded address;
- **copied** into a placeholder the graph reads, all of them in one fused copy before replay.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

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


def unflatten(leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
    """Inverse of :func:`flatten`."""
    if spec is None:
        return tuple(leaves), {}
    args, kwargs = _torch.tree_unflatten(leaves, spec)
    return args, kwargs


@dataclass
class Bucketing:
    """Pad dimension ``dim`` of the inputs up to the next of ``sizes`` (sorted ascending)."""

    sizes: list[int]
    dim: int = 0

    def __post_init__(self) -> None:
        if not self.sizes or any((not isinstance(s, int)) or s <= 0 for s in self.sizes):
            raise ValueError(f"buckets must be positive ints, got {self.sizes!r}")
        self.sizes = sorted(set(self.sizes))

    def bucket_for(self, n: int) -> int | None:
        for s in self.sizes:
            if s >= n:
                return s
        return None


class CallInfo:
    """What one pass over the leaves learns: the key, the device, and the padding."""

    __slots__ = ("key", "device", "needs_grad", "n", "bucket", "padded")

    def __init__(self, key: tuple, device: int, needs_grad: bool, n: int, bucket: int, padded: tuple) -> None:
        self.key = key
        self.device = device
        self.needs_grad = needs_grad
        self.n = n  # the real size of the bucketed dimension (-1: no bucketing)
        self.bucket = bucket
        self.padded = padded  # indices of leaves padded to the bucket


def inspect_call(leaves: Sequence[Any], bucketing: Bucketing | None) -> CallInfo:
    """Build the recording key and check that the call can be graphed at all.

    Raises :class:`Unsupported` for CPU tensors among CUDA ones, tensors on several GPUs,
    an argument of a type that has no stable value, or a batch larger than every bucket.
    """
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
                raise Unsupported(f"argument of type {type(x).__name__} (graphtree keys recordings on tensors and plain values)")
        return CallInfo(tuple(parts), device, needs_grad, -1, -1, ())
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
                shape = list(shape)
                shape[dim] = bucket
                shape = tuple(shape)
                parts.append((shape, x.dtype, _contiguous_strides(shape)))  # padded: contiguous placeholder
            else:
                parts.append((shape, x.dtype, x.stride()))
            needs_grad = needs_grad or x.requires_grad
        elif type(x) in _PLAIN:
            parts.append((type(x), x))
        else:
            raise Unsupported(f"argument of type {type(x).__name__} (graphtree keys recordings on tensors and plain values)")
    return CallInfo(tuple(parts), device, needs_grad, n, bucket, tuple(padded))


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


@dataclass
class InputPlan:
    """How a recording's tensor inputs reach its graph; built once, applied on every replay."""

    inplace_idx: list[int] = field(default_factory=list)
    inplace_ptrs: list[int] = field(default_factory=list)  # aligned with the leaves; 0 elsewhere
    copy_idx: list[int] = field(default_factory=list)
    placeholders: list[torch.Tensor] = field(default_factory=list)  # non-owning views into the pool
    padded: tuple[int, ...] = ()
    pad_dim: int = 0
    bucket: int = -1
    single: tuple[torch.Tensor, int] | None = None  # (placeholder, leaf) when one unpadded copy is all
    # (leaf, placeholder address, bytes, copy): one contiguous input, copied by cudaMemcpyAsync
    raw: tuple[int, int, int, Callable[[int, int, int, int], None]] | None = None
    device: int = 0

    def freeze(self, device: int) -> None:
        """Precompute the replay fast path once the plan is complete."""
        if len(self.copy_idx) == 1 and not self.padded:
            ph, i = self.placeholders[0], self.copy_idx[0]
            self.single = (ph, i)
            copy = _torch.raw_copier() if ph.is_contiguous() and ph.numel() else None
            if copy is not None:
                self.raw = (i, ph.data_ptr(), ph.numel() * ph.element_size(), copy)
        self.device = device

    def addresses_match(self, leaves: list[Any], check: Any) -> bool:
        """Whether every in-place input is where the graph expects it."""
        if not self.inplace_idx:
            return True
        return check(leaves, self.inplace_ptrs, self.inplace_idx)

    def copy_in(self, leaves: list[Any], n: int) -> None:
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


def mutation_watch(leaves: Sequence[Any], idx: Sequence[int]) -> "_torch.MutationWatch":
    """A dispatch mode that notes which of ``leaves[i]`` (i in idx) an operation writes to."""
    return _torch.MutationWatch({leaves[i].untyped_storage().data_ptr(): i for i in idx if leaves[i].numel()})
