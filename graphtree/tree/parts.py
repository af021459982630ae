"""A module that cannot be graphed whole runs with its parts graphed.

``graphed(model)`` gives a signature up when the model's own code cannot be recorded: it uploads
host values (torchvision's detection transform: ``torch.as_tensor(self.image_mean, device=...)``),
its shapes depend on data (non-maximum suppression keeps some boxes), or a host read takes more
values than breaks allow. The whole call then ran eagerly, its convolutions too. Instead, such a
call runs the module's own code eagerly with each of its submodules graphed in its place: the
backbone of a detector has none of those operations and replays, and a submodule that cannot be
graphed either runs with *its* parts graphed, down the tree of modules.

How: while the module runs, each direct submodule's ``forward`` is, as an instance attribute, a
graphed callable of the submodule's own ``forward`` (``nn.Module.__call__`` looks ``forward`` up
on the instance, so hooks still run around it); the attribute is taken away again when the last
such call ends, leaving the submodule as it was. Containers without a ``forward`` of their own
(``ModuleList``, ``ModuleDict``) are looked through; leaves without parameters or buffers (an
activation, a dropout) are left alone, and so are a submodule the user graphed already, a compiled
and a TorchScript module.

A part is kept only if a graph can gain on it: one whose warm-ups all dispatched fewer than
:data:`MIN_PART_OPS` operators (a single linear layer) is given up with that reason and taken out,
so that later calls reach it with no cost at all. The module's code reads its parts' outputs as a
graphed call's (overwritten by the part's next replay); what the module returns is copied out of
them (:func:`own_copies`), so that its caller gets what an eager run gave.
A submodule with hooks below it is looked through (a replay would not run them), and a part runs
eagerly on a call where hooks below it, or global module hooks, have appeared since (tree/hooks.py).

Example::

    model = graphtree.graphed(detector)   # the detector's own code uploads host lists
    model(images)      # eager, with detector.backbone, detector.rpn.head, ... graphed
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree import manager as _manager
from graphtree.tree.hooks import hooks_below

MIN_PART_OPS = 16
"""Operators (views included, metadata queries not) a part's warm-up must dispatch for graphtree to
keep it graphed: below this, the replay's own cost (a few microseconds on the host) is not won back
by fewer launches."""

_ABSENT = object()


def graphable_children(
    module: torch.nn.Module, prefix: str = "", seen: set[int] | None = None
) -> Iterator[tuple[str, torch.nn.Module]]:
    """The submodules of ``module`` worth graphing in its place, with their dotted names: its direct
    children, through containers that have no ``forward`` of their own and through modules with
    hooks inside (a replay would skip those hooks); not leaves without parameters or buffers, nor
    modules graphed already (a ``GraphedModule``, a ``forward`` the user graphed), compiled
    (``torch.compile``'s module) or scripted."""
    seen = {id(module)} if seen is None else seen
    for name, child in module.named_children():
        if id(child) in seen:  # a module reached twice (shared, or its container's too) is one part
            continue
        seen.add(id(child))
        path = f"{prefix}{name}"
        own = child.__dict__.get("forward")
        if (
            isinstance(child, torch.jit.ScriptModule)  # its forward is no attribute to set
            or getattr(child, "graphed_callable", None) is not None
            or getattr(type(child).forward, "graphtree_callable", False)  # @graphed on forward in its class
            or (getattr(own, "graphtree_callable", False) and not getattr(own, "is_part", False))
            or "_orig_mod" in child._modules  # torch.compile's OptimizedModule
        ):
            continue
        if (type(child).forward is torch.nn.Module.forward and own is None) or hooks_below(child):
            yield from graphable_children(child, f"{path}.", seen)  # a container, or hooks to keep running
            continue
        if not _has_state(child):
            continue  # an activation, a dropout: nothing a graph gains
        yield path, child


def _has_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` has submodules, parameters or buffers of its own."""
    return any(True for _ in module.children()) or any(
        True for _ in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    )


_swaps = threading.Lock()
_placed: dict[int, tuple[Any, list[Any]]] = {}
"""Submodules with parts in place, by id: (their instance ``forward`` before any, the parts in
place, last on top). Two modules graphed in parts can share a submodule (T5's embedding, in the
model and in its decoder), in one thread or two: each puts its part on top and takes only its own
off, and the submodule gets the one below back, or what it had before any."""


def _own_forward(child: torch.nn.Module) -> Any:
    """``child``'s instance ``forward`` before any part was put in place, or None."""
    with _swaps:
        placed = _placed.get(id(child))
    own = placed[0] if placed is not None else child.__dict__.get("forward", _ABSENT)
    return None if own is _ABSENT else own


def _put(child: torch.nn.Module, part: Any) -> None:
    with _swaps:
        placed = _placed.setdefault(id(child), (child.__dict__.get("forward", _ABSENT), []))
        placed[1].append(part)
        child.__dict__["forward"] = part


def _take(child: torch.nn.Module, part: Any) -> None:
    with _swaps:
        before, stack = _placed[id(child)]
        del stack[len(stack) - 1 - stack[::-1].index(part)]
        if stack:
            child.__dict__["forward"] = stack[-1]
            return
        del _placed[id(child)]
        if before is _ABSENT:
            child.__dict__.pop("forward", None)
        else:
            child.__dict__["forward"] = before


class Parts:
    """The graphed parts of one module, put in place while the module runs eagerly.

    ``make(fn, name=...)`` makes the graphed callable of one part (``fn``: the part's own bound
    ``forward``). The parts are made at the first :meth:`run`.
    """

    def __init__(self, module: torch.nn.Module, name: str, make: Callable[..., Any]) -> None:
        self.module = module
        self.name = name
        self._make = make
        self._lock = threading.Lock()
        self._depth = 0  # calls running with the parts in place (threads, or the module re-entered)
        self._parts: list[tuple[torch.nn.Module, Any]] | None = None  # (submodule, its graphed callable)

    def names(self) -> list[str]:
        """The parts' names, each followed by those of its own parts (after the first run; parts
        found too small are gone)."""
        return [name for _, g in self._parts or [] for name in (g.name, *g.parts())]

    def _build(self) -> list[tuple[torch.nn.Module, Any]]:
        parts: list[tuple[torch.nn.Module, Any]] = []
        for path, child in graphable_children(self.module):
            own = _own_forward(child)  # an instance forward someone set: graph that one
            fn: Callable[..., Any] = type(child).forward.__get__(child) if own is None else own
            parts.append((child, self._make(fn, name=f"{self.name}.{path}")))
        return parts

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` with the parts graphed in place."""
        with self._lock:
            if self._parts is None:
                self._parts = self._build()
            if self._depth == 0:
                for child, g in self._parts:
                    _put(child, g)
            self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._put_back()

    def _put_back(self) -> None:
        """Every part taken off its submodule; the ones found too small leave the list for good."""
        kept = []
        for child, g in reversed(self._parts or []):
            _take(child, g)
            if not g.verdicts.too_small():
                kept.append((child, g))
        self._parts = kept[::-1]


def own_copies(out: Any, since: dict[int, int]) -> Any:
    """``out`` with each CUDA tensor whose memory is a held output of a recording run since
    ``since`` (:func:`graphtree.tree.manager.one_step`'s mark) replaced by a copy: what a module
    graphed in parts returns is its caller's, as from an eager run, and not the memory its part's
    next replay writes. Tensors inside objects pytrees do not flatten are not seen."""
    held = _manager.step_outputs(since)
    if not held:
        return out
    leaves, spec = _torch.flatten_outputs(out)
    shared = [isinstance(t, torch.Tensor) and t.is_cuda and _torch.storage_id(t) in held for t in leaves]
    if not any(shared):
        return out
    return _torch.tree_unflatten([t.clone() if s else t for t, s in zip(leaves, shared)], spec)
