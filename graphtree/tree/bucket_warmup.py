"""Recording every bucket of a graphed callable ahead of its loop (``GraphedCallable.warm_up``):
example inputs resized along the bucket dimension, largest size first, so that the smaller
recordings reuse the largest one's memory in the pool.

Example::

    step = graphtree.graphed(model, buckets=[1, 2, 4, 8, 16])
    record_buckets(step, (example_batch,), {}, None)   # what step.warm_up(example_batch) does
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from graphtree.tree import manager as _manager
from graphtree.tree.inputs import Bucketing, flatten, unflatten


class Bucketed(Protocol):
    """A graphed callable with buckets (``GraphedCallable``)."""

    bucketing: Bucketing | None

    @property
    def warmup(self) -> int: ...  # eager runs before a new signature is recorded
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def record_buckets(
    gc: Bucketed, example_args: tuple[Any, ...], example_kwargs: dict[str, Any], sizes: Sequence[int] | None
) -> None:
    """Warm up and record ``gc`` for each of ``sizes`` (default: all its buckets), largest first,
    each in a step of its own. The example's tensors whose bucket dimension has the first such
    tensor's length are resized by repeating their rows; other arguments are passed as given."""
    if gc.bucketing is None:
        raise ValueError("warm_up(sizes) needs graphed(..., buckets=[...])")
    if sizes is not None:
        bad = [s for s in sizes if s not in gc.bucketing.sizes] if isinstance(sizes, (list, tuple)) else sizes
        if bad or not sizes:
            raise ValueError(
                f"warm_up(sizes=...) takes a non-empty list of bucket sizes {gc.bucketing.sizes}, got {sizes!r}"
            )
    ordered = sorted(set(sizes or gc.bucketing.sizes), reverse=True)
    dim = gc.bucketing.dim
    leaves, spec = flatten(example_args, example_kwargs)
    ref = next((x for x in leaves if isinstance(x, torch.Tensor) and x.dim() > dim), None)
    if ref is None:
        raise ValueError(f"warm_up needs a tensor argument with a dimension {dim} to resize")
    n = ref.shape[dim]
    for size in ordered:
        idx = torch.arange(size, device=ref.device) % n
        resized = [
            x.index_select(dim, idx) if isinstance(x, torch.Tensor) and x.dim() > dim and x.shape[dim] == n else x
            for x in leaves
        ]
        args, kwargs = unflatten(resized, spec)
        for _ in range(gc.warmup + 1):
            _manager.begin_internal_step()
            gc(*args, **kwargs)
    _manager.begin_internal_step()
