"""Why what a warm-up or a capture saw cannot become a recording, in the words a user reads in
``graphtree.stats().eager`` and the eager-run warning: the state a call read or set that a
graph would freeze, outputs a graph cannot hand back, torch refusing an operation because a
capture is under way, and torch.compile tracing inside a capture (which warms up again rather
than giving the call up).

Example::

    reason = unsafe_reason("step", watch)   # None: nothing under ``watch`` stops a recording
"""

from __future__ import annotations

from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.readable import tensor_kind

COMPILED_IN_CAPTURE = (
    "torch.compile traced code of `{name}` during its recording (a compiled part's guards failed, or it "
    "ran for the first time): the recording is dropped and the signature warms up again, or, the third "
    "time, runs eagerly from then on"
)

CAPTURE_ONLY = ("during cuda graph capture", "during stream capture", "when stream is capturing")


def refused_in_capture(error: BaseException | None) -> bool:
    """Whether ``error`` is torch refusing an operation because a capture is under way (a copy from
    unpinned host memory, say), which the same call run eagerly does not meet."""
    if not isinstance(error, RuntimeError):
        return False
    first = (str(error).strip().splitlines() or [""])[0].lower()
    return any(s in first for s in CAPTURE_ONLY)


def unsafe_reason(name: str, watch: _torch.StateWatch, compiled: bool = False) -> str | None:
    """Why what the call did under ``watch`` cannot be recorded, or None (a generator's state read or
    set while dynamo ``compiled`` is the compiler's, not the function's)."""
    if watch.generator_state and not compiled:
        return (
            f"`{name}` calls {watch.generator_state} (torch.utils.checkpoint's preserve_rng_state, "
            f"fork_rng and manual_seed do): a recording draws from a generator of its own, and cannot "
            f"read or set the CUDA generator's state where eager does"
        )
    if watch.unsafe:
        return (
            f"`{name}` calls {watch.unsafe}, tagged torch.Tag.cudagraph_unsafe (it reads state on the host "
            f"that a recording would freeze)"
        )
    if watch.unlike_eager:
        return f"`{name}` calls {watch.unlike_eager}"
    if watch.strided:
        return (
            f"`{name}` calls {watch.strided} with a storage offset of its own or reaching past the input's "
            f"elements: a recording copies the input into a tensor that holds those elements only"
        )
    if watch.host_read >= 0:
        return (
            f"`{name}` reads its 0-dim CPU tensor input {watch.host_read} on the host (.item(), or an operator "
            f"that takes it as a host value, such as torch.tensor_split's indices): a recording gives it a "
            f"CUDA tensor filled with the value on each call"
        )
    return None


def output_reason(out: Any) -> str | None:
    """Why the outputs cannot come out of a graph (a sparse, nested, meta or subclass tensor), or None."""
    outs, _ = _torch.tree_flatten(out)
    for i, t in enumerate(outs):
        if isinstance(t, torch.Tensor):
            kind = tensor_kind(t)
            if kind is not None:
                return f"output {i} is {kind}: graphtree graphs dense CUDA tensors"
            if t.grad_fn is not None:  # a replay would hand it back without its autograd history
                return (
                    f"autograd: output {i} requires grad (the function builds an autograd graph, which a "
                    f"replay cannot hand back; a training step returns loss.detach())"
                )
    return None


KEPT_REASON = (
    "`{name}` keeps {n} tensor(s) it allocates beyond its outputs (a cache filled on first use?): "
    "a graph's memory is reused by later recordings, so such state cannot be recorded"
)


def mutation_reason(written: list[int]) -> str:
    """Why a capture that wrote into its inputs ``written`` in place is not recorded."""
    which = ", ".join(str(i) for i in sorted(written))
    return f"mutates its input {which} in place (mark it with graphtree.mark_static to graph it)"
