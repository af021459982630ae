"""Hugging Face static caches allocated before a graphed forward, not inside it: the prefill is graphed too.

transformers' ``StaticCache`` allocates its tensors lazily, in its first ``update`` — inside the
prefill's forward (``lazy_initialization``: two ``torch.zeros`` per layer and an upload of its
length). State a call allocates and keeps cannot live in a recording (the pool is reused by the
next call), so with ``generate()``'s default, a new cache per call, every prefill ran eagerly.
Hugging Face's answer for compiled prefills is ``Cache.early_initialization(...)``, which
allocates every layer before the call; graphtree does it for a graphed forward:

- it learns each layer's layout (batch, heads, head dim, dtype, device) from a cache of a kind it
  met empty, once its prefill has filled it (at the next call: the first decode step), keyed by
  the cache's class, its number of layers and their lengths, the call's batch, the model's dtype
  and device, and autocast (a batch of 4 after one of 1 is learned too);
- a later cache of that kind met with *no* layer initialized, for a call of the same batch, is
  initialized the same way before the call is read: the prefill then reads an initialized cache,
  is recorded once and replayed after, each new cache moving into the recording's memory
  (:mod:`graphtree.tree.adoption`).

- a cache met with no layer initialized, of a kind not learned yet (the first ``generate()``, or a
  ``StaticCache`` the user keeps and resets between ``generate()`` calls), is initialized as
  transformers' ``generate()`` does for a compiled prefill: heads and head dim from the model's
  ``_get_static_cache_init_shape()``, its dtype and device — where that is what the lazy
  initialization would give (no autocast, one floating dtype for every parameter). A kept cache's
  first prefill then warms up the signature every later prefill has (an initialized cache), so it
  is recorded in the second ``generate()``, not the third, and nothing records after (issue 45).

What it cannot vouch for it leaves alone: layers that do not support early initialization or are
not static (a ``DynamicCache``), keys and values of different head dims, layers of different
lengths than learned, a cache partly initialized, a batch not yet learned, a model cast or moved
since, other autocast settings. The call then runs as before (its prefill eagerly, with the reason).

Sliding-window layers (``StaticSlidingWindowLayer``, Mistral's and every model's with
``sliding_window``) also count their length in a Python int, ``cumulative_length_int``. It is part
of the call's key (a plain value inside an argument; a replay writes it back), so every decode
step was a new signature: one recording per position, each paid in the first ``generate()``s.
Its uses, read in transformers 5.17 (``cache_utils.py``, ``masking_utils.py``): while the call's
tokens still fit in the window (``length + tokens <= max_cache_len``), ``update`` and
``get_mask_sizes`` take the same branches and give the same results for every length in that range;
only ``get_seq_length`` hands it on, as the query offset of the attention mask and as the position
of a call made without ``position_ids``. So, for such a call, :meth:`CacheLayouts.before_call`
moves each layer's int to 0 for the call and makes its ``get_seq_length`` return the layer's
device twin, ``cumulative_length`` (what the full-attention ``StaticLayer`` returns, equal to the
int while the window is not full; HF keeps the two in step) — through a flag on the layer
(:data:`MOVED`), so that code dynamo traces inside the call reads it too; :meth:`MovedLengths.restore`
adds the length back after the call. The decode steps then share one key and one recording. A
call past the window's end (a full or filling window: there the int decides the branch and the
mask's offset) is keyed by its length, as before. Only the transformers versions whose code was
read (:data:`READ_IN`) are moved: on another, the int stays in the key (one recording per
position, slower, never wrong).

Example::

    layouts = CacheLayouts(model)
    moved_lengths = layouts.before_call(kwargs)  # in CacheLayouts.run, for a transformers model's forward
    try:
        out = run(kwargs)
    finally:
        if moved_lengths is not None:
            moved_lengths.restore()
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

log = logging.getLogger("graphtree")


class _Layout(NamedTuple):
    batch: int
    heads: list[int]
    head_dims: list[int]
    lengths: list[Any]
    dtype: torch.dtype
    device: torch.device


class CacheLayouts:
    """The layouts of the caches a graphed transformers forward has seen filled, by kind.

    A kind is the cache's class, its number of layers, its first layer's length and the call's
    batch, with what decides the dtype of the keys a layer stores: the model's parameters' dtype and
    device (a model moved or cast since) and autocast. A layout is learned from a cache met empty, at the call
    after the one that filled it (its prefill); decode steps cost one attribute test.
    """

    __slots__ = ("_hinted", "_known", "_model", "_pending")

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        self._known: dict[tuple[Any, ...], _Layout | None] = {}  # None: seen, cannot be vouched for
        self._model = model
        self._pending: tuple[Any, tuple[Any, ...]] | None = None  # (weak ref to a cache met empty, its kind)
        self._hinted = False  # the DynamicCache hint, logged once

    def eager_reason(self, kwargs: dict[str, Any]) -> str | None:
        """Why a call runs eagerly outright: its cache is a ``DynamicCache``, which grows by a token
        every call (a new signature each time: warm-ups that never lead to a replay, measured 2.8x
        eager on an H100 with parts, before this check). Logs the hint once."""
        if not _grows(kwargs.get("past_key_values")):
            return None
        if not self._hinted:
            self._hinted = True
            name = type(self._model).__name__ if self._model is not None else "the model"
            log.warning("graphtree: %s is called with a DynamicCache (%s)", name, GROWS)
        return GROWS

    def run(
        self,
        run: Callable[[tuple[Any, ...], dict[str, Any]], Any],
        eager: Callable[[tuple[Any, ...], dict[str, Any], str], Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call of the graphed forward: ``eager(args, kwargs, reason)`` where its cache grows
        (:meth:`eager_reason`), else ``run(args, kwargs)`` with the cache made ready and its
        sliding-window lengths moved for the call (:meth:`before_call`), put back after it."""
        grows = self.eager_reason(kwargs)
        if grows is not None:
            return eager(args, kwargs, grows)
        moved_lengths = self.before_call(kwargs)
        if moved_lengths is None:
            return run(args, kwargs)
        try:
            return run(args, kwargs)
        finally:
            moved_lengths.restore()

    def before_call(self, kwargs: dict[str, Any]) -> MovedLengths | None:
        """Learn the layout of ``kwargs["past_key_values"]``, or initialize it early if it is a fresh
        cache of a kind already learned; move its sliding-window lengths for the call (see the
        module docstring): the caller must then call ``restore()`` on what is returned once the
        call is over, raised or not. Cheap when there is nothing to do."""
        cache: Any = kwargs.get("past_key_values")
        layers = getattr(cache, "layers", None)
        if not layers or not hasattr(cache, "early_initialization"):
            return None
        first = layers[0]
        if getattr(first, "is_initialized", False):
            pending = self._pending
            if pending is not None:
                self._pending = None
                if pending[0]() is cache:  # the cache met empty, filled by the call before
                    self._known.setdefault(pending[1], _learn(layers))
            return _move_lengths(layers, kwargs)
        batch = _input_size(kwargs, 0)
        kind = (type(cache), len(layers), getattr(first, "max_cache_len", None), batch, *self._computes_in())
        layout = self._known.get(kind)
        if layout is None:
            if self._initialize_from_config(cache, layers, batch):
                return _move_lengths(layers, kwargs)
            try:
                self._pending = (weakref.ref(cache), kind) if kind not in self._known else None
            except TypeError:  # no weak references to it: nothing learned
                self._pending = None
            return None
        if batch != layout.batch:
            return None  # (a layout learned from another call of this kind: not vouched for)
        if any(getattr(lay, "is_initialized", True) for lay in layers):
            return None  # partly initialized: not ours to complete
        if [getattr(lay, "max_cache_len", None) for lay in layers] != layout.lengths:
            return None
        cache.early_initialization(layout.batch, layout.heads, layout.head_dims, layout.dtype, layout.device)
        return _move_lengths(layers, kwargs)

    def _initialize_from_config(self, cache: Any, layers: list[Any], batch: int | None) -> bool:
        """Initialize a cache met with no layer initialized and of no kind learned yet as transformers'
        ``generate()`` does for a compiled prefill: heads and head dim from the model's
        ``_get_static_cache_init_shape()``, the model's dtype and device. Only where that is what its
        lazy initialization would give: no autocast, one floating dtype for every parameter, a
        known batch. The first prefill with a cache kept across ``generate()`` calls then warms up
        the signature every later one has (an initialized cache), instead of one of its own."""
        model = self._model
        shape_of = getattr(model, "_get_static_cache_init_shape", None)
        if model is None or shape_of is None or batch is None or torch.is_autocast_enabled("cuda"):
            return False
        if any(getattr(lay, "is_initialized", True) for lay in layers):
            return False
        dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
        shape = shape_of()
        if shape is None or len(dtypes) != 1:
            return False
        device = next(model.parameters()).device
        cache.early_initialization(batch, shape[0], shape[1], dtypes.pop(), device)
        return True

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


class MovedLengths:
    """Sliding-window layers whose Python length was moved to 0 for one call; :meth:`restore` after it."""

    __slots__ = ("_layers",)

    def __init__(self, layers: list[tuple[Any, int]]) -> None:
        self._layers = layers  # (layer, its length before the call)

    def restore(self) -> None:
        """Add each layer's length before the call back (what the call added stays), and end the
        tensor ``get_seq_length``."""
        for lay, length in self._layers:
            delattr(lay, MOVED)
            lay.cumulative_length_int += length


MOVED = "_graphtree_length_moved"
"""Set (True) on a layer for the call its length is moved for: its ``get_seq_length`` returns the
device length then, in eager code and in code dynamo traces alike (a model compiled inside the
graphed call), and a graphed call nested in that one leaves the layer as the outer call set it."""

READ_IN = ((5, 17),)
"""transformers versions (major, minor) whose sliding-window layer was read for the move (every use
of its length; see the module docstring). Another version keeps the length in the key."""

_install_lock = threading.Lock()
_installed: list[Any] = []  # the class patched, once


def _move_lengths(layers: list[Any], kwargs: dict[str, Any]) -> MovedLengths | None:
    """Move to 0 the Python length of each ``StaticSlidingWindowLayer`` the call's tokens still fit in
    (see the module docstring); ``None`` when there is none. A cache mixing such layers with others
    is moved only where it is safe: a layer past its window keeps its length (and so its key)."""
    cu = sys.modules.get("transformers.cache_utils")
    cls = getattr(cu, "StaticSlidingWindowLayer", None)
    if cls is None or not _read_version():
        return None
    tokens = _input_size(kwargs, 1)
    moved: list[tuple[Any, int]] = []
    for lay in layers:
        if type(lay) is not cls or not lay.is_initialized or getattr(lay, MOVED, False):
            continue
        length, twin = lay.cumulative_length_int, getattr(lay, "cumulative_length", None)
        if type(length) is not int or not isinstance(twin, torch.Tensor) or twin.device != lay.keys.device:
            continue
        if tokens is None or tokens < 1 or length + tokens > lay.max_cache_len:
            continue  # past the window's end the int decides the branch and the mask's offset
        moved.append((lay, length))
    if not moved:
        return None
    if not _installed:
        _install(cls)
    for lay, _ in moved:
        lay.cumulative_length_int = 0
        setattr(lay, MOVED, True)
    return MovedLengths(moved)


def _install(cls: Any) -> None:
    """Make ``cls.get_seq_length`` return the device length for the layers moved for a call."""
    with _install_lock:
        if _installed:
            return
        original = cls.get_seq_length

        def get_seq_length(self: Any) -> Any:
            if getattr(self, MOVED, False):
                return self.cumulative_length  # (graphtree.tree.hf_cache: the length, on the device)
            return original(self)

        get_seq_length.__doc__ = original.__doc__
        get_seq_length.__wrapped__ = original  # type: ignore[attr-defined]
        cls.get_seq_length = get_seq_length
        _installed.append(cls)


def _read_version() -> bool:
    """Whether the transformers in use is one of :data:`READ_IN`."""
    return _is_read(getattr(sys.modules.get("transformers"), "__version__", ""))


@functools.cache
def _is_read(version: str) -> bool:  # (parsed once per version string, not on every decode step)
    parts = version.split(".")
    try:
        return (int(parts[0]), int(parts[1])) in READ_IN
    except (IndexError, ValueError):
        return False


GROWS = (
    "a DynamicCache, what generate() uses when no cache_implementation is given: it grows by a token "
    "every step, a new shape on every call, which no CUDA graph can replay, so graphtree runs those steps "
    'eagerly. Pass cache_implementation="static" to generate() (or past_key_values=StaticCache(...)) to graph them'
)


def _grows(cache: Any) -> bool:
    """Whether ``cache`` is a transformers ``DynamicCache`` (keys and values grown by concatenation)."""
    cu = sys.modules.get("transformers.cache_utils")
    dynamic = getattr(cu, "DynamicCache", None)
    return dynamic is not None and isinstance(cache, dynamic)


def _input_size(kwargs: dict[str, Any], dim: int) -> int | None:
    """Size ``dim`` of the call's ``input_ids`` (else ``inputs_embeds``): 0 the batch, 1 the tokens."""
    for name in ("input_ids", "inputs_embeds"):
        x = kwargs.get(name)
        if isinstance(x, torch.Tensor) and x.dim() > dim:
            return int(x.shape[dim])
    return None
