"""Hugging Face static caches allocated before a graphed forward, not inside it: the prefill is graphed too.

transformers' ``StaticCache`` allocates its tensors lazily, in its first ``update`` — inside the
prefill's forward (``lazy_initialization``: two ``torch.zeros`` per layer and an upload of its
length). State a call allocates and keeps cannot live in a recording (the pool is reused by the
next call), so with ``generate()``'s default, a new cache per call, every prefill ran eagerly.
Hugging Face's answer for compiled prefills is ``Cache.early_initialization(...)``, which
allocates every layer before the call; graphtree does it for a graphed forward:

- it learns each layer's layout (batch, heads, head dim, dtype, device) from the first cache of a
  kind it meets initialized (the first decode step), keyed by the cache's class, its number of
  layers and their lengths;
- a later cache of that kind met with *no* layer initialized, for a call of the same batch, is
  initialized the same way before the call is read: the prefill then reads an initialized cache,
  is recorded once and replayed after, each new cache moving into the recording's memory
  (:mod:`graphtree.tree.adoption`).

What it cannot vouch for it leaves alone: layers that do not support early initialization, keys
and values of different head dims, layers of different lengths than learned, a cache partly
initialized, another batch. The call then runs as before (eagerly, with the reason).

Example::

    layouts = CacheLayouts()
    layouts.before_call(kwargs)      # in graphed.__call__, for a transformers model's forward
"""

from __future__ import annotations

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
    """The layouts of the caches a graphed transformers forward has met initialized, by kind."""

    __slots__ = ("_known",)

    def __init__(self) -> None:
        self._known: dict[tuple[type, int, Any], _Layout | None] = {}  # None: met, cannot be vouched for

    def before_call(self, kwargs: dict[str, Any]) -> None:
        """Learn the layout of ``kwargs["past_key_values"]``, or initialize it early if it is a fresh
        cache of a kind already learned (see the module docstring). Cheap when there is nothing to do."""
        cache: Any = kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        if not layers or not hasattr(cache, "early_initialization"):
            return
        first = layers[0]
        kind = (type(cache), len(layers), getattr(first, "max_cache_len", None))
        if getattr(first, "is_initialized", False):
            if kind not in self._known:
                self._known[kind] = _learn(layers)
            return
        layout = self._known.get(kind)
        if layout is None or _batch(kwargs) != layout.batch:
            return
        if any(getattr(lay, "is_initialized", True) for lay in layers):
            return  # partly initialized: not ours to complete
        if [getattr(lay, "max_cache_len", None) for lay in layers] != layout.lengths:
            return
        cache.early_initialization(layout.batch, layout.heads, layout.head_dims, layout.dtype, layout.device)


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
        heads.append(int(k.shape[1]))
        dims.append(int(k.shape[-1]))
        lengths.append(getattr(lay, "max_cache_len", None))
    return _Layout(int(keys0.shape[0]), heads, dims, lengths, keys0.dtype, keys0.device)


def _batch(kwargs: dict[str, Any]) -> int | None:
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.dim() >= 1:
            return int(x.shape[0])
    return None
