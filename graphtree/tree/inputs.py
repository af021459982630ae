"""Inputs of a graphed call: reading the call, the recording key, and how each input reaches the graph.

A recording is keyed by the call's *signature*: for each tensor its shape, dtype, strides and
device; for each plain Python value (int, float, bool, str, None, dtype, device) the value
itself, with its type. Each tensor input then reaches the graph one of two ways:

- **in place** (its address is baked into the graph and only checked on replay): tensors the
  caller marked static (:func:`graphtree.mark_static`), ``nn.Parameter`` s, and outputs of an
  earlier recording on the current path that are still at their recorded address;
- **copied** into a placeholder the graph reads, all of them in one fused copy before replay.

What an argument may be is in ``readable.py``; the objects among the arguments (a module, a cache)
are read by ``object_state.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _native, _torch
from graphtree.tree.object_state import HeldTensors, read_object
from graphtree.tree.readable import PLAIN_TYPES, Unsupported, tensor_kind

_PLAIN = PLAIN_TYPES
_Tensor = torch.Tensor
_strided = torch.strided


def _unsupported_input(i: int, x: torch.Tensor, kind: str) -> Unsupported:
    return Unsupported(f"input {i} is {kind}: graphtree graphs dense CUDA tensors (it runs eagerly)")


class _Keywords(NamedTuple):
    """The spec of a flat call with keywords: ``n_args`` positional leaves, then one per name."""

    n_args: int
    names: tuple[str, ...]


def flatten(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Sequence[Any], Any]:
    """The call's leaves and a spec to rebuild it: ``None`` when it is plain positional, a
    :class:`_Keywords` when it is flat with keywords (``f(x, out=y)``), else a pytree spec.

    Plain positional calls hand back ``args`` itself: the leaves are only read, and code that
    needs to change one makes a list first. Flat calls skip the pytree machinery (about 8 µs):
    calls of tensors, plain values and objects a pytree takes as leaves (a cache passed by keyword
    to a transformers forward: ``past_key_values=cache``).
    """
    for a in args:  # inline loops: this runs on every call of the Python path
        if not isinstance(a, _Tensor) and type(a) not in _PLAIN:
            break
    else:
        if not kwargs:
            return args, None
        for a in kwargs.values():
            if not (isinstance(a, _Tensor) or type(a) in _PLAIN or _pytree_leaf(a)):
                break
        else:
            return (*args, *kwargs.values()), _Keywords(len(args), tuple(kwargs))
    return _torch.tree_flatten((args, kwargs))


def _pytree_leaf(a: Any) -> bool:
    """Whether a pytree takes ``a`` as a leaf: a type it does not flatten, and no tuple (a
    namedtuple is flattened without being registered)."""
    t = type(a)
    return t not in _torch.pytree_nodes and not issubclass(t, tuple)


def unflatten(leaves: Sequence[Any], spec: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Inverse of :func:`flatten`."""
    if spec is None:
        return tuple(leaves), {}
    if type(spec) is _Keywords:
        n = spec.n_args
        return tuple(leaves[:n]), dict(zip(spec.names, leaves[n:], strict=True))
    args, kwargs = _torch.tree_unflatten(list(leaves), spec)
    return args, kwargs


def _key(parts: Sequence[Any], spec: Any) -> tuple[Any, ...]:
    """A call's recording key: its leaves' parts and, unless it is plain positional, how they
    nest (keyword names, containers), so that ``f(x, a=y)``, ``f(x, b=y)``, ``f(x, y)`` and
    ``f([x, y])`` are recorded apart."""
    if spec is None:
        return tuple(parts)
    if type(spec) is _Keywords:
        return (*parts, ("keywords", spec.names))
    return (*parts, ("structure", spec))


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
    """One call, read once: its leaves, the recording key, the device and the padding.

    ``leaves[:n_args]`` are the call's own leaves (what :meth:`arguments` rebuilds the call
    from); the leaves after them are tensors held by objects among the arguments (a module's
    parameters, a cache's buffers), which the graph always reads in place.
    """

    __slots__ = (
        "bucket", "device", "key", "leaves", "n", "n_args", "needs_grad", "numbers", "objects", "padded", "spec",
    )  # fmt: skip

    def __init__(
        self,
        leaves: Sequence[Any],
        spec: Any,
        key: tuple[Any, ...],
        device: int,
        needs_grad: bool,
        n: int,
        bucket: int,
        padded: tuple[int, ...],
        n_args: int,
        objects: bool = False,
    ) -> None:
        self.leaves = leaves
        self.spec = spec  # None: plain positional (see flatten)
        self.key = key
        self.device = device  # -2: no CUDA tensor among the leaves
        self.needs_grad = needs_grad
        self.n = n  # the real size of the bucketed dimension (-1: no bucketing)
        self.bucket = bucket
        self.padded = padded  # indices of leaves padded to the bucket
        self.n_args = n_args
        self.objects = objects  # an argument was read as an object (a module, a cache), not as a tensor or a value
        # a float or int among its own leaves (tree/numbers.py keys them: device scalars or values)
        self.numbers = _has_numbers(leaves if len(leaves) == n_args else leaves[:n_args])

    def tensors(self) -> tuple[tuple[Any, ...], int] | None:
        """``(parts, device)`` of a positional call of plain CUDA tensors alone, as the native
        ``signature`` reads it (tree/churn.py: the calls a churning callable met), or None."""
        leaves = self.leaves
        if self.spec is not None or self.device < 0 or len(leaves) != self.n_args:
            return None
        if not all(type(x) is torch.Tensor for x in leaves):
            return None
        parts = self.key[: len(leaves)]
        return (parts, self.device) if plain_tensor_parts(parts) else None

    def arguments(self, leaves: Sequence[Any] | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` of this call, optionally with other leaves in place of its own."""
        leaves = self.leaves if leaves is None else leaves
        return unflatten(leaves if len(leaves) == self.n_args else leaves[: self.n_args], self.spec)


def plain_tensor_parts(parts: Sequence[tuple[Any, ...]]) -> bool:
    """Whether each of a signature's ``parts`` is a plain tensor's ``(shape, dtype, stride)``: not a
    number's ``(type, value)``, a host scalar's (no strides) nor a lazy view's four items: what the
    native ``signature`` leaves to the Python path (the fast hit, a churning call's early run)."""
    return all(len(p) == 3 and p[2] is not None for p in parts)


def _has_numbers(leaves: Sequence[Any]) -> bool:
    """Whether a float or an int (not a bool) is among ``leaves``: ~0.2 µs for a call of tensors."""
    for x in leaves:
        t = type(x)
        if t is float or t is int:
            return True
    return False


def read_call(args: tuple[Any, ...], kwargs: dict[str, Any], bucketing: Bucketing | None) -> Call:
    """Flatten a call, build its recording key and check that it can be graphed at all.

    Tensors and plain values (int, float, bool, str, None, dtype, device) are keyed as they are.
    Other objects among the arguments (a module, a cache, a dataclass) are read: see
    :func:`~graphtree.tree.object_state.read_object`. A 0-dim CPU tensor (a step count, a learning
    rate) is keyed by its dtype and filled into a device placeholder on each call. Raises
    :class:`~graphtree.tree.readable.Unsupported` for other CPU tensors, tensors on several GPUs,
    an object whose state cannot be read, or a batch larger than every bucket.
    """
    native = _native.loaded
    if native is not None and bucketing is None:
        # One C++ loop for a call of tensors and plain values (the common case); None sends
        # anything else (objects, subclasses, CPU tensors) down the Python path below.
        if not kwargs:
            sig = native.signature(args, _PLAIN)
            if sig is not None:
                return Call(args, None, sig[0], sig[1], sig[2], -1, -1, (), len(args))
        else:
            flat = (*args, *kwargs.values())
            sig = native.signature(flat, _PLAIN)
            if sig is not None:
                spec = _Keywords(len(args), tuple(kwargs))
                return Call(flat, spec, _key(sig[0], spec), sig[1], sig[2], -1, -1, (), len(flat))
    leaves, spec = flatten(args, kwargs)
    parts: list[Any] = []
    device = -2
    needs_grad = False
    held: HeldTensors | None = None  # tensors inside objects, once an object is met
    if bucketing is None:  # the common case, kept lean: it runs on every call
        for i, x in enumerate(leaves):
            if isinstance(x, _Tensor):
                if type(x) is not _Tensor or x.layout is not _strided or x.is_nested:
                    kind = tensor_kind(x)
                    if kind is not None:
                        raise _unsupported_input(i, x, kind)
                d = x.get_device()
                if d < 0 and not x.dim():  # a step count, a learning rate: filled into the device per call
                    parts.append(_host_scalar(x))
                    continue
                if d != device:
                    if d < 0:
                        raise Unsupported(_CPU_TENSORS if device < 0 else "mixed-device inputs (CPU and CUDA)")
                    if device != -2:
                        raise Unsupported(f"mixed-device inputs (cuda:{device} and cuda:{d})")
                    device = d
                parts.append(_tensor_part(x, x.shape, x.stride()))
                if x.requires_grad:
                    needs_grad = True
            elif type(x) in _PLAIN:
                parts.append((type(x), x))
            else:
                if held is None:
                    held = HeldTensors()
                parts.append(read_object(x, held))
        if not held:
            return Call(leaves, spec, _key(parts, spec), device, needs_grad, -1, -1, (), len(leaves), held is not None)
        return _with_held(leaves, spec, parts, device, needs_grad, -1, -1, (), held)
    held = HeldTensors()
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
            kind = tensor_kind(x)
            if kind is not None:
                raise _unsupported_input(i, x, kind)
            d = x.get_device()
            if d < 0 and not x.dim():
                parts.append(_host_scalar(x))
                continue
            if d < 0:
                raise Unsupported(_CPU_TENSORS if device < 0 else "mixed-device inputs (CPU and CUDA)")
            if device == -2:
                device = d
            elif d != device:
                raise Unsupported(f"mixed-device inputs (cuda:{device} and cuda:{d})")
            shape: tuple[int, ...] = x.shape
            if bucket >= 0 and x.dim() > dim and shape[dim] == n:
                padded.append(i)
                shape = (*shape[:dim], bucket, *shape[dim + 1 :])
                parts.append(_tensor_part(x, shape, _contiguous_strides(shape)))  # padded: contiguous placeholder
            else:
                parts.append(_tensor_part(x, shape, x.stride()))
            needs_grad = needs_grad or x.requires_grad
        elif type(x) in _PLAIN:
            parts.append((type(x), x))
        else:
            parts.append(read_object(x, held))
    return _with_held(leaves, spec, parts, device, needs_grad, n, bucket, tuple(padded), held)


def _tensor_part(x: torch.Tensor, shape: tuple[int, ...], stride: tuple[int, ...]) -> tuple[Any, ...]:
    """A copied tensor's key part: ``(shape, dtype, stride)``, and its lazy bits after them where it
    has any (``torch.conj``'s view, the negative bit: :func:`graphtree._torch.lazy_bits`). Its
    recording reads a placeholder with the same bits, so that its kernels are eager's (cuBLAS
    reduces a conjugated operand in another order than a resolved one)."""
    if x.is_conj() or x.is_neg():
        return (shape, x.dtype, stride, _torch.lazy_bits(x))
    return (shape, x.dtype, stride)


_CPU_TENSORS = "CPU tensor inputs (only 0-dim ones, such as a step count, are filled into the device per call)"


def _host_scalar(x: torch.Tensor) -> tuple[Any, ...]:
    """The key part of a 0-dim CPU tensor argument: its stride is ``None``, which tells
    :func:`graphtree.tree.placement.place_inputs` to give it a device placeholder that each
    call fills from its value (as inductor's cudagraph trees copy CPU scalars to the device)."""
    if x.requires_grad:
        raise Unsupported("a 0-dim CPU tensor input that requires grad")
    return (x.shape, x.dtype, None)


def _with_held(
    leaves: Sequence[Any],
    spec: Any,
    parts: list[Any],
    device: int,
    needs_grad: bool,
    n: int,
    bucket: int,
    padded: tuple[int, ...],
    held: HeldTensors,
) -> Call:
    """A :class:`Call` whose objects hold CUDA tensors: they become in-place leaves after the
    call's own (keyed by their objects' parts, not one by one)."""
    if held.device != -2 and device not in (-2, held.device):
        raise Unsupported(f"mixed-device inputs (cuda:{device} and cuda:{held.device}, in an object argument)")
    if device == -2:
        device = held.device
    return Call(
        [*leaves, *held.tensors],
        spec,
        _key(parts, spec),
        device,
        needs_grad or held.needs_grad,
        n,
        bucket,
        padded,
        len(leaves),
        True,  # (objects with tensors, or a bucketed call: read as if it had objects)
    )


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
