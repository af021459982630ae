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

import functools
import types
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _native, _torch

PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)
"""Types of arguments keyed by value (a recording per value)."""
_PLAIN = PLAIN_TYPES
_PLAIN_SET = frozenset(PLAIN_TYPES)  # (a set lookup: the hot loops' membership test)
_Tensor = torch.Tensor


class Unsupported(Exception):
    """The call cannot be graphed; ``str(self)`` is the reason shown in ``stats()``."""


_strided = torch.strided
_Parameter = torch.nn.Parameter


def tensor_kind(x: torch.Tensor) -> str | None:
    """What makes ``x`` a tensor a CUDA graph cannot take or hand out (sparse, nested, meta, a
    subclass), or ``None`` for a plain dense tensor (``nn.Parameter`` s included)."""
    if x.layout is not _strided:
        return f"a {str(x.layout).replace('torch.', '')} tensor"
    if x.is_nested:
        return "a nested tensor"
    if x.is_meta:
        return "a meta tensor"
    if type(x) is not _Tensor and not isinstance(x, _Parameter):
        return f"a tensor subclass ({type(x).__name__})"
    return None


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
    :func:`read_object`. A 0-dim CPU tensor (a step count, a learning rate) is keyed by its dtype
    and filled into a device placeholder on each call. Raises :class:`Unsupported` for other CPU
    tensors, tensors on several GPUs, an object whose state cannot be read, or a batch larger than
    every bucket.
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


class HeldTensors:
    """The tensors that object arguments hold, gathered while a call is read."""

    __slots__ = ("device", "needs_grad", "tensors")

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.device = -2
        self.needs_grad = False

    def __bool__(self) -> bool:
        return bool(self.tensors)

    def add(self, t: torch.Tensor, device: int, needs_grad: bool) -> None:
        if device != self.device:
            if self.device != -2:
                raise Unsupported(f"mixed-device inputs (cuda:{self.device} and cuda:{device}, in an object argument)")
            self.device = device
        self.tensors.append(t)
        self.needs_grad = self.needs_grad or needs_grad

    def add_all(self, tensors: list[torch.Tensor], device: int, needs_grad: bool) -> None:
        """Tensors of one device, read by the native walk (``_native.object_state``)."""
        self.add(tensors[0], device, needs_grad)
        self.tensors.extend(tensors[1:])

    def add_module(self, state: _ModuleState) -> None:
        if state.tensors:
            self.add(state.tensors[0], state.device, state.needs_grad)
            self.tensors.extend(state.tensors[1:])


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


# --- objects among the arguments -----------------------------------------------------------------
_MAX_DEPTH = 6
_MAX_TENSORS = 4096
_MAX_ITEMS = 20_000
_CODE_TYPES = (
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    functools.partial,
)
_OPAQUE = (*_CODE_TYPES, torch.nn.Module)  # what the native walk leaves to the Python path


def read_object(obj: Any, held: HeldTensors) -> tuple[Any, ...]:
    """The key part of an object argument; appends the tensors it holds to ``held``.

    - An ``nn.Module`` (``self`` of a graphed method, say) is keyed by its type, identity and
      ``training`` flag; its parameters and buffers are read in place.
    - Another object (a cache, a dataclass, any object with a ``__dict__`` or ``__slots__``) is
      keyed by its type and, attribute by attribute, by its plain values and the shape, dtype
      and strides of its tensors, which are read in place; lists, tuples, dicts and objects in
      it are read the same way.

    Raises :class:`Unsupported` naming the type and what to do when the state cannot be read.
    """
    if isinstance(obj, torch.nn.Module):
        state = module_state(obj)
        held.add_module(state)
        return (type(obj), id(obj), obj.training, len(state.tensors))
    native = _native.loaded
    if native is not None:  # the same walk in C++ (graphtree/_native), or None: the Python path decides
        found = native.object_state(obj, _PLAIN, _OPAQUE, _MAX_TENSORS - len(held.tensors))
        if found is not None:
            part, tensors, device, needs_grad = found
            if tensors:
                held.add_all(tensors, device, needs_grad)
            return part  # type: ignore[no-any-return]
    out: list[Any] = []
    _read_state(obj, out, held, 0, type(obj), set())
    return (type(obj), tuple(out))


def _read_tensor(x: torch.Tensor, out: list[Any], held: HeldTensors, top: type) -> None:
    kind = tensor_kind(x)
    if kind is not None:
        raise _unreadable(top, f"it holds {kind}")
    if len(held.tensors) >= _MAX_TENSORS:
        raise _unreadable(top, f"it holds more than {_MAX_TENSORS} tensors")
    d = x.get_device()
    out.append((x.shape, x.dtype, x.stride(), d))
    if d >= 0:  # a CPU tensor is keyed, never read in place
        held.add(x, d, x.requires_grad)


def _read_state(x: Any, out: list[Any], held: HeldTensors, depth: int, top: type, seen: set[int]) -> None:
    if len(out) > _MAX_ITEMS:
        raise _unreadable(top, f"it holds more than {_MAX_ITEMS} values (keying it would cost more than a replay)")
    if isinstance(x, _Tensor):
        _read_tensor(x, out, held, top)
        return
    if type(x) in _PLAIN_SET:
        out.append((type(x), x))
        return
    if id(x) in seen:  # a cycle (obj.parent.child is obj): noted once, not walked again
        out.append(("seen", type(x)))
        return
    if depth >= _MAX_DEPTH:
        raise _unreadable(top, f"its attributes nest deeper than {_MAX_DEPTH} levels")
    seen.add(id(x))
    children: Iterable[Any]
    labeled = False  # children are (dict key or attribute name, value) pairs
    if isinstance(x, (list, tuple)):
        out.append((type(x), len(x)))
        children = x
    elif isinstance(x, dict):
        out.append((dict, len(x)))
        for k in x:
            if type(k) not in _PLAIN_SET:
                raise _unreadable(top, f"a dict in it has a key of type {type(k).__name__}")
        children, labeled = x.items(), True
    elif isinstance(x, torch.nn.Module):
        state = module_state(x)
        held.add_module(state)
        out.append((type(x), id(x), x.training, len(state.tensors)))
        return
    elif isinstance(x, _CODE_TYPES) or (callable(x) and not hasattr(x, "__dict__")):
        children = _code_parts(x, out, top)
    else:
        attributes = object_attributes(x)
        if attributes is None:
            raise _unreadable(top, f"an attribute of type {type(x).__name__} has no readable state")
        out.append(type(x))
        children, labeled = attributes, True
    depth += 1
    for child in children:
        # (a plain value, with its class: 1, 1.0 and True are equal in Python while ``x * 1`` and
        # ``x * 1.0`` differ in dtype; and a plain tensor, are read here without a call of their
        # own: most of what a cache holds; the limit on values is checked once at the end)
        if labeled:
            label, v = child
            out.append(label)
        else:
            v = child
        if type(v) in _PLAIN_SET:
            out.append((type(v), v))
        elif type(v) is _Tensor:
            _read_tensor(v, out, held, top)
        else:
            _read_state(v, out, held, depth, top, seen)
    if len(out) > _MAX_ITEMS:
        raise _unreadable(top, f"it holds more than {_MAX_ITEMS} values (keying it would cost more than a replay)")


def _code_parts(x: Any, out: list[Any], top: type) -> list[Any]:
    """A function, method, partial, class or module in an argument: keyed by what decides what it
    runs. Appends its mark to ``out`` and returns what to read as its state: a function's defaults
    and closure's contents (its code is the mark); a bound method's function and what it is bound
    to; a partial's function and arguments. A class, a module, a builtin function or another
    callable with no state to read is keyed by itself (the key holds it: equal only to the same
    object). Before, all of these were keyed by their type alone, so that ``f(x, torch.relu)``
    replayed the recording of ``f(x, torch.tanh)``."""
    if isinstance(x, types.FunctionType):
        out.append((types.FunctionType, x.__code__))
        parts = [x.__defaults__, x.__kwdefaults__]
        for cell in x.__closure__ or ():
            try:
                parts.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                parts.append(("empty cell",))
        return parts
    if isinstance(x, types.MethodType):
        out.append(types.MethodType)
        return [x.__func__, x.__self__]
    if isinstance(x, functools.partial):
        out.append(functools.partial)
        return [x.func, x.args, x.keywords]
    if isinstance(x, types.BuiltinFunctionType) and not isinstance(x.__self__, (types.ModuleType, type(None))):
        out.append((types.BuiltinFunctionType, x.__name__))  # a method of an object, in C: that object
        return [x.__self__]
    try:
        hash(x)
    except TypeError:
        raise _unreadable(top, f"a callable of type {type(x).__name__} in it has no readable state") from None
    out.append(x)
    return []


def object_attributes(x: Any) -> list[tuple[str, Any]] | None:
    """``(name, value)`` of an object's instance attributes (``__dict__`` and ``__slots__``)."""
    found: list[tuple[str, Any]] = []
    d = getattr(x, "__dict__", None)
    if isinstance(d, dict):
        found.extend(d.items())
    for name in _slot_names(type(x)):
        v = getattr(x, name, _UNSET)
        if v is not _UNSET:
            found.append((name, v))
    if d is None and not found:
        return None
    return found


_UNSET = object()


_slots_of: dict[type, tuple[str, ...]] = {}


def _slot_names(t: type) -> tuple[str, ...]:
    """The attribute names of ``t``'s ``__slots__`` along its MRO, once per type (a lone string is
    one slot; a private ``__name`` is looked up mangled, as Python stores it)."""
    names = _slots_of.get(t)
    if names is None:
        found: list[str] = []
        for cls in t.__mro__:
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name in ("__dict__", "__weakref__"):
                    continue
                if name.startswith("__") and not name.endswith("__"):
                    name = f"_{cls.__name__.lstrip('_')}{name}"
                found.append(name)
        if len(_slots_of) > 4096:  # (types made at run time)
            _slots_of.clear()
        names = _slots_of[t] = tuple(found)
    return names


def _unreadable(t: type, why: str) -> Unsupported:
    return Unsupported(
        f"argument of type {t.__name__}: graphtree cannot read its state ({why}); pass the tensors "
        f"it holds as arguments, or register the type as a pytree node"
    )


# --- modules' parameters and buffers ---------------------------------------------------------------
# The epoch is bumped whenever any nn.Module registers a parameter, buffer or submodule: a cheap signal that
# state read in place may have been replaced (one int compare on replay). torch has no
# per-module registration hook, so the hooks are global; they are installed only once graphtree
# reads a module's state in place.
_epoch = [0]
_hooks_installed = False
_is_compiling = torch.compiler.is_compiling


def _bump_epoch(*_: object) -> None:
    # Traced by torch.compile (a compiled function that builds a module), reading the epoch would
    # make dynamo guard on its value, which the bump then changes: a recompilation on every call
    # (Hugging Face's compiled generate() hit the recompile limit). Compiled code skips the bump.
    if _is_compiling():
        return
    _epoch[0] += 1


def watch_parameter_changes() -> None:
    """Install the global parameter/buffer registration hooks (once per process)."""
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        torch.nn.modules.module.register_module_parameter_registration_hook(_bump_epoch)
        torch.nn.modules.module.register_module_buffer_registration_hook(_bump_epoch)
        torch.nn.modules.module.register_module_module_registration_hook(_bump_epoch)


def statics_replaced() -> None:
    """Say that state some recording reads in place was replaced (a closure cell rebound): every
    recording checks its state again before its next replay, as after a new parameter."""
    _bump_epoch()


def param_epoch() -> int:
    """The current parameter-registration epoch (see :func:`watch_parameter_changes`)."""
    return _epoch[0]


def param_epoch_cell() -> list[int]:
    """The one-item list the epoch lives in (the native fast replay reads its item 0)."""
    return _epoch


class _ModuleState(NamedTuple):
    """A module's CUDA parameters and buffers, their device and whether any requires grad."""

    epoch: int
    tensors: list[torch.Tensor]
    device: int
    needs_grad: bool


_module_cache: weakref.WeakKeyDictionary[torch.nn.Module, _ModuleState] = weakref.WeakKeyDictionary()


def module_state(m: torch.nn.Module) -> _ModuleState:
    """The CUDA parameters and buffers of ``m``, read again only after a module registers a new
    one (``.to()`` moves their data, which the address checks of a replay see).

    Raises :class:`Unsupported` when they lie on several devices.
    """
    watch_parameter_changes()
    epoch = _epoch[0]
    hit = _module_cache.get(m)
    if hit is not None and hit.epoch == epoch:
        return hit
    tensors = [t for t in (*m.parameters(), *m.buffers()) if t.is_cuda]
    devices = {t.get_device() for t in tensors}
    if len(devices) > 1:
        raise Unsupported(f"argument of type {type(m).__name__}: its parameters lie on several GPUs {sorted(devices)}")
    state = _ModuleState(epoch, tensors, devices.pop() if devices else -2, any(t.requires_grad for t in tensors))
    _module_cache[m] = state
    return state


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    acc = 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))
