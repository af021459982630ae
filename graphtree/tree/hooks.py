"""Module hooks a graphed call would run, whose Python no replay repeats.

A hook is Python that ``nn.Module.__call__`` runs around a module's ``forward``: a forward hook
that keeps a layer's output (feature extraction, Grad-CAM), a pre-hook that changes the input, a
global one (``FlopCounterMode``). Recorded, its kernels are in the graph but its Python (an append
to a list, a counter, a print) runs on no replay; added after a recording, a replay skips it
whole; removed, a replay still runs its kernels. Each makes a call differ from eager's, so a
graphed call that would run a module holding a hook runs eagerly, with the reason naming the
module and the hook, for as long as the hook is there (a hook on the graphed module itself, a
``GraphedModule``, runs around its replays and counts for nothing).

Not counted: hooks known to write only into the call's own outputs, which a replay gives back as
recorded. transformers' output recorders are such (installed on every layer the first time a call
asks for ``output_hidden_states`` and kept; idle unless a call collects, into its own output), and
tensor parallelism's (``parallelize_module``: inputs made DTensors, outputs redistributed).

Cost: two integers read per call. torch numbers every hook handle it makes
(``RemovableHandle.next_id``) and graphtree counts the registrations of submodules
(``state_epoch.param_epoch``); only when one of them moved are the hook tables looked at again. A
removal only empties a table, so a module found without hooks stays so until a registration;
one found with hooks is looked at on every call (each such call runs eagerly anyway).

Example::

    hooks = ModuleHooks(model, include_self=True)
    reason = hooks.reason("model")     # None, or why this call runs eagerly
"""

from __future__ import annotations

from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.state_epoch import param_epoch, param_epoch_cell, watch_parameter_changes

_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# What every call reads, read where they live (no call into _torch or inputs on the common path):
# torch's count of hook handles made (-1 where torch keeps none) and the parameter epoch.
_HANDLE_CLASS = _torch.hook_handle_class()
_EPOCH_CELL = param_epoch_cell()

# (module, name) of the hooks graphtree knows to write only into the call's own outputs, and the
# modules all of whose hooks do: tensor parallelism's (`parallelize_module`, `distribute_module`)
# turn the inputs into DTensors and the outputs back, collectives included, inside the call
_IN_THE_CALL = frozenset({("transformers.utils.output_capturing", "output_capturing_hook")})
_IN_THE_CALL_MODULES = ("torch.distributed.tensor.",)


def _counts(hook: Any) -> bool:
    """Whether a replay that skips ``hook``'s Python could differ from an eager call."""
    module = getattr(hook, "__module__", None) or ""
    return (module, getattr(hook, "__name__", None)) not in _IN_THE_CALL and not module.startswith(_IN_THE_CALL_MODULES)


_AROUND = " (hooks on the module graphtree.graphed(model) returns run around its replays)"


def _whose(hook: Any) -> str:
    """What a hook of a known library does, said after its name ("" for others)."""
    module = getattr(hook, "__module__", None) or type(hook).__module__
    if module.startswith("torch.distributed.fsdp"):
        return ": FSDP2 (`fully_shard`) gathers and frees the parameters in its hooks"
    return ""


def _hook_name(hook: Any) -> str:
    return getattr(hook, "__qualname__", None) or type(hook).__qualname__


class ModuleHooks:
    """The hook tables of the modules a graphed call runs: every module below ``module``, and
    ``module`` itself with ``include_self`` (its ``__call__`` runs inside the graphed call, not
    around it). :meth:`reason` says why a call runs eagerly, or None."""

    def __init__(self, module: torch.nn.Module, include_self: bool = False) -> None:
        watch_parameter_changes()  # (a submodule registered bumps param_epoch: its tables are read again)
        self.module = module
        self._include_self = include_self
        self._tables: list[tuple[str, str, dict[int, Any]]] = []
        self._epoch = -1
        self._handles = -1
        self._found: str | None = None

    def reason(self, name: str) -> str | None:
        """Why a call of ``name`` runs eagerly for the hooks it would run, or None."""
        handles = getattr(_HANDLE_CLASS, "next_id", -1)  # (_torch.hook_handles_made, without its frame)
        if handles == self._handles and self._found is None and handles >= 0 and _EPOCH_CELL[0] == self._epoch:
            return None
        self._handles = handles
        found = self.found()
        return None if found is None else f"`{name}` runs module hooks a replay would not run: {found}"

    def found(self) -> str | None:
        """The first hook a replay would not repeat, said in words, or None (looked at now)."""
        epoch = param_epoch()
        if epoch != self._epoch:
            self._tables = self._look_up()
            self._epoch = epoch
        self._found = self._find()
        return self._found

    def _look_up(self) -> list[tuple[str, str, dict[int, Any]]]:
        """The tables, looked up once per module tree (registering a hook adds to its module's table)."""
        named = self.module.named_modules(remove_duplicate=True)
        return [
            (path, kind, getattr(m, kind))
            for path, m in named
            if self._include_self or m is not self.module
            for kind in _KINDS
        ]

    def _find(self) -> str | None:
        if _torch.global_module_hooks():
            return "global module hooks are registered (every module's call runs them)"
        for path, kind, table in self._tables:
            if table:
                for hook in table.values():
                    if _counts(hook):
                        where = f"`{path}`" if path else "the module itself"
                        what = f"{where} holds a {kind[1:-1].replace('_', ' ')} ({_hook_name(hook)})"
                        return what + (_whose(hook) or ("" if path else _AROUND))
        return None


class CallHooks:
    """The hooks a graphed call would run: those of its module (:class:`ModuleHooks`) and, all of
    each, those of the models its code calls by name (``model(x)`` in a graphed function: ``models``,
    read by ``reach.FreeValues``). Only the models it is given last are watched (a model rebound is
    not kept alive)."""

    def __init__(self, module: torch.nn.Module | None, include_self: bool) -> None:
        self._own = ModuleHooks(module, include_self) if module is not None else None
        self._models: tuple[torch.nn.Module, ...] = ()
        self._named: list[ModuleHooks] = []
        self.idle = self._own is None  # nothing watched: a call that names no model need not ask

    def reason(self, name: str, models: tuple[torch.nn.Module, ...]) -> str | None:
        """Why a call of ``name`` runs eagerly for the hooks it would run, or None."""
        found = self._own.reason(name) if self._own is not None else None
        if models is not self._models:
            kept = {id(h.module): h for h in self._named}
            self._named = [kept.get(id(m)) or ModuleHooks(m, include_self=True) for m in models]
            self._models = models
            self.idle = self._own is None and not self._named
        for hooks in self._named:
            if found is not None:
                break
            found = hooks.reason(name)
        return found


def hooks_below(module: torch.nn.Module) -> bool:
    """Whether a module below ``module`` (not itself: its own hooks run around a part of it) holds a
    hook a replay of ``module`` would not repeat."""
    return ModuleHooks(module).found() is not None
