"""Hugging Face static caches allocated before a graphed forward, not inside it: the prefill is graphed too.

transformers' ``StaticCache`` allocates its tensors lazily, in its first ``update`` — inside the
prefill's forward (``lazy_initialization``: two ``torch.zeros`` per layer and an upload of its
length). State a call allocates and keeps cannot live in a recording (the pool is reused by the
next call), so with ``generate()``'s default, a new cache per call, every prefill ran eagerly.
Hugging Face's answer for compiled prefills is ``Cache.early_initialization(...)``, which
allocates every layer before the call; graphtree does it for a graphed forward:

- it learns each layer's layout (batch, heads, head dim, dtype, device) from a cache of a kind it
  met empty, once its prefill has filled it (at the next call: the first decode step), keyed by
  the cache's class, its number of layers and their lengths, the model's dtype and device, and
  autocast;
- a later cache of that kind met with *no* layer initialized, for a call of the same batch, is
  initialized the same way before the call is read: the prefill then reads an initialized cache,
  is recorded once and replayed after, each new cache moving into the recording's memory
  (:mod:`graphtree.tree.adoption`).

What it cannot vouch for it leaves alone: layers that do not support early initialization or are
not static (a ``DynamicCache``), keys and values of different head dims, layers of different
lengths than learned, a cache partly initialized, another batch, a model cast or moved since, other
autocast settings. The call then runs as before (its prefill eagerly, with the reason).

Example::

    layouts = CacheLayouts(model)
    layouts.before_call(kwargs)      # in graphed.__call__, for a transformers model's forward
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch


class _Layout(NamedTuple):
    batch: int
    heads: list[int]
    head_dims: list[int]
    lengths: list[Any]
    dtype: torch.dtype
    device: torch.device


class CacheLayouts:
    """The layouts of the caches a graphed transformers forward has seen filled, by kind.

    A kind is the cache's class, its number of layers and its first layer's length, with what
    decides the dtype of the keys a layer stores: the model's parameters' dtype and device (a model
    moved or cast since) and autocast. A layout is learned from a cache met empty, at the call
    after the one that filled it (its prefill); decode steps cost one attribute test.
    """

    __slots__ = ("_known", "_model", "_pending")

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._known: dict[tuple[Any, ...], _Layout | None] = {}  # None: seen, cannot be vouched for
        self._model = model
        self._pending: tuple[Any, tuple[Any, ...]] | None = None  # (weak ref to a cache met empty, its kind)

    def before_call(self, kwargs: dict[str, Any]) -> None:
        """Learn the layout of ``kwargs["past_key_values"]``, or initialize it early if it is a fresh
        cache of a kind already learned (see the module docstring). Cheap when there is nothing to do."""
        cache: Any = kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        if not layers or not hasattr(cache, "early_initialization"):
            return
        first = layers[0]
        if getattr(first, "is_initialized", False):
            pending = self._pending
            if pending is not None:
                self._pending = None
                if pending[0]() is cache:  # the cache met empty, filled by the call before
                    self._known.setdefault(pending[1], _learn(layers))
            return
        kind = (type(cache), len(layers), getattr(first, "max_cache_len", None), *self._computes_in())
        layout = self._known.get(kind)
        if layout is None:
            try:
                self._pending = (weakref.ref(cache), kind) if kind not in self._known else None
            except TypeError:  # no weak references to it: nothing learned
                self._pending = None
            return
        if _batch(kwargs) != layout.batch:
            return
        if any(getattr(lay, "is_initialized", True) for lay in layers):
            return  # partly initialized: not ours to complete
        if [getattr(lay, "max_cache_len", None) for lay in layers] != layout.lengths:
            return
        cache.early_initialization(layout.batch, layout.heads, layout.head_dims, layout.dtype, layout.device)

    def _computes_in(self) -> tuple[Any, ...]:
        p = next(self._model.parameters(), None) if self._model is not None else None
        where = (p.dtype, p.device) if p is not None else (None, None)
        return (*where, torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def _learn(layers: list[Any]) -> _Layout | None:
    heads: list[int] = []
    dims: list[int] = []
    lengths: list[Any] = []
    keys0 = getattr(layers[0], "keys", None)
    if not isinstance(keys0, torch.Tensor) or keys0.dim() != 4:
        return None
    for lay in layers:
        k, v = getattr(lay, "keys", None), getattr(lay, "values", None)
        if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
            return None
        if not getattr(lay, "supports_early_init", False):
            return None
        if k.dim() != 4 or v.shape[:2] != k.shape[:2] or v.shape[-1] != k.shape[-1] or k.dtype != keys0.dtype:
            return None  # early_initialization gives keys and values one head dim and one dtype
        if k.shape[0] != keys0.shape[0] or k.device != keys0.device:
            return None
        length = getattr(lay, "max_cache_len", None)
        if not isinstance(length, int) or k.shape[2] != length:
            return None  # not a static layer (a dynamic one grows by concatenation: nothing to allocate early)
        heads.append(int(k.shape[1]))
        dims.append(int(k.shape[-1]))
        lengths.append(length)
    return _Layout(int(keys0.shape[0]), heads, dims, lengths, keys0.dtype, keys0.device)


def _batch(kwargs: dict[str, Any]) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    return None
