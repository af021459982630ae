"""What :func:`graphtree.graphed` returns for an ``nn.Module``: the module itself, its calls made
through a ``GraphedCallable`` (``graphtree/tree/graphed.py``), its state shared with the original.

Example::

    model = graphtree.graphed(MyModel().cuda().eval())     # a GraphedModule
    ema = copy.deepcopy(model)                              # graphed anew, over a copy of the model
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtree import _native, _torch
from graphtree.tree import fast_hit as _fast_hit
from graphtree.tree.callee import UserCode, user_code

_is_dynamo_compiling = torch.compiler.is_dynamo_compiling
_GLOBAL_HOOKS = _torch.GLOBAL_MODULE_HOOKS
_jit_tracing = _torch.jit_tracing


class GraphedModule(torch.nn.Module):
    """What :func:`graphed` returns for an ``nn.Module``: the same module, its calls recorded
    and replayed as CUDA graphs.

    It shares the wrapped module's parameters, buffers and submodules (the very same objects,
    so ``state_dict()`` has the same keys and ``load_state_dict`` loads into the original);
    ``.to()``, ``.eval()``, ``.train()`` act on the original too; attributes it does not have
    itself are read from and written to the original. Moving the module to another device or
    dtype moves its parameters' memory: the next call records again (a replay checks every
    address it reads in place). The original's own methods (``model.generate``) still call the
    original's ``forward``; graph that with ``model.forward = graphtree.graphed(model.forward)``.

    Example::

        model = graphtree.graphed(MyModel().cuda().eval())
        model.load_state_dict(torch.load("weights.pt"))
        with torch.inference_mode():
            y = model(x)
    """

    def __init__(self, module: torch.nn.Module, call: Any) -> None:
        super().__init__()
        for name in _SHARED:
            object.__setattr__(self, name, getattr(module, name))
        object.__setattr__(self, "_graphtree_module", module)
        object.__setattr__(self, "__wrapped__", module)  # inspect.unwrap and signature see the original
        object.__setattr__(self, "_graphtree_call", call)
        object.__setattr__(self, "training", module.training)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ reaches forward through two frames more (_wrapped_call_impl, _call_impl),
        # about a microsecond of a replay. Where it would only call forward, graphtree's call is made
        # from here: _call (_plain_call, or its native twin) answers HOOKED where it would do more.
        # torch.compile's trace goes through nn.Module.__call__, as for any module. Once the helpers
        # have loaded, the class's call is these same steps in C (graphtree/_native/entries.cpp:
        # module_type_call), and this function is what Python reads: a trace, a subclass.
        if not _is_dynamo_compiling():
            out = _call(self, args, kwargs)
            if out is not HOOKED:
                return out
        return torch.nn.Module.__call__(self, *args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._graphtree_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_graphtree_module")
            if module is None:
                raise
            return getattr(module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        module = self.__dict__.get("_graphtree_module")
        if module is None or name == "training":
            super().__setattr__(name, value)
        else:
            setattr(module, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._graphtree_module, name)

    # Containers (nn.Sequential, nn.ModuleList, ...): indexing, length and iteration are the original's.
    def __getitem__(self, index: Any) -> Any:
        return self._graphtree_module[index]

    def __len__(self) -> int:
        return len(self._graphtree_module)

    def __iter__(self) -> Any:
        return iter(self._graphtree_module)

    def train(self, mode: bool = True) -> GraphedModule:
        self._graphtree_module.train(mode)
        object.__setattr__(self, "training", mode)
        return self

    def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._graphtree_module._save_to_state_dict(*args, **kwargs)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        self._graphtree_module._load_from_state_dict(*args, **kwargs)

    def warm_up(self, *example_args: Any, sizes: Sequence[int] | None = None, **example_kwargs: Any) -> None:
        """See :meth:`GraphedCallable.warm_up`."""
        self._graphtree_call.warm_up(*example_args, sizes=sizes, **example_kwargs)

    @property
    def graphed_callable(self) -> Any:
        """The graphed call behind this module (a ``GraphedCallable``: its name, buckets and options)."""
        return self._graphtree_call

    def __repr__(self) -> str:
        return f"graphed({self._graphtree_module!r})"

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        """A copy (``copy.deepcopy`` for EMA weights or a snapshot, ``torch.save(model)``) is the copied
        module graphed anew with the same options: its own parameters, no recording shared."""
        call = self._graphtree_call
        return (_graphed_again, (self._graphtree_module, type(call), call.copy_options()))


# The state a GraphedModule shares with the module it wraps: the same dicts, not copies.
_SHARED = (
    "_parameters",
    "_buffers",
    "_non_persistent_buffers_set",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


HOOKED = object()
"""What :data:`_call` answers where ``nn.Module.__call__`` must make the call: it would do more than
call ``forward``."""


def _plain_call(gm: GraphedModule, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A graphed module's call where ``nn.Module.__call__`` would only call ``forward`` (no hook on
    it nor a global one, as ``nn.Module._call_impl`` asks; not compiled by ``m.compile()``; no
    ``torch.jit`` trace under way), else :data:`HOOKED`. A call of positional arguments whose
    signature replayed last time goes to its fast hit from here, and on a miss to the Python path
    with no second try (``GraphedCallable.__call__`` makes the same call after the same checks):
    one Python frame of graphtree's between the caller and the replay. Once the helpers have
    loaded, their ``module_entry`` makes :data:`_call` this function in C (for the helpers loaded
    now: it calls this function again once others are)."""
    global _call, _made_by
    native = _native.loaded
    make = getattr(native, "module_entry", None)
    if make is not None and _made_by is not native:
        _call = make(_native, native, _plain_call, HOOKED, _GLOBAL_HOOKS, user_code, _fast_hit, _fast_hit.MISS)
        _made_by = native
        install = getattr(native, "module_type_call", None)
        if install is not None:  # (GraphedModule's call made in C: GraphedModule.__call__ without its frame)
            install(GraphedModule, _call, torch.nn.Module, HOOKED)
    if (
        gm._forward_hooks
        or gm._forward_pre_hooks
        or gm._backward_hooks
        or gm._backward_pre_hooks
        or gm._compiled_call_impl is not None
        or any(_GLOBAL_HOOKS)
        or _jit_tracing()
    ):
        return HOOKED
    call = gm._graphtree_call
    hits = call.fast_hits
    if hits and not kwargs and not (UserCode.threads and user_code.active):
        out = _fast_hit.entry(call, hits, args)
        if out is not _fast_hit.MISS:
            return out
        return call.past_fast_hit(args, kwargs)
    return call(*args, **kwargs)


_call: Callable[[GraphedModule, tuple[Any, ...], dict[str, Any]], Any] = _plain_call
"""What ``GraphedModule.__call__`` calls: :func:`_plain_call`, or once the helpers have loaded its
native twin (``graphtree/_native/entries.cpp``: ``module_call``)."""
_made_by: Any = None  # (the helpers whose module_entry made _call)


def _graphed_again(module: torch.nn.Module, call_type: Any, options: dict[str, Any]) -> GraphedModule:
    """What a copy of a graphed module is rebuilt with (see ``GraphedModule.__reduce_ex__``)."""
    return GraphedModule(module, call_type(module, **options))
