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
activation, a dropout) are left alone, and so are a submodule the user graphed already and a
TorchScript module.

A part is kept only if a graph can gain on it: one whose warm-up ran fewer than
:data:`MIN_PART_OPS` torch operations (a single linear layer) is given up with that reason and
taken out, so that later calls reach it with no cost at all. Its outputs follow every rule of a
graphed call (they are overwritten by a later replay of the part; reading one after that raises).

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

MIN_PART_OPS = 16
"""Torch operations a part's warm-up must run for graphtree to keep it graphed: below this, the
replay's own cost (a few microseconds on the host) is not won back by fewer launches."""

_ABSENT = object()


def small_part_reason(name: str, ops: int) -> str:
    """Why a part of ``ops`` operations is not graphed."""
    return (
        f"`{name}` runs {ops} torch operations, fewer than {MIN_PART_OPS}: a graph of it would not gain "
        f"(graphtree graphed it as a part of a module that cannot be graphed whole)"
    )


def graphable_children(module: torch.nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.nn.Module]]:
    """The submodules of ``module`` worth graphing in its place, with their dotted names: its direct
    children, through containers that have no ``forward`` of their own; not leaves without
    parameters or buffers, nor modules graphed already."""
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if getattr(child, "graphed_callable", None) is not None or isinstance(child, torch.jit.ScriptModule):
            continue  # graphed already (a GraphedModule), or TorchScript's (its forward is no attribute to set)
        if type(child).forward is torch.nn.Module.forward:  # a container: ModuleList, ModuleDict
            yield from graphable_children(child, f"{path}.")
            continue
        if not _has_state(child):
            continue  # an activation, a dropout: nothing a graph gains
        yield path, child


def _has_state(module: torch.nn.Module) -> bool:
    """Whether ``module`` has submodules, parameters or buffers of its own."""
    return any(True for _ in module.children()) or any(
        True for _ in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False))
    )


class Parts:
    """The graphed parts of one module, put in place while the module runs eagerly.

    ``make(fn, name)`` makes the graphed callable of one part (``fn``: the part's own bound
    ``forward``). The parts are made at the first :meth:`run`.
    """

    def __init__(self, module: torch.nn.Module, name: str, make: Callable[[Callable[..., Any], str], Any]) -> None:
        self.module = module
        self.name = name
        self._make = make
        self._lock = threading.Lock()
        self._depth = 0  # calls running with the parts in place (threads, or the module re-entered)
        self._parts: list[tuple[torch.nn.Module, Any, Any]] | None = None  # (part, own forward, graphed)

    def names(self) -> list[str]:
        """The parts' names, each followed by those of its own parts (after the first run; parts
        found too small are gone)."""
        return [name for _, _, g in self._parts or [] for name in (g.name, *g.parts())]

    def _build(self) -> list[tuple[torch.nn.Module, Any, Any]]:
        parts = []
        for path, child in graphable_children(self.module):
            own = child.__dict__.get("forward", _ABSENT)  # an instance forward someone set: wrap that
            parts.append((child, own, self._make(child.forward, f"{self.name}.{path}")))
        return parts

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` with the parts graphed in place."""
        with self._lock:
            if self._parts is None:
                self._parts = self._build()
            if self._depth == 0:
                for child, _own, g in self._parts:
                    child.__dict__["forward"] = g
            self._depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._put_back()

    def _put_back(self) -> None:
        """Every part as it was; the ones found too small leave the list for good."""
        kept = []
        for child, own, g in self._parts or []:
            if own is _ABSENT:
                child.__dict__.pop("forward", None)
            else:
                child.__dict__["forward"] = own
            if not g.too_small():
                kept.append((child, own, g))
        self._parts = kept
