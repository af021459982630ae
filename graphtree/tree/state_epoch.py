"""The epoch of the state recordings read in place: one number that moves whenever any
``nn.Module`` registers a parameter, buffer or submodule, or a closure cell a graphed function reads
is rebound (:func:`statics_replaced`). A replay compares it with the epoch its checks last passed
in (one int compare); only where it moved are a module's tensors walked again.

Example::

    watch_parameter_changes()
    before = param_epoch()
    model.extra = torch.nn.Linear(2, 2)   # a submodule registered: the epoch moves
    assert param_epoch() > before
"""

from __future__ import annotations

import torch

# (torch has no per-module registration hook: the hooks are global, installed once graphtree first
# reads a module's state in place)
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
