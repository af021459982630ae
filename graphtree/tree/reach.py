"""What a graphed callable reads besides its arguments: the module it belongs to, the tensors its
closure holds, which its graphs read in place, and the plain values its code reads from its globals
and closure, which its graphs hold as constants.

A closure's cell can be rebound between calls (``w = new_w`` in the enclosing function): the graphs
recorded with the old tensor would read it, or its freed memory, where eager reads the new one.
:meth:`Reach.follow` reads the cells at each call (a few attribute reads) and, when one holds another
tensor, says so (``state_epoch.statics_replaced``): every recording checks the state it reads in place
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

import inspect
import itertools
import operator
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.code_scan import MISSING, callable_object, content, sources, user_methods
from graphtree.tree.free_reads import find_reads
from graphtree.tree.readable import PLAIN_SET
from graphtree.tree.settings import value_part
from graphtree.tree.state_epoch import param_epoch, statics_replaced, watch_parameter_changes


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
        place was replaced (``state_epoch.statics_replaced``)."""
        now = _cell_tensors(self.cells)
        if len(now) != len(self.tensors) or any(a is not b for a, b in zip(now, self.tensors)):
            self.tensors = now
            statics_replaced()

    def static_tensors(self) -> list[torch.Tensor]:
        """The module's parameters and buffers and the closure's tensors: state graphs read in place.

        Read again only after a module registered a parameter, buffer or submodule, or a cell was
        rebound (:func:`~graphtree.tree.state_epoch.param_epoch`): walking a large module on every call
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
        v = content(cell)
        if v is not MISSING:
            yield cell, v


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

    A tensor read from a global or a module's (or a bound object's) plain attribute is read in place
    (an external, its storage checked before each replay) and keyed by its identity: rebound to
    another tensor while the old one lives on (``W = W * 2``), the next call is a new signature (a
    closure's tensors are followed by :class:`Reach`). Other values are not keyed; containers are
    watched in warm-ups (:meth:`containers`). A module attribute the call itself changes is the
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

    # (slots: the native fast hit reads them at their offsets, graphtree/_native/fast_hit.h)
    __slots__ = (
        "_anchors", "_cache", "_changes", "_containers", "_ddps", "_epoch", "_fn", "_lock", "_methods",
        "_module", "_own", "_owner", "_reads", "_sources", "_state", "_structure", "active",
        "follows_modules", "kept_hint", "models",
    )  # fmt: skip

    def __init__(self, fn: Callable[..., Any], module: torch.nn.Module | None = None) -> None:
        self._fn = fn
        # (globals, names, cells) of each function walked: fn's, and the methods of the user's
        # classes it reaches (its module's and submodules' forwards, the methods they call)
        self._methods = user_methods(fn, module)
        self._sources = sources(fn, self._methods)
        # what the callable belongs to besides a module: a bound method's object, a callable object itself
        self._owner = fn.__self__ if inspect.ismethod(fn) else fn if callable_object(fn) else None
        self._module = module
        self._reads: list[tuple[Any, str, str]] | None = None  # (namespace, name, label), once resolved
        self._own = 0  # the first _own reads are module attributes
        self._anchors: list[int] = []  # reads of a model by name: rebound, the reads are resolved again
        self._containers: list[tuple[str, Any]] = []  # lists, dicts, sets its code reads (watched in warm-ups)
        self._state: list[tuple[Any, str, str]] = []  # values a warm-up saw the call change: watched, not keyed
        self._cache: tuple[list[Any], tuple[Any, ...] | None] = ([], None)  # (values last read, their part), one object
        self._lock = threading.Lock()
        self._ddps: list[weakref.ref[torch.nn.Module]] = []  # DistributedDataParallel models it reaches
        self.kept_hint = ""  # why the models it reaches keep memory on every call, where known (FSDP2's)
        self.active = True  # whether part() may return a part (False once it found nothing to follow)
        self._structure: list[tuple[dict[str, Any], str, torch.nn.Module]] = []  # (parent's _modules, name, child)
        self._epoch = -1  # the module-registration epoch the structure was read in (state_epoch.param_epoch)
        self._changes = 0  # replacements of submodules seen
        self.follows_modules = False  # whether it follows module attributes (after_call has work)
        self.models: tuple[torch.nn.Module, ...] = ()  # the models its code calls by name (read at part())

    def part(self) -> tuple[Any, ...] | None:
        """``("reads", ((name, type, value), ...))`` for the values read now, or None if none is read.
        The same part object while no value changed (one identity check per value)."""
        reads = self._reads
        if reads is None:
            reads = self._resolve()
        elif self._structure and param_epoch() != self._epoch:  # a module was registered somewhere
            reads = self._restructured(reads)
        if not reads and not self._changes:
            return None
        now = [d.get(n, MISSING) for d, n, _ in reads]
        last, cached = self._cache  # (one attribute: threads read and replace it whole)
        if len(now) == len(last) and cached is not None:
            if all(map(operator.is_, now, last)):
                return cached
            if any(now[i] is not last[i] for i in self._anchors):  # a model or function rebound: follow the new one
                self._sources = sources(self._fn, self._methods)
                reads = self._resolve()
                now = [d.get(n, MISSING) for d, n, _ in reads]
        values = tuple(value_part(label, v) for (_, _, label), v in zip(reads, now))
        if self._changes:  # (submodules replaced since the first call: `model.act = nn.Tanh()`)
            values += (("submodules replaced", int, self._changes),)
        part = ("reads", values)
        self._cache = (now, part)
        return part

    def _restructured(self, reads: list[tuple[Any, str, str]]) -> list[tuple[Any, str, str]]:
        """``reads``, or, where a submodule of the models it reaches was replaced (``model.act =
        nn.Tanh()``: a module without parameters, which no address check sees), the reads of the
        new ones; the part then counts the replacements, so that no recording of the old ones fits."""
        self._epoch = param_epoch()
        if all(d.get(n) is m for d, n, m in self._structure):
            return reads
        with self._lock:
            self._changes += 1
        self._methods = user_methods(self._fn, self._module)  # (their classes' code, walked anew)
        self._sources = sources(self._fn, self._methods)
        return self._resolve()

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
        """The containers its code reads and the values it keys besides its module's attributes,
        as they are now (for a warm-up to compare: :meth:`after_warm_up`), or None."""
        reads = self._reads if self._reads is not None else self._resolve()
        values = reads[self._own :] + self._state
        return Containers(self._containers, values) if self._containers or values else None

    def after_warm_up(self, watched: Containers) -> str:
        """What the warm-up just watched changed, in words ("" if nothing): a container, or a value
        the code reads (``calls["n"] += 1``, ``STEP += 1``). Such values are the call's state, not
        settings: they leave the key (each call would be a new signature) but stay watched, and the
        signature warms up again, run eagerly with that reason if every call changes them (a replay
        would not)."""
        changed = watched.changed_reads()
        if changed:
            with self._lock:
                reads = self._reads or []
                gone = {id(r) for r in changed}
                kept = [i for i, r in enumerate(reads) if id(r) not in gone]
                self._reads = [reads[i] for i in kept]
                self._own = sum(1 for i in kept if i < self._own)
                self._anchors = [kept.index(i) for i in self._anchors if i in kept]
                self._cache = ([], None)
                self._state += [r for r in changed if not any(r is q for q in self._state)]  # (still watched)
        return watched.changed(changed)

    def after_call(self) -> None:
        """Stop following the module attributes the call just changed (a replay changes none)."""
        reads, own, last = self._reads or [], self._own, self._cache[0]
        if len(last) < own:  # (the values were not read for these reads: another thread dropped some)
            return
        changed = [i for i in range(own) if reads[i][0].get(reads[i][1], MISSING) is not last[i]]
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
        """Find what the code reads as it is now (``free_reads.find_reads``) and follow that."""
        owner = self._module if self._module is not None else self._owner
        found = find_reads(owner, self._sources)
        models = (owner, *found.models) if isinstance(owner, torch.nn.Module) else found.models
        # DistributedDataParallel collects runtime stats with CUDA events in its first 10 iterations
        # and rebuilds its buckets in its second: PyTorch's CUDA-graph notes ask for 11 eager ones first
        ddps = [weakref.ref(m) for m in models if _is_ddp(m)]
        if found.structure:
            watch_parameter_changes()  # (a module registered anywhere bumps the epoch part() checks)
        with self._lock:
            self._ddps = ddps
            self.kept_hint = FSDP2_KEPT if any(_is_fsdp2(m) for m in models) else ""
            self._reads, self._own, self._anchors = found.reads, found.own, found.anchors
            self._containers, self._structure, self._epoch = found.containers, found.structure, param_epoch()
            self._cache = ([], None)
            self.active = bool(found.reads) or bool(found.structure)
            self.follows_modules = found.own > 0
            self.models = found.models
        return found.reads


class ModuleArguments:
    """The settings of the modules a call is passed (``step(model, batch)``, ``self`` of a graphed
    method of a module), read as a graphed module's are (:class:`FreeValues`): an argument is
    keyed by its type, identity and mode (``object_state.read_object``), and without this a
    ``model.drop.p = 0.0`` between calls replayed the recorded ``p``. One reader per module,
    dropped with it.

    Example::

        found = ModuleArguments().part(args, kwargs)   # (key part, readers), or None
    """

    def __init__(self) -> None:
        self._readers: weakref.WeakKeyDictionary[torch.nn.Module, FreeValues] = weakref.WeakKeyDictionary()

    def part(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, list[FreeValues]] | None:
        """The key part of the modules among the arguments (at the top level), with their readers."""
        parts: list[Any] = []
        readers: list[FreeValues] = []
        for a in itertools.chain(args, kwargs.values()):
            if isinstance(a, torch.nn.Module):
                reader = self._readers.get(a)
                if reader is None:
                    reader = self._readers[a] = FreeValues(a, a)
                found = reader.part() if reader.active else None
                if found is not None:
                    parts.append(found)
                    readers.append(reader)
        return (("module arguments", tuple(parts)), readers) if parts else None

    @staticmethod
    def after_call(found: tuple[Any, list[FreeValues]] | None) -> None:
        """Stop following the attributes the call just changed (as :meth:`FreeValues.after_call`)."""
        for reader in found[1] if found is not None else ():
            if reader.follows_modules:
                reader.after_call()


DDP_WARMUPS = 11
"""Eager iterations a DistributedDataParallel step runs before its capture (torch's CUDA semantics
notes, "Usage with DistributedDataParallel"), at most: fewer where DDP says it has timed its first
:data:`DDP_TIMED` already."""


DDP_TIMED = 10
"""The iterations DDP's reducer times with CUDA events before it samples one in a hundred."""


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


class Containers:
    """What a callable's code reads from its globals and closure that a call could change, at one
    moment, for a warm-up to compare after the call (:meth:`changed`): the lists, dicts, sets and
    deques (their items, by identity or, for plain values, by value: ``LOSSES.append(loss)``,
    ``counts[0] += 1``, ``calls["n"] += 1``), and the plain values it keys besides a module's
    attributes (a global or closure counter, ``STEP += 1``). A replay runs no Python: a call that
    changes one would change it on its warm-ups only. A container over :data:`MAX_ITEMS` items is
    compared by its length."""

    def __init__(self, watched: list[tuple[str, Any]], reads: list[tuple[Any, str, str]]) -> None:
        self._watched = watched
        self._before = [_items(c) for _, c in watched]
        self._reads = reads
        self._values = [space.get(n, MISSING) for space, n, _ in reads]

    def changed(self, reads: list[tuple[Any, str, str]] | None = None) -> str:
        """The first container or value the call changed, in words ("" if none); ``reads``: what
        :meth:`changed_reads` gave, if it was asked already."""
        for (name, c), before in zip(self._watched, self._before):
            if not _same_items(_items(c), before):
                return f"the {type(c).__name__} `{name}` (a global or closure variable its code reads)"
        changed = self.changed_reads() if reads is None else reads
        return f"`{changed[0][2]}` (a value its code reads)" if changed else ""

    def changed_reads(self) -> list[tuple[Any, str, str]]:
        """The values read (``(namespace, name, label)``) that the call changed."""
        return [r for r, v in zip(self._reads, self._values) if not _same(r[0].get(r[1], MISSING), v)]


MAX_ITEMS = 4096


def _items(c: Any) -> Any:
    """What of a container a call's change shows in: its items (a dict's keys and values), or its
    length past :data:`MAX_ITEMS`."""
    if len(c) > MAX_ITEMS:
        return len(c)
    if isinstance(c, dict):
        return (*c, *c.values())
    if isinstance(c, set):
        return frozenset(c)
    return tuple(c)


def _same_items(a: Any, b: Any) -> bool:
    if type(a) is not type(b) or not isinstance(a, tuple):
        return bool(a == b)
    return len(a) == len(b) and all(map(_same, a, b))


def _same(a: Any, b: Any) -> bool:
    """The same object, or equal plain values (``x = 1.0`` written again is no change)."""
    return a is b or (type(a) is type(b) and type(a) in PLAIN_SET and a == b)
