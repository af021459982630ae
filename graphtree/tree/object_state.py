"""The state of the objects among a call's arguments, read as its key: a module by its type,
identity, mode and the CUDA parameters and buffers it holds (read in place); any other object (a
cache, a dataclass, a config) attribute by attribute, its plain values by value and its tensors by
shape, dtype and strides, read in place (:func:`read_object`; ``_native.object_state`` is its native
twin). What cannot be read raises :class:`~graphtree.tree.readable.Unsupported` with what to do.

Example::

    held = HeldTensors()
    part = read_object(cache, held)   # the key part; held.tensors: the CUDA tensors cache holds
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from graphtree import _native
from graphtree.tree.readable import PLAIN_SET, PLAIN_TYPES, Unsupported, tensor_kind
from graphtree.tree.state_epoch import param_epoch_cell, watch_parameter_changes

_Tensor = torch.Tensor
_epoch = param_epoch_cell()


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
        found = native.object_state(obj, PLAIN_TYPES, _OPAQUE, _MAX_TENSORS - len(held.tensors))
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
    if type(x) in PLAIN_SET:
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
            if type(k) not in PLAIN_SET:
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
        if type(v) in PLAIN_SET:
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
