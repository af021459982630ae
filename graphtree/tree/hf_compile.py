"""Hugging Face's compiled decode step inside graphtree's graphs (issue 46, item 1; its GPU tests, Llama
and GPT-2, passed on the H100; timed against HF's default by ``graphtree bench --scenarios generate``).

``generate()`` compiles the decode step through ``model.get_compiled_call(compile_config)``, which
compiles ``model.__call__``. With graphtree's wrapper as ``model.forward``, dynamo stops at the
wrapper, and the forward runs uncompiled: HF's compile on a graphed model compiled nothing. For a
model whose ``forward`` is graphed, ``get_compiled_call`` (wrapped once per class, :func:`install`)
hands out its :class:`CompiledTwins` instead:

- the same config with inductor's CUDA graphs off (``reduce-overhead`` is ``default`` plus them;
  ``max-autotune`` pairs with ``max-autotune-no-cudagraphs``), so that one graph system holds the
  step;
- the model's own forward compiled with it;
- that compiled forward graphed as the model's forward is, one per config.

``_compiled_call`` and ``_last_compile_config`` are set as HF sets them. Any other model gets HF's
own. The prefill still runs the graphed eager forward (HF never compiles it), and
``disable_compile=True`` never reaches this, so it keeps today's path. Nothing is stored on the
model but what HF stores: ``copy.deepcopy`` and ``torch.save`` of it are unchanged.

Example::

    install(model)                          # its class's get_compiled_call, wrapped once
    model.forward = graphtree.graphed(model.forward)
    model.generate(..., disable_compile=False)   # the decode step: compiled, then graphed
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CompiledTwins", "install", "without_cudagraphs"]

_NO_CUDAGRAPHS = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}


def without_cudagraphs(config: Any) -> Any:
    """A copy of HF's ``CompileConfig`` with inductor's CUDA graphs turned off, all else kept
    (``_compile_all_devices``, a class attribute ``dataclasses.replace`` would drop, included)."""
    out = copy.copy(config)
    out.mode = _NO_CUDAGRAPHS.get(config.mode, config.mode)
    options = getattr(config, "options", None)
    if options and options.get("triton.cudagraphs"):
        out.options = {**options, "triton.cudagraphs": False}
    return out


class CompiledTwins:
    """A graphed forward's compiled twins: ``forward`` compiled without inductor's CUDA graphs and
    graphed (``make(compiled)``), one per compile config (an unchanged config compiles nothing again)."""

    def __init__(self, forward: Callable[..., Any], make: Callable[[Callable[..., Any]], Any]) -> None:
        self._forward = forward
        self._make = make
        self._made: dict[str, Any] = {}
        self.configs: list[Any] = []  # the configs compiled with, in order

    def __call__(self, model: Any, compile_config: Any = None) -> Any:
        config = compile_config or model._default_compile_config()
        mapped = without_cudagraphs(config)
        key = repr(sorted(mapped.to_dict().items()))
        graphed = self._made.get(key)
        if graphed is None:
            compiled = torch.compile(self._forward, **mapped.to_dict())
            graphed = self._made[key] = self._make(compiled)
            self.configs.append(mapped)
        model._compiled_call = graphed
        model._last_compile_config = config
        return graphed


def install(model: torch.nn.Module) -> None:
    """Wrap ``get_compiled_call`` of the class that defines it for ``model`` (once per class): a model
    whose instance ``forward`` has compiled twins (a graphed forward) gets them, any other HF's own."""
    for klass in type(model).__mro__:
        original = klass.__dict__.get("get_compiled_call")
        if original is None:
            continue
        if getattr(original, "_graphtree_wrapped", False):
            return

        @functools.wraps(original)
        def get_compiled_call(self: Any, compile_config: Any = None, _original: Any = original) -> Any:
            twins = getattr(self.__dict__.get("forward"), "compiled_twins", None)
            if twins is None:
                return _original(self, compile_config)
            return twins(self, compile_config)

        get_compiled_call._graphtree_wrapped = True  # type: ignore[attr-defined]
        setattr(klass, "get_compiled_call", get_compiled_call)  # noqa: B010 - (a class attribute, by name)
        return
