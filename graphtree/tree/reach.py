"""What a graphed callable reads besides its arguments: the module it belongs to, the tensors its
closure holds, which its graphs read in place, and the plain values its code reads from its globals
and closure, which its graphs hold as constants.

A closure's cell can be rebound between calls (``w = new_w`` in the enclosing function): the graphs
recorded with the old tensor would read it, or its freed memory, where eager reads the new one.
:meth:`Reach.follow` reads the cells at each call (a few attribute reads) and, when one holds another
tensor, says so (``inputs.statics_replaced``): every recording checks the state it reads in place
before its next replay, and those made with the old tensor no longer fit.

A plain value (a number, a bool, a string, ``None``, a dtype, a device) that the code reads from a
global or a closure cell is baked into the graph: ``x * SCALE`` recorded with ``SCALE = 2.0``
replayed ``x * 2.0`` after ``SCALE = 3.0``. :class:`FreeValues` reads them at each call, as
``torch.compile`` guards on them, and they are part of the call's key: a new value is a new
signature (one recording per value), never a stale one.

Example::

    reach = Reach(fn)
    reach.module, reach.tensors     # the module in its closure (or that it is), its closure's tensors
    reach.follow()                  # at each call: a cell rebound is seen
    FreeValues(fn).part()           # at each call: the plain values the code reads, for the key
"""

from __future__ import annotations

import collections
import enum
import functools
import inspect
import itertools
import operator
import os
import sys
import sysconfig
import threading
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.inputs import PLAIN_TYPES, param_epoch, statics_replaced


class Reach:
    """The module ``fn`` is, is a method of, or finds in its closure, and its closure's tensors."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.module: torch.nn.Module | None = None
        cells = []
        if isinstance(fn, torch.nn.Module):
            self.module = fn
        elif inspect.ismethod(fn) and isinstance(fn.__self__, torch.nn.Module):
            self.module = fn.__self__
        else:
            for cell, v in _contents(getattr(fn, "__closure__", None) or ()):
                if isinstance(v, torch.Tensor):
                    cells.append(cell)
                elif isinstance(v, torch.nn.Module) and self.module is None:
                    self.module = v
        self.cells = tuple(cells)
        """The closure's cells that held a tensor when ``fn`` was graphed."""
        self.tensors = _cell_tensors(self.cells)
        """The tensors they hold, as of the last :meth:`follow`."""
        self._statics: list[torch.Tensor] = []
        self._statics_epoch = -1

    def follow(self) -> None:
        """Read the cells again; if one holds another tensor (or none), the state graphs read in
        place was replaced (``inputs.statics_replaced``)."""
        now = _cell_tensors(self.cells)
        if len(now) != len(self.tensors) or any(a is not b for a, b in zip(now, self.tensors)):
            self.tensors = now
            statics_replaced()

    def static_tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers and the closure's tensors: state graphs read in place.

        Read again only after a module registered a parameter, buffer or submodule, or a cell was
        rebound (:func:`~graphtree.tree.inputs.param_epoch`): walking a large module on every call
        would cost more than the replay.
        """
        epoch = param_epoch()
        if self._statics_epoch != epoch:
            out: list[torch.Tensor] = []
            if self.module is not None:
                out.extend(self.module.parameters())
                out.extend(self.module.buffers())
            out.extend(self.tensors)
            self._statics, self._statics_epoch = out, epoch
        return self._statics

    def state_device(self) -> int:
        """The device of the first CUDA tensor of that state, else the current device (-1 without CUDA)."""
        for t in self.static_tensors():
            if t.is_cuda:
                return t.get_device()
        return torch.cuda.current_device() if torch.cuda.is_available() else -1


def _cell_tensors(cells: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors ``cells`` hold now (a cell emptied or rebound to something else holds none)."""
    return [v for _, v in _contents(cells) if isinstance(v, torch.Tensor)]


def _contents(cells: Iterable[Any]) -> Iterator[tuple[Any, Any]]:
    """Each cell that holds a value, with it (an empty cell, ``del``-ed in its scope, holds none)."""
    for cell in cells:
        v = _content(cell)
        if v is not _MISSING:
            yield cell, v


_PLAIN_SET = frozenset(PLAIN_TYPES)
_MAX_FUNCTIONS = 64  # functions walked per graphed callable (its own, those it calls by global name)
_MAX_DEPTH = 3  # calls deep
_MISSING = object()  # a global deleted since, or an empty closure cell


class FreeValues:
    """The plain values a graphed callable reads besides its arguments, as a key part:

    - those ``fn``'s code reads from its globals and closure cells, and those of the functions it
      calls by global name (the user's code, not installed code: torch, transformers, the standard
      library); a decorated function (``torch.compile``, ``functools.wraps``) is read through to the
      function it wraps;
    - the plain attributes of ``module`` and of its submodules whose classes are the user's
      (``self.scale``, ``self.head.temperature``; not their ``training``: ``model.eval()`` turns
      the module's own off too, keyed already), those of a library's submodules that their code
      reads (``model.drop.p = 0.0`` between calls) and DDP's gradient-sync flags; or, for a method
      bound to an object of the user's class that is no module, or such an object with a
      ``__call__`` graphed itself, that object's (``self.temperature``);
    - for a model the code calls by a global or closure name: its identity (rebound, it is
      followed anew), its ``training`` (``model.eval()`` between calls) and the same attributes;
    - for an object of settings read by a global or closure name (the user's config or dataclass,
      a library's: an HF ``GenerationConfig``, an ``argparse.Namespace``): its identity and those
      of its plain attributes whose names the code reads (``x * CFG.scale``);
    - for a function the code calls by a global or closure name: its code and plain defaults, a
      builtin's identity (``ACT = torch.tanh`` after a recording made with ``torch.relu``, a helper
      defined anew: the new one is followed; a lambda made again from the same code keeps the key).

    Other values are not keyed: tensors are externals, read in place; containers are watched in
    warm-ups (:meth:`containers`). A module attribute the call itself changes is the
    call's state, not a setting: it is no longer followed (:meth:`after_call`), and a recording of
    such a call fails with the reason (``writes.module_changes``). A bound object's attribute the
    call changes stays followed: each value is a signature of its own, and a call that changes it
    every time runs eagerly as signatures that keep changing do (tree/churn.py, which names it).
    The user's classes' own plain attributes that their code reads (``scale = 2.0`` in the class
    body, read as ``self.scale``; ``Config.lr`` of a class used as a namespace) are read in the
    class that defines them, once however many instances read them.
    A library's submodule is read for the plain attributes its own code reads (``nn.Dropout``'s
    ``p``, an HF attention's ``scaling``: a few per layer, one identity check each per call), and
    an object of settings a module holds (an HF model's ``config``: its plain attributes, once for
    all the layers holding it); a callable that reads none (``nn.Linear``, a function of tensors
    alone) costs nothing."""

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module | None = None) -> None:
        self._fn = fn
        # (globals, names, cells) of each function walked: fn's, and the methods of the user's
        # classes it reaches (its module's and submodules' forwards, the methods they call)
        self._methods = _user_methods(fn, module)
        self._sources = _sources(fn, self._methods)
        # what the callable belongs to besides a module: a bound method's object, a callable object itself
        self._owner = fn.__self__ if inspect.ismethod(fn) else fn if _callable_object(fn) else None
        self._module = module
        self._reads: list[tuple[Any, str, str]] | None = None  # (namespace, name, label), once resolved
        self._own = 0  # the first _own reads are module attributes
        self._anchors: list[int] = []  # reads of a model by name: rebound, the reads are resolved again
        self._containers: list[tuple[str, Any]] = []  # lists, dicts, sets its code reads (watched in warm-ups)
        self._cache: tuple[list[Any], tuple[Any, ...] | None] = ([], None)  # (values last read, their part), one object
        self._lock = threading.Lock()
        self._ddps: list[weakref.ref[torch.nn.Module]] = []  # DistributedDataParallel models it reaches
        self.kept_hint = ""  # why the models it reaches keep memory on every call, where known (FSDP2's)
        self.active = True  # whether part() may return a part (False once it found nothing to follow)
        self.follows_modules = False  # whether it follows module attributes (after_call has work)

    def part(self) -> tuple[Any, ...] | None:
        """``("reads", ((name, type, value), ...))`` for the values read now, or None if none is read.
        The same part object while no value changed (one identity check per value)."""
        reads = self._reads
        if reads is None:
            reads = self._resolve()
        if not reads:
            return None
        now = [d.get(n, _MISSING) for d, n, _ in reads]
        last, cached = self._cache  # (one attribute: threads read and replace it whole)
        if len(now) == len(last):
            if all(map(operator.is_, now, last)):
                return cached
            if any(now[i] is not last[i] for i in self._anchors):  # a model or function rebound: follow the new one
                self._sources = _sources(self._fn, self._methods)
                reads = self._resolve()
                now = [d.get(n, _MISSING) for d, n, _ in reads]
        part = ("reads", tuple(_value_part(label, v) for (_, _, label), v in zip(reads, now)))
        self._cache = (now, part)
        return part

    def warms_up(self, warmups: int) -> bool:
        """Whether a signature that warmed up ``warmups`` times must warm up again for what the call
        reaches: a DistributedDataParallel model that has not timed its first iterations yet (its
        reducer times 10 with CUDA events, and rebuilds its buckets at the second: PyTorch's
        CUDA-graph notes ask for 11 eager iterations). Its own count is read: iterations run before
        the model was graphed, or under another signature, count too; at most
        :data:`DDP_WARMUPS` per signature where it does not count (under ``no_grad``)."""
        if not self._ddps or warmups >= DDP_WARMUPS:
            return False
        for ref in self._ddps:
            ddp = ref()
            timed = _torch.ddp_timed_iterations(ddp) if ddp is not None else DDP_TIMED
            if timed is None or timed < DDP_TIMED:
                return True
        return False

    def containers(self) -> Containers | None:
        """The containers its code reads, as they are now (for a warm-up to compare), or None."""
        if self._reads is None:
            self._resolve()
        return Containers(self._containers) if self._containers else None

    def after_call(self) -> None:
        """Stop following the module attributes the call just changed (a replay changes none)."""
        reads, own, last = self._reads or [], self._own, self._cache[0]
        if len(last) < own:  # (the values were not read for these reads: another thread dropped some)
            return
        changed = [i for i in range(own) if reads[i][0].get(reads[i][1], _MISSING) is not last[i]]
        if not changed:
            return
        with self._lock:  # (rare: a call changed its module; another thread may be here too)
            if self._reads is not reads:
                return
            self._reads = [r for i, r in enumerate(reads) if i not in changed]
            self._own = own - len(changed)
            self._anchors = [i - sum(c < i for c in changed) for i in self._anchors]
            self._cache = ([], None)  # (the next part() is built anew)
            self.follows_modules = self._own > 0

    def _resolve(self) -> list[tuple[Any, str, str]]:
        """Follow the names the code reads as they are now (at the first call: globals defined after
        the function are there by then): plain values, and the models, functions and objects of
        settings it reaches by name (by identity, with what of them is keyed; see the class)."""
        owner = self._module if self._module is not None else self._owner
        mine, settings = _owner_reads(owner)
        reads: list[tuple[Any, str, str]] = list(mine)
        # A module attribute the call changes is dropped after it (a capture that changes one fails,
        # writes.module_changes); another object's stays keyed: each change is a new signature
        own = len(reads) if isinstance(owner, torch.nn.Module) else 0
        reads.extend(settings)  # (after `own`: not scanned after each call)
        anchors: list[int] = []
        if _user_object(owner):  # (a graphed method's object, a callable object of the user's class)
            for n, v in vars(owner).items():  # the models it holds: `self.model(x)` in `predictor.predict`
                if isinstance(v, torch.nn.Module):  # (their modes and settings, as a model read by name)
                    anchors.append(len(reads))
                    reads.append((vars(owner), n, f"self.{n}"))
                    reads.extend(itertools.chain(*_owner_reads(v, f"self.{n}", training=True)))
        containers: list[tuple[str, Any]] = []
        seen: set[tuple[int, str]] = set()
        for env, names, cells, strings in self._sources:
            spaces: list[tuple[Any, str]] = [(env, n) for n in sorted(names)] + [(_Cell(c), n) for c, n in cells]
            for space, n in spaces:
                key = (id(env), n) if isinstance(space, dict) else (id(space.cell), n)
                if key in seen:
                    continue
                seen.add(key)
                v = space.get(n, _MISSING)
                if type(v) in _PLAIN_SET or (_keyable(v) and not isinstance(v, _FUNCTIONS)):
                    reads.append((space, n, n))  # (`x * SCALE`; an Enum, a numpy scalar, a tuple `SIZE = (2, 2)`)
                elif isinstance(v, _CONTAINERS):
                    containers.append((n, v))
                    if isinstance(v, dict):  # `CONFIG["temperature"]`: the plain values of the keys the code names
                        reads.extend((v, k, f"{n}[{k!r}]") for k in sorted(strings) if type(v.get(k)) in _PLAIN_SET)
                elif isinstance(v, types.ModuleType) and _user_module(v):  # `mycfg.SCALE`: a config module
                    reads.extend(_plain_reads(vars(v), f"{n}.", frozenset(names), frozenset(), set()))
                elif isinstance(v, types.BuiltinMethodType) and isinstance(v.__self__, _CONTAINERS):
                    containers.append((n, v.__self__))  # (`log = LOSSES.append`: the list it grows)
                elif isinstance(v, torch.nn.Module) and v is not owner:  # a model the code calls: its mode too
                    anchors.append(len(reads))
                    reads.append((space, n, n))
                    reads.extend(itertools.chain(*_owner_reads(v, n, training=True)))
                elif isinstance(v, _FUNCTIONS):  # a function the code calls by name: rebound, another is called
                    anchors.append(len(reads))
                    reads.append((space, n, n))
                elif _settings_object(v) or _held_settings(v) or (isinstance(v, type) and _user_class(v)):
                    # an object whose attributes the code reads (a config or a dataclass of the user's,
                    # a library's: an HF GenerationConfig, an argparse Namespace; a class of the user's
                    # used as a namespace): the plain attributes its code names, its class's too
                    inst = vars(v) if not isinstance(v, type) else {}
                    attrs = _plain_reads(inst, f"{n}.", frozenset(names), frozenset(), set())
                    attrs += _class_level_reads(v if isinstance(v, type) else type(v), names, inst, f"{n}.")
                    if attrs:  # (`x * CFG.scale`: keyed as `x * SCALE` is, the object by its identity)
                        anchors.append(len(reads))
                        reads.append((space, n, n))
                        reads.extend(attrs)
        anchored = [space.get(n, None) for space, n, _ in (reads[i] for i in anchors)]
        models = [owner] + [m for m in anchored if isinstance(m, torch.nn.Module)]
        # DistributedDataParallel collects runtime stats with CUDA events in its first 10 iterations
        # and rebuilds its buckets in its second: PyTorch's CUDA-graph notes ask for 11 eager ones first
        ddps = [weakref.ref(m) for m in models if isinstance(m, torch.nn.Module) and _is_ddp(m)]
        fsdp2 = any(_is_fsdp2(m) for m in models)
        with self._lock:
            self._ddps = ddps
            self.kept_hint = FSDP2_KEPT if fsdp2 else ""
            self._reads, self._own, self._anchors, self._containers = reads, own, anchors, containers
            self._cache = ([], None)
            self.active = bool(reads)
            self.follows_modules = own > 0
        return reads


DDP_WARMUPS = 11
"""Eager iterations a DistributedDataParallel step runs before its capture (torch's CUDA semantics
notes, "Usage with DistributedDataParallel"), at most: fewer where DDP says it has timed its first
:data:`DDP_TIMED` already."""
DDP_TIMED = 10
"""The iterations DDP's reducer times with CUDA events before it samples one in a hundred."""


def _user_object(v: Any) -> bool:
    """An instance of a user's class with attributes of its own that is no module."""
    return (
        v is not None
        and hasattr(v, "__dict__")
        and not isinstance(v, (types.ModuleType, torch.nn.Module, type))
        and _user_class(type(v))
    )


def _settings_object(v: Any) -> bool:
    """An instance of a user's class that is no function, class, module or model (a config object,
    a dataclass of settings): its plain attributes the code reads are keyed. Not a
    ``threading.local``: its attributes are each thread's own, no setting of the call."""
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, threading.local)
    return hasattr(v, "__dict__") and not isinstance(v, skip) and _user_class(type(v))


def _is_ddp(m: Any) -> bool:
    return type(m).__name__ == "DistributedDataParallel" and type(m).__module__.startswith("torch.nn.parallel")


FSDP2_KEPT = (
    "FSDP2 (`fully_shard`) all-gathers the parameters of each sharded module into memory it allocates "
    "on every call, outside the graph's pool, and frees or keeps it as its own schedule says; a replay "
    "would read memory FSDP2 has since given back, so a step over an FSDP2 model runs eagerly"
)
"""Why a call reaching an FSDP2 model keeps tensors on every call (seen on four H200s, issue 48)."""


def _is_fsdp2(m: Any) -> bool:
    """Whether ``m`` was sharded by FSDP2's ``fully_shard`` (its class then derives from ``FSDPModule``)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # (not imported: nothing was sharded)
    cls = getattr(fsdp, "FSDPModule", None)
    return isinstance(cls, type) and isinstance(m, cls)


class _Cell:
    """A closure cell read as a namespace of one name (``get`` as ``dict.get``)."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def get(self, name: str, default: Any) -> Any:
        v = _content(self.cell)
        return default if v is _MISSING else v


_CONTAINERS = (list, dict, set, collections.deque)
_FUNCTIONS = (types.FunctionType, types.BuiltinFunctionType, functools.partial)


class Containers:
    """The lists, dicts, sets and deques a callable's code reads from its globals and closure, at one
    moment: a warm-up compares their lengths after the call (:meth:`changed`). A replay runs no
    Python: a call that appends its loss to a global list would append on its warm-ups only. (An
    item written in place, ``counts[0] += 1``, keeps the length: such a side effect is not seen, and
    runs at the warm-up and the recording only, as any Python of the call.)"""

    def __init__(self, watched: list[tuple[str, Any]]) -> None:
        self._watched = watched
        self._before = [len(c) for _, c in watched]

    def changed(self) -> str:
        """The first container the call added to or removed from, in words ("" if none)."""
        for (name, c), before in zip(self._watched, self._before):
            if len(c) != before:
                return f"the {type(c).__name__} `{name}` (a global or closure variable its code reads)"
        return ""


# DDP's gradient all-reduce switch, which no_sync() turns off (its require_forward_param_sync is set
# from it by each forward: derived, not keyed)
_SYNC_FLAGS = frozenset(("require_backward_grad_sync",))
_DERIVED = _SYNC_FLAGS | {"require_forward_param_sync"}  # (a library's settings not keyed apart)


_Read = tuple[dict[str, Any], str, str]  # (namespace, name, label)


def _owner_reads(owner: Any, label: str = "self", training: bool = False) -> tuple[list[_Read], list[_Read]]:
    """The plain attributes of an object the callable reads, labelled ``label``, in two lists.

    First, those a call may change as its own state: the object a graphed method is bound to
    (``sampler.sample`` reading ``self.temperature``), where its class is the user's; or a module's,
    with those of its submodules of the user's classes, DDP's gradient-sync flags (``no_sync()``)
    and, with ``training``, the module's own mode (a graphed module's is keyed apart). A
    submodule's mode is keyed where its class's code reads it (``nn.Dropout``, ``nn.BatchNorm2d``,
    an HF attention): ``model.eval()`` turns them all off with the module's own, but MC dropout
    turns dropout layers back on and fine-tuning freezes batch norms (``model.bn.eval()``).

    In both, an object of settings held as an attribute (an HF model's ``config``, a dataclass of
    settings: :func:`_held_settings`) is read for its plain attributes, once however many modules
    hold it (``model.config.output_hidden_states = True`` between calls changes what HF returns).

    Second, the settings of a module's submodules of library classes that their own code reads
    (:func:`_class_reads`: ``nn.Dropout``'s ``p``, an HF attention's ``scaling``): the caller's,
    as a library's forward that changed one would fail its recording (``writes.module_changes``),
    so a call is not scanned for changing them."""
    if owner is None or not hasattr(owner, "__dict__") or isinstance(owner, types.ModuleType):
        return [], []
    if not isinstance(owner, torch.nn.Module):
        if not _user_class(type(owner)):
            return [], []
        return _plain_reads(vars(owner), f"{label}.", None, frozenset(), set()), []
    out: list[_Read] = [(vars(owner), "training", f"{label}.training")] if training else []
    settings: list[_Read] = []
    held: set[int] = set()  # settings objects already read (one HF config is held by every layer)
    classes: set[tuple[int, str]] = set()  # class attributes already read (each layer of a class reads them)
    for path, sub in owner.named_modules():
        at = f"{label}.{path + '.' if path else ''}"
        attrs = vars(sub)
        out.extend((attrs, flag, at + flag) for flag in _SYNC_FLAGS if type(attrs.get(flag)) is bool)
        cls: type = type(sub)
        user = _user_class(cls)
        read = None if user else _class_reads(cls)  # (a library's: only what its code reads)
        skip = _module_internals() | (_SYNC_FLAGS if user else _DERIVED)
        (out if user else settings).extend(_plain_reads(attrs, at, read, skip, held))
        if path and "training" in _class_reads(cls):  # a submodule's own mode: MC dropout, a frozen BatchNorm
            (out if user else settings).append((attrs, "training", at + "training"))
        if user:  # (`scale = 2.0` in the class body, read as `self.scale`: once for all its instances)
            out.extend(_class_level_reads(cls, _class_reads(cls), attrs, at, classes))
    return out, settings


def _class_level_reads(
    cls: type, names: Iterable[str], attrs: dict[str, Any], at: str, seen: set[tuple[int, str]] | None = None
) -> list[_Read]:
    """The plain attributes of the user's classes in ``cls``'s MRO that ``names`` (what the code
    reads) name and the instance's own ``attrs`` do not shadow, read in the class that defines
    each (but those in ``seen``, which gets them): ``Block.scale = 3.0`` between calls changes
    what ``self.scale`` gives."""
    out: list[_Read] = []
    seen = set() if seen is None else seen
    for name in sorted(set(names) - attrs.keys()):
        for klass in cls.__mro__:
            space = vars(klass)
            if name in space:
                if type(space[name]) in _PLAIN_SET and _user_class(klass) and (id(klass), name) not in seen:
                    seen.add((id(klass), name))
                    out.append((space, name, at + name))  # type: ignore[arg-type]  # (a mappingproxy: get() as a dict's)
                break
    return out


def _plain_reads(
    attrs: dict[str, Any], at: str, read: frozenset[str] | None, skip: frozenset[str], held: set[int]
) -> list[_Read]:
    """The plain attributes in ``attrs`` but ``skip`` (those named in ``read`` where given), and
    those of the objects of settings among them (:func:`_held_settings`) not already in ``held``,
    labelled after ``at``."""
    out: list[_Read] = []
    for name, v in attrs.items():
        if name in skip or (read is not None and name not in read):
            continue
        if type(v) in _PLAIN_SET or _keyable(v):
            out.append((attrs, name, at + name))
        elif _held_settings(v) and id(v) not in held:  # (`self.config.output_hidden_states`)
            held.add(id(v))
            inner = vars(v)
            out.extend((inner, n, f"{at}{name}.{n}") for n, w in inner.items() if type(w) in _PLAIN_SET)
    return out


def _keyable(v: Any) -> bool:
    """A value that is no plain one but is a setting all the same, keyed by its value or identity
    (:func:`_value_part`): a function (``self.act = torch.relu``, a ``functools.partial``), an
    ``Enum`` member, a numpy scalar (``self.scale = 1 / np.sqrt(d)``), a short tuple of plain values
    (``torch.Size``, ``self.size = (2, 2)``)."""
    if isinstance(v, (*_FUNCTIONS, types.MethodType, enum.Enum)):
        return True
    if isinstance(v, tuple):
        return len(v) <= _MAX_TUPLE and all(type(i) in _PLAIN_SET for i in v)
    return type(v).__module__ == "numpy" and getattr(v, "shape", None) == ()


_MAX_TUPLE = 16  # (a longer tuple of plain values is data, not a setting: not keyed)


def _held_settings(v: Any) -> bool:
    """An object of settings a module holds (an HF model's ``config``, a user's dataclass of
    settings), or a callable object with a few settings of its own (a sampler of the user's class
    reading ``self.temperature`` in its ``__call__``, an HF ``TemperatureLogitsWarper``): no tensor,
    module, function or class. All its plain attributes are keyed, not only the names the module's
    code reads: HF reads ``return_dict`` by a string in a decorator, and ``_attn_implementation``
    through a property. (A library's callable with more than :data:`_MAX_CALLABLE_SETTINGS`
    attributes, a tokenizer, is not read.)"""
    skip = (type, types.ModuleType, types.FunctionType, types.MethodType, torch.nn.Module, torch.Tensor)
    if not hasattr(v, "__dict__") or isinstance(v, (*skip, threading.local, enum.Enum)) or type(v) in _PLAIN_SET:
        return False
    return not callable(v) or _user_class(type(v)) or len(vars(v)) <= _MAX_CALLABLE_SETTINGS


_MAX_CALLABLE_SETTINGS = 16


@functools.cache
def _class_reads(cls: type) -> frozenset[str]:
    """The attribute names a library module's ``forward`` may read, and those of the methods of its
    class it calls (``Conv2d._conv_forward`` reading ``self.stride``): its plain attributes among
    them are its settings (``nn.Dropout``'s ``p``, ``nn.LayerNorm``'s ``eps``), which its graphs
    hold as constants; ``nn.Linear`` reads none. Also what the functions those methods call by
    global name read of the module they are passed, one call deep, strings given to ``getattr``
    included: an HF attention's ``attention_interface(self, ...)`` (any of the functions of
    ``ALL_ATTENTION_FUNCTIONS``) reads ``module.is_causal``."""
    names: set[str] = set()
    todo = [getattr(cls, "forward", None)]
    seen: set[int] = set()
    helpers: list[Any] = []  # functions (and tables of functions) the class's methods name globally
    while todo and len(seen) < _MAX_FUNCTIONS:
        f = _function(todo.pop())
        if f is None or id(f) in seen:
            continue
        seen.add(id(f))
        read = _code_names(f.__code__)
        names |= read
        methods = [n for n in read if isinstance(inspect.getattr_static(cls, n, None), types.FunctionType)]
        todo.extend(getattr(cls, n) for n in methods)
        helpers.extend(f.__globals__[n] for n in read if n in f.__globals__)
    for h in helpers:
        table = list(h.values()) if isinstance(h, collections.abc.Mapping) and len(h) <= _MAX_TABLE else [h]
        for g in table:
            if isinstance(g, types.FunctionType):
                names |= _code_names(g.__code__) | _code_strings(g.__code__)
    return frozenset(names)


_MAX_TABLE = 32  # (a global mapping of at most this many functions is a table the code picks from)


def _code_strings(code: types.CodeType) -> set[str]:
    """The string constants of a code object and those nested in it that could name an attribute or
    a setting (``getattr(m, "is_causal")``, ``CONFIG["temperature"]``)."""
    out = {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _code_strings(c)
    return out


def _user_module(m: types.ModuleType) -> bool:
    """A Python module of the user's (a ``config.py`` of settings), not an installed one."""
    file = getattr(m, "__file__", None)
    return file is not None and not os.path.abspath(file).startswith(_library_roots())


@functools.cache
def _module_internals() -> frozenset[str]:
    """What ``nn.Module.__init__`` itself sets: hook bookkeeping, and ``training`` (followed apart)."""
    return frozenset(vars(torch.nn.Module()))


def _user_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code (a script, a notebook, a project's module)."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    return file is None or not os.path.abspath(file).startswith(_library_roots())


def _value_part(name: str, v: Any) -> tuple[Any, ...]:
    """A value's key part: by type and value where plain (``1``, ``1.0`` and ``True`` differ), by
    type and identity otherwise (a name rebound to an object: hashable whatever it is). A Python
    function by its code and plain defaults: one made again from the same code (a lambda made in a
    loop) computes the same (what its closure holds is read apart), a function defined anew does not."""
    t = type(v)
    if t in _PLAIN_SET:
        return (name, t, v)
    if isinstance(v, tuple) and _keyable(v):  # (its items by type and value: `(1,)` and `(True,)` differ)
        return (name, t, tuple((type(i), i) for i in v))
    if t.__module__ == "numpy" and getattr(v, "shape", None) == ():
        return (name, t, v.item())
    if t is types.FunctionType:
        defaults = v.__defaults__ or ()
        plain = all(type(d) in _PLAIN_SET for d in defaults)
        return (name, t, (id(v.__code__), defaults if plain else id(defaults)))
    return (name, t, id(v))


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return _MISSING


def _function(fn: Any) -> types.FunctionType | None:
    """The Python function whose code ``fn`` runs (a module's forward, a method's, a partial's, the
    function a decorator such as ``torch.compile`` wraps)."""
    for _ in range(8):
        if isinstance(fn, types.FunctionType):
            wrapped = getattr(fn, "__wrapped__", None)  # (functools.wraps: torch.compile's, a decorator's)
            if wrapped is None:
                return fn
            fn = wrapped
        elif isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif _callable_object(fn):
            fn = type(fn).__call__
        else:
            return None
    return None


def _callable_object(fn: Any) -> bool:
    """An instance of a user's class with a ``__call__`` of its own (not a function, a method or a module)."""
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - (the class's, as a call looks it up)
    return (
        isinstance(call, types.FunctionType)
        and not isinstance(fn, (type, torch.nn.Module, functools.partial))
        and _user_class(type(fn))
    )


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """Where installed code lives (the standard library, site-packages) and graphtree itself."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    roots |= {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # (graphtree's package)
    return tuple(os.path.join(r, "") for r in roots)


def _library(f: types.FunctionType) -> bool:
    """Whether ``f`` is installed code (torch, transformers, the standard library), not the user's:
    its globals are the library's, and its reads are not followed."""
    return os.path.abspath(f.__code__.co_filename).startswith(_library_roots())


def _user_methods(fn: Any, module: torch.nn.Module | None) -> list[types.FunctionType]:
    """The methods of the user's classes a call of ``fn`` runs besides ``fn`` itself: the forwards of
    ``module``'s submodules of the user's classes, and for those and for ``fn`` bound to an object
    of the user's class, the methods and property getters their code names through ``self``
    (``self._norm(x)``, ``self.temperature`` as a property): the globals they read are settings too
    (``USE_GELU`` in a block's forward)."""
    starts: list[tuple[type, Any]] = []
    if module is not None:
        classes = dict.fromkeys(type(m) for m in module.modules())
        starts += [(cls, cls.forward) for cls in classes if _user_class(cls)]
    owner = fn.__self__ if inspect.ismethod(fn) else None
    if owner is not None and not isinstance(owner, torch.nn.Module) and _user_class(type(owner)):
        starts.append((type(owner), fn))
    out: list[types.FunctionType] = []
    seen: set[int] = set()
    for cls, start in starts:
        todo = [start]
        while todo and len(seen) < _MAX_FUNCTIONS:
            f = _function(todo.pop())
            if f is None or id(f) in seen or _library(f):
                continue
            seen.add(id(f))
            out.append(f)
            for n in sorted(_code_names(f.__code__)):
                a = inspect.getattr_static(cls, n, None)
                if isinstance(a, (types.FunctionType, staticmethod, classmethod)):
                    todo.append(getattr(cls, n))
                elif isinstance(a, property) and a.fget is not None:
                    todo.append(a.fget)
    return out


def _code_names(code: types.CodeType) -> set[str]:
    """The global names a code object and those nested in it (lambdas, comprehensions) may read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _sources(
    fn: Any, methods: Sequence[types.FunctionType] = ()
) -> list[tuple[dict[str, Any], set[str], list[tuple[Any, str]], set[str]]]:
    """For ``fn``'s function, the ``methods`` of the user's classes it reaches, and the functions
    their code calls by global name (not libraries', nor parts marked ``graphtree.eager``; at most
    :data:`_MAX_DEPTH` calls deep and :data:`_MAX_FUNCTIONS` in all): its globals, the names its
    code reads, its closure's cells and the strings its code holds (``CONFIG["temperature"]``)."""
    out: list[tuple[dict[str, Any], set[str], list[tuple[Any, str]], set[str]]] = []
    first = _function(fn)
    todo = [(first, 0)] if first is not None and not _library(first) else []
    todo += [(m, 0) for m in reversed(methods)]  # (walked after fn's own: popped from the end)
    walked: set[int] = set()
    while todo and len(walked) < _MAX_FUNCTIONS:
        f, depth = todo.pop()
        if id(f) in walked:
            continue
        walked.add(id(f))
        names = _code_names(f.__code__)
        cells = list(zip(f.__closure__ or (), f.__code__.co_freevars))
        out.append((f.__globals__, names, [(c, n) for c, n in cells], _code_strings(f.__code__)))
        if depth < _MAX_DEPTH:
            for v in [f.__globals__.get(n) for n in names] + [_content(c) for c, _ in cells]:
                if getattr(v, "__graphtree_eager__", False):
                    continue  # a part marked graphtree.eager runs on every replay: what it reads is read live
                g = _function(v) if isinstance(v, types.FunctionType) else None
                if g is not None and not _library(g):
                    todo.append((g, depth + 1))
    return out
