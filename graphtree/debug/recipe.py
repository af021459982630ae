"""How a dump keeps the callable it was taken from, so that a fresh process can call it again.

A function that a fresh process can import (its module is not the script that ran, it is not a
lambda or a nested function) is kept as ``module:qualname``, with the dumping process's
``sys.path`` and working directory so that ``graphtree debug rerun`` finds it from any folder.
Everything else is kept **by value** with cloudpickle: functions of ``__main__`` (a script run
as ``python script.py``, a notebook), lambdas and nested functions with the globals and closures
they use, and ``nn.Module`` instances (a model, or a method bound to one) with their weights and
buffers. Tensors are stored on the host, each with the device it was on, and go back there when
unpickled. A callable that cannot be pickled says why and what to do.

Example::

    recipe = recipe_of(step)             # when the dump is written
    fn = recipe.rebuild()                # in the re-running process
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import marshal
import os
import pickle
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Recipe", "recipe_of"]


@dataclasses.dataclass
class Recipe:
    """What a dump keeps of its callable (see the module docstring)."""

    target: str | None  # "module:qualname" when it is imported, else None
    note: str  # how it is rebuilt, or why it cannot be
    by_value: bytes | None = None  # the callable itself, pickled with its tensors on the host
    sys_path: list[str] = dataclasses.field(default_factory=list)  # the dumping process's, absolute
    cwd: str = ""

    def rebuild(self) -> Callable[..., Any]:
        """The callable again: unpickled (its tensors back on their devices) or imported.

        Raises ``ValueError`` saying why when it cannot be rebuilt here.
        """
        if self.by_value is None and self.target is None:
            raise ValueError(f"this dump's callable cannot be rebuilt: {self.note}")
        _extend_path(self.sys_path)
        if self.by_value is not None:
            fn: Callable[..., Any] = pickle.loads(self.by_value)
            return fn
        assert self.target is not None
        module, _, qualname = self.target.partition(":")
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj


def recipe_of(fn: Callable[..., Any], limit_bytes: int | None = None) -> Recipe:
    """How to rebuild ``fn`` (unwrapped from graphtree's and ``functools.wraps``' wrappers); a
    model whose weights exceed ``limit_bytes`` is not kept (the note says how to raise it)."""
    inner = inspect.unwrap(fn)
    sys_path, cwd = [os.path.abspath(p or os.curdir) for p in sys.path], os.getcwd()
    owner = getattr(inner, "__self__", None)
    module, qualname = getattr(inner, "__module__", None), getattr(inner, "__qualname__", None)
    importable = (
        not isinstance(inner, torch.nn.Module)
        and (owner is None or isinstance(owner, type))
        and module not in (None, "__main__")
        and qualname is not None
        and "<locals>" not in qualname
        and "<lambda>" not in qualname
    )
    if importable:
        return Recipe(f"{module}:{qualname}", "imported", None, sys_path, cwd)
    what = _what(inner)
    model = inner if isinstance(inner, torch.nn.Module) else owner
    if isinstance(model, torch.nn.Module) and limit_bytes is not None:
        size = sum(t.untyped_storage().nbytes() for t in (*model.parameters(), *model.buffers()))
        if size > limit_bytes:
            return Recipe(
                None,
                f"{what} is not kept: its weights ({size / 2**20:.1f} MiB) exceed the dump's limit of "
                f"{limit_bytes / 2**20:.1f} MiB (raise limit_bytes to keep them)",
                None,
                sys_path,
                cwd,
            )
    try:
        data = _pickle(inner)
    except Exception as e:  # noqa: BLE001 - whatever pickling trips on is reported, never raised
        return Recipe(
            None,
            f"{what} could not be saved ({type(e).__name__}: {e}): make it importable (a function at module "
            "level of an importable module), or rebuild it and call it with the dumped arguments",
            None,
            sys_path,
            cwd,
        )
    return Recipe(None, f"{what}, saved by value", data, sys_path, cwd)


def _what(fn: Any) -> str:
    if isinstance(fn, torch.nn.Module):
        cls = type(fn)
        return f"an instance of {cls.__module__}.{cls.__qualname__} (weights included)"
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, type):
        cls = type(owner)
        return f"{getattr(fn, '__name__', '?')} bound to an instance of {cls.__module__}.{cls.__qualname__}"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _pickle(fn: Any) -> bytes:
    """``fn`` pickled by value (cloudpickle), each device tensor as a host copy and its device."""
    import cloudpickle

    class HostPickler(cloudpickle.CloudPickler):
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type not in ("cpu", "meta"):
                host = obj.detach().to("cpu")
                if isinstance(obj, torch.nn.Parameter):
                    return _parameter_on, (host, str(obj.device), obj.requires_grad)
                return _tensor_on, (host, str(obj.device))
            if isinstance(obj, types.CodeType):
                # cloudpickle >= 3.1 names every code object it keeps "<dynamic-code>": a re-run's
                # traceback would lose the script's file. marshal keeps code whole, file included
                # (a dump re-runs on the Python that wrote it: code by value needs that anyway).
                return marshal.loads, (marshal.dumps(obj),)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    HostPickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(fn)
    return buf.getvalue()


def _tensor_on(host: torch.Tensor, device: str) -> torch.Tensor:
    """Unpickles a device tensor of a dumped callable: back on its device."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"the dumped callable's tensors were on {device}, and this machine has no CUDA device")
    return host.to(device)


def _parameter_on(host: torch.Tensor, device: str, requires_grad: bool) -> torch.nn.Parameter:
    return torch.nn.Parameter(_tensor_on(host, device), requires_grad=requires_grad)


def _extend_path(paths: list[str]) -> None:
    """Put the dumping process's import folders that this one lacks first on ``sys.path``."""
    missing = [p for p in paths if p not in sys.path and os.path.isdir(p)]
    sys.path[:0] = missing
