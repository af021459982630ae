"""Which values of an object a graph holds as constants: the settings a call's key must hold.

A replay runs no Python: a plain value the call's code read while it was recorded (``self.p`` of a
dropout, ``self.config.output_hidden_states``, ``Block.scale``, a conv's ``stride``) is baked
into the graph. :func:`owner_reads` lists, as ``(namespace, name, label)`` reads, those of a module
(and its submodules) or of the object a graphed method is bound to; :func:`plain_reads` those of
one namespace; :func:`value_part` makes a value's part of the key. :class:`graphtree.tree.reach.FreeValues`
reads them at each call.

Example::

    mine, library_settings = owner_reads(model)
    key = tuple(value_part(label, space.get(name)) for space, name, label in mine + library_settings)
"""

from __future__ import annotations

import enum
import functools
import threading
import types
from collections.abc import Iterable
from typing import Any

import torch

from graphtree.tree.code_scan import class_reads, probed_names, user_class
from graphtree.tree.readable import PLAIN_SET


def user_object(v: Any) -> bool:
    """An instance of a user's class with attributes of its own that is no module."""
    return (
        v is not None
        and hasattr(v, "__dict__")
        and not isinstance(v, (types.ModuleType, torch.nn.Module, type))
        and user_class(type(v))
    )


def settings_object(v: Any) -> bool:
    """An instance of a user's class that is no function, class, module or model (a config object,
    a dataclass of settings): its plain attributes the code reads are keyed. Not a
    ``threading.local``: its attributes are each thread's own, no setting of the call."""
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, threading.local)
    return hasattr(v, "__dict__") and not isinstance(v, skip) and user_class(type(v))


FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


# DDP's gradient all-reduce switch, which no_sync() turns off (its require_forward_param_sync is set
# from it by each forward: derived, not keyed)
SYNC_FLAGS = frozenset(("require_backward_grad_sync",))
DERIVED = SYNC_FLAGS | {"require_forward_param_sync"}  # (a library's settings not keyed apart)
Read = tuple[dict[str, Any], str, str]  # (namespace, name, label)


def owner_reads(owner: Any, label: str = "self", training: bool = False) -> tuple[list[Read], list[Read]]:
    """The plain attributes of an object the callable reads, labelled ``label``, in two lists.

    First, those a call may change as its own state: the object a graphed method is bound to
    (``sampler.sample`` reading ``self.temperature``), where its class is the user's; or a module's,
    with those of its submodules of the user's classes, DDP's gradient-sync flags (``no_sync()``)
    and, with ``training``, the module's own mode (a graphed module's is keyed apart). A
    submodule's mode is keyed where its class's code reads it (``nn.Dropout``, ``nn.BatchNorm2d``,
    an HF attention): ``model.eval()`` turns them all off with the module's own, but MC dropout
    turns dropout layers back on and fine-tuning freezes batch norms (``model.bn.eval()``).

    In both, an object of settings held as an attribute (an HF model's ``config``, a dataclass of
    settings: :func:`held_settings`) is read for its plain attributes, once however many modules
    hold it (``model.config.output_hidden_states = True`` between calls changes what HF returns).

    Second, the settings of a module's submodules of library classes that their own code reads
    (:func:`~graphtree.tree.code_scan.class_reads`: ``nn.Dropout``'s ``p``, an HF attention's
    ``scaling``): the caller's, as a library's forward that changed one would fail its recording
    (``writes.module_changes``), so a call is not scanned for changing them."""
    if owner is None or not hasattr(owner, "__dict__") or isinstance(owner, types.ModuleType):
        return [], []
    if not isinstance(owner, torch.nn.Module):
        if not user_class(type(owner)):
            return [], []
        attrs = vars(owner)
        return plain_reads(attrs, f"{label}.", None, frozenset(), set()) + absent_reads(owner, attrs, f"{label}."), []
    out: list[Read] = [(vars(owner), "training", f"{label}.training")] if training else []
    settings: list[Read] = []
    held: set[int] = set()  # settings objects already read (one HF config is held by every layer)
    classes: set[tuple[int, str]] = set()  # class attributes already read (each layer of a class reads them)
    for path, sub in owner.named_modules():
        at = f"{label}.{path + '.' if path else ''}"
        attrs = vars(sub)
        out.extend((attrs, flag, at + flag) for flag in SYNC_FLAGS if type(attrs.get(flag)) is bool)
        cls: type = type(sub)
        user = user_class(cls)
        read = None if user else class_reads(cls)  # (a library's: only what its code reads)
        skip = module_internals() | (SYNC_FLAGS if user else DERIVED)
        (out if user else settings).extend(plain_reads(attrs, at, read, skip, held))
        if path and "training" in class_reads(cls):  # a submodule's own mode: MC dropout, a frozen BatchNorm
            (out if user else settings).append((attrs, "training", at + "training"))
        if user:  # (`scale = 2.0` in the class body, read as `self.scale`: once for all its instances)
            out.extend(class_level_reads(cls, class_reads(cls), attrs, at, classes))
            out.extend(absent_reads(sub, attrs, at))  # (`getattr(self, "shift", 0.0)`, set after a call)
    return out, settings


def absent_reads(obj: Any, attrs: dict[str, Any], at: str) -> list[Read]:
    """The attributes the code of ``obj``'s class (the user's) probes with a default that ``obj``
    lacks now (``hasattr(self, "scale")``, ``getattr(self, "shift", 0.0)``: :func:`probed_names`),
    read from ``attrs`` all the same: absent, each is keyed as absent, and set later (``model.shift
    = 1.0``), the next call is a new signature."""
    cls: type = type(obj)
    state = (obj._parameters, obj._buffers, obj._modules) if isinstance(obj, torch.nn.Module) else ()
    return [
        (attrs, n, at + n)
        for n in sorted(probed_names(cls))
        if n not in attrs and not hasattr(cls, n) and not any(n in d for d in state)
    ]


def class_level_reads(
    cls: type, names: Iterable[str], attrs: dict[str, Any], at: str, seen: set[tuple[int, str]] | None = None
) -> list[Read]:
    """The plain attributes of the user's classes in ``cls``'s MRO that ``names`` (what the code
    reads) name and the instance's own ``attrs`` do not shadow, read in the class that defines
    each (but those in ``seen``, which gets them): ``Block.scale = 3.0`` between calls changes
    what ``self.scale`` gives."""
    out: list[Read] = []
    seen = set() if seen is None else seen
    for name in sorted(set(names) - attrs.keys()):
        for klass in cls.__mro__:
            space = vars(klass)
            if name in space:
                if type(space[name]) in PLAIN_SET and user_class(klass) and (id(klass), name) not in seen:
                    seen.add((id(klass), name))
                    out.append((space, name, at + name))  # type: ignore[arg-type]  # (a mappingproxy: get() as a dict's)
                break
    return out


def plain_reads(
    attrs: dict[str, Any], at: str, read: frozenset[str] | None, skip: frozenset[str], held: set[int]
) -> list[Read]:
    """The plain attributes in ``attrs`` but ``skip`` (those named in ``read`` where given), and
    those of the objects of settings among them (:func:`held_settings`) not already in ``held``,
    labelled after ``at``."""
    out: list[Read] = []
    for name, v in attrs.items():
        if name in skip or (read is not None and name not in read):
            continue
        if type(v) in PLAIN_SET or keyable(v) or isinstance(v, torch.Tensor):  # (a tensor: by identity)
            out.append((attrs, name, at + name))
        elif held_settings(v) and id(v) not in held:  # (`self.config.output_hidden_states`)
            held.add(id(v))
            inner = vars(v)
            out.extend((inner, n, f"{at}{name}.{n}") for n, w in inner.items() if type(w) in PLAIN_SET)
    return out


def keyable(v: Any) -> bool:
    """A value that is no plain one but is a setting all the same, keyed by its value or identity
    (:func:`value_part`): a function (``self.act = torch.relu``, a ``functools.partial``), an
    ``Enum`` member, a numpy scalar (``self.scale = 1 / np.sqrt(d)``), a short tuple of plain values
    (``torch.Size``, ``self.size = (2, 2)``)."""
    if isinstance(v, (*FUNCTIONS, types.MethodType, enum.Enum)):
        return True
    if isinstance(v, tuple):
        return len(v) <= MAX_TUPLE and all(type(i) in PLAIN_SET for i in v)
    return type(v).__module__ == "numpy" and getattr(v, "shape", None) == ()


MAX_TUPLE = 16  # (a longer tuple of plain values is data, not a setting: not keyed)


def held_settings(v: Any) -> bool:
    """An object of settings a module holds (an HF model's ``config``, a user's dataclass of
    settings), or a callable object with a few settings of its own (a sampler of the user's class
    reading ``self.temperature`` in its ``__call__``, an HF ``TemperatureLogitsWarper``): no tensor,
    module, function or class. All its plain attributes are keyed, not only the names the module's
    code reads: HF reads ``return_dict`` by a string in a decorator, and ``_attn_implementation``
    through a property. (A library's callable with more than :data:`MAX_CALLABLE_SETTINGS`
    attributes, a tokenizer, is not read.)"""
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor)
    if not hasattr(v, "__dict__") or isinstance(v, (*skip, threading.local, enum.Enum)) or type(v) in PLAIN_SET:
        return False
    return not callable(v) or user_class(type(v)) or len(vars(v)) <= MAX_CALLABLE_SETTINGS


MAX_CALLABLE_SETTINGS = 16


@functools.cache
def module_internals() -> frozenset[str]:
    """What ``nn.Module.__init__`` itself sets: hook bookkeeping, and ``training`` (followed apart)."""
    return frozenset(vars(torch.nn.Module()))


def value_part(name: str, v: Any) -> tuple[Any, ...]:
    """A value's key part: by type and value where plain (``1``, ``1.0`` and ``True`` differ), by
    type and identity otherwise (a name rebound to an object: hashable whatever it is). A Python
    function by its code and plain defaults: one made again from the same code (a lambda made in a
    loop) computes the same (what its closure holds is read apart), a function defined anew does not."""
    t = type(v)
    if t in PLAIN_SET:
        return (name, t, v)
    if isinstance(v, tuple) and keyable(v):  # (its items by type and value: `(1,)` and `(True,)` differ)
        return (name, t, tuple((type(i), i) for i in v))
    if t.__module__ == "numpy" and getattr(v, "shape", None) == ():
        return (name, t, v.item())
    if t is types.FunctionType:
        defaults = v.__defaults__ or ()
        plain = all(type(d) in PLAIN_SET for d in defaults)
        return (name, t, (id(v.__code__), defaults if plain else id(defaults)))
    return (name, t, id(v))
