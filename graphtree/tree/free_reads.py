"""Which values a graphed callable's code reads by name, found once (and again when what it reaches
changes): the walk behind :class:`graphtree.tree.reach.FreeValues`, which then reads those values at
each call for the key.

From the callable's owner (its module, a bound method's object) and the names its code reads
(``code_scan.sources``), :func:`find_reads` lists each value to key as ``(namespace, name, label)``:
plain values of globals and closure cells, the attributes of the models, functions and objects of
settings the code reaches by name, the containers it reads (watched in warm-ups, not keyed), and
the submodule structure of the models it reaches (a submodule replaced changes what runs).

Example::

    found = find_reads(model, sources(fn, user_methods(fn, model)))
    found.reads       # [(namespace, name, label), ...]: each read with ``namespace.get(name)``
"""

from __future__ import annotations

import collections
import itertools
import types
from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from graphtree.tree.code_scan import MISSING, content, user_class, user_module
from graphtree.tree.readable import PLAIN_SET
from graphtree.tree.settings import (
    FUNCTIONS,
    class_level_reads,
    held_settings,
    keyable,
    owner_reads,
    plain_reads,
    settings_object,
    user_object,
)

Read = tuple[Any, str, str]
"""A value read by name: ``(namespace, name, label)``, read as ``namespace.get(name, MISSING)``."""

_CONTAINERS = (list, dict, set, collections.deque)
"""The containers a call may change in place: watched in warm-ups (``reach.Containers``), not keyed."""


class FoundReads(NamedTuple):
    """What :func:`find_reads` found."""

    reads: list[Read]
    """Each value to key; the first :attr:`own` are the owner module's own attributes."""
    own: int
    """How many of :attr:`reads` are the owner module's attributes (a call that changes one stops
    following it: ``FreeValues.after_call``)."""
    anchors: list[int]
    """The indices of reads of a model, function or object of settings by name: rebound, the reads
    are found anew."""
    containers: list[tuple[str, Any]]
    """The lists, dicts, sets and deques its code reads, by name."""
    models: tuple[torch.nn.Module, ...]
    """The models its code reaches by name (the owner's attributes' included), the owner not."""
    structure: list[tuple[dict[str, Any], str, torch.nn.Module]]
    """Each submodule of the owner (if a module) and of those models, as ``(parent's _modules,
    name, child)``."""


def find_reads(owner: Any, sources: Iterable[tuple[Any, Any, Any, Any]]) -> FoundReads:
    """The values to key for a callable that belongs to ``owner`` (a module, a bound method's
    object, or None) and whose code reads the names ``sources`` gives (``code_scan.sources``: one
    ``(globals, names, cells, strings)`` per function walked), as they are now (at the first call:
    globals defined after the function are there by then).

    Plain values are read themselves; a model, function or object of settings reached by name is
    read by identity, with what of it is keyed (``reach.FreeValues`` says what)."""
    mine, settings = owner_reads(owner)
    reads: list[Read] = list(mine)
    # A module attribute the call changes is dropped after it (a capture that changes one fails,
    # writes.module_changes); another object's stays keyed: each change is a new signature
    own = len(reads) if isinstance(owner, torch.nn.Module) else 0
    reads.extend(settings)  # (after `own`: not scanned after each call)
    anchors: list[int] = []
    if user_object(owner):  # (a graphed method's object, a callable object of the user's class)
        for n, v in vars(owner).items():  # the models it holds: `self.model(x)` in `predictor.predict`
            if isinstance(v, torch.nn.Module):  # (their modes and settings, as a model read by name)
                anchors.append(len(reads))
                reads.append((vars(owner), n, f"self.{n}"))
                reads.extend(itertools.chain(*owner_reads(v, f"self.{n}", training=True)))
    containers: list[tuple[str, Any]] = []
    seen: set[tuple[int, str]] = set()
    for env, names, cells, strings in sources:
        spaces: list[tuple[Any, str]] = [(env, n) for n in sorted(names)] + [(_Cell(c), n) for c, n in cells]
        for space, n in spaces:
            key = (id(env), n) if isinstance(space, dict) else (id(space.cell), n)
            if key in seen:
                continue
            seen.add(key)
            v = space.get(n, MISSING)
            if type(v) in PLAIN_SET or (keyable(v) and not isinstance(v, FUNCTIONS)):
                reads.append((space, n, n))  # (`x * SCALE`; an Enum, a numpy scalar, a tuple `SIZE = (2, 2)`)
            elif isinstance(v, torch.Tensor) and isinstance(space, dict):
                reads.append((space, n, n))  # (`x @ W`: rebound, by identity; a closure's: Reach.follow)
            elif isinstance(v, _CONTAINERS):
                containers.append((n, v))
                if isinstance(v, dict):  # `CONFIG["temperature"]`: the plain values of the keys the code names
                    reads.extend((v, k, f"{n}[{k!r}]") for k in sorted(strings) if type(v.get(k)) in PLAIN_SET)
            elif isinstance(v, types.ModuleType) and user_module(v):  # `mycfg.SCALE`: a config module
                reads.extend(plain_reads(vars(v), f"{n}.", frozenset(names), frozenset(), set()))
            elif isinstance(v, types.BuiltinMethodType) and isinstance(v.__self__, _CONTAINERS):
                containers.append((n, v.__self__))  # (`log = LOSSES.append`: the list it grows)
            elif isinstance(v, torch.nn.Module) and v is not owner:  # a model the code calls: its mode too
                anchors.append(len(reads))
                reads.append((space, n, n))
                reads.extend(itertools.chain(*owner_reads(v, n, training=True)))
            elif isinstance(v, FUNCTIONS):  # a function the code calls by name: rebound, another is called
                anchors.append(len(reads))
                reads.append((space, n, n))
            elif settings_object(v) or held_settings(v) or (isinstance(v, type) and user_class(v)):
                # an object whose attributes the code reads (a config or a dataclass of the user's,
                # a library's: an HF GenerationConfig, an argparse Namespace; a class of the user's
                # used as a namespace): the plain attributes its code names, its class's too
                inst = vars(v) if not isinstance(v, type) else {}
                attrs = plain_reads(inst, f"{n}.", frozenset(names), frozenset(), set())
                attrs += class_level_reads(v if isinstance(v, type) else type(v), names, inst, f"{n}.")
                if attrs:  # (`x * CFG.scale`: keyed as `x * SCALE` is, the object by its identity)
                    anchors.append(len(reads))
                    reads.append((space, n, n))
                    reads.extend(attrs)
    anchored = [space.get(n, None) for space, n, _ in (reads[i] for i in anchors)]
    models = tuple(m for m in anchored if isinstance(m, torch.nn.Module))
    structure = [
        (sub._modules, name, child)
        for m in (owner, *models)
        if isinstance(m, torch.nn.Module)
        for sub in m.modules()
        for name, child in sub._modules.items()
        if child is not None
    ]
    return FoundReads(reads, own, anchors, containers, models, structure)


class _Cell:
    """A closure cell read as a namespace of one name (``get`` as ``dict.get``)."""

    __slots__ = ("cell",)

    def __init__(self, cell: Any) -> None:
        self.cell = cell

    def get(self, name: str, default: Any) -> Any:
        v = content(self.cell)
        return default if v is MISSING else v
