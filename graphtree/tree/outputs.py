"""Outputs of a recording: rebuilding them on replay, and knowing which ones the caller holds.

Every replay hands out *new* tensor objects on the recording's output memory (storages that own
nothing), so an output from an earlier step is never silently the same object as a new one.
Outputs that share memory share one storage, as they did in eager mode. The tree keeps only
weak references to these storages: a storage nobody holds is *dead*, and its memory may be
reused by the next recording. When a new step starts, every output still held is
*invalidated*: reading it raises a ``RuntimeError`` that names the function, the output and
the fix, instead of returning values a later replay overwrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from graphtree import _torch

_POOL, _INPUT, _CONST, _DUP, _EMPTY = range(5)


def _meta(t: torch.Tensor) -> dict[str, Any]:
    return {
        "size": tuple(t.shape),
        "stride": t.stride(),
        "dtype": t.dtype,
        "device": t.device,
        "storage_offset": t.storage_offset(),
    }


def stale_message(fn_name: str, outputs: Sequence[int], where: str) -> str:
    """The error a caller sees when reading an output whose memory was reused."""
    which = "output " + ", ".join(str(i) for i in outputs)
    return (
        f"graphtree: {which} of `{fn_name}` ({where}) was overwritten: a new step began "
        f"(graphtree.mark_step(), or `{fn_name}` was called again, which starts one) and the "
        f"graph reuses that memory. Fix: keep it with `.clone()` before the next step, or call "
        f"graphtree.mark_step() once per iteration so that calls within an iteration keep "
        f"their outputs."
    )


@dataclass
class OutputPlan:
    """How to rebuild a recording's outputs from its memory on every replay."""

    spec: Any  # None: a single leaf; "tuple": a flat tuple; else a pytree spec
    kinds: list[tuple] = field(default_factory=list)
    groups: list[tuple[int, int]] = field(default_factory=list)  # (data_ptr, nbytes) per storage
    group_messages: list[str] = field(default_factory=list)
    slice_idx: list[int] = field(default_factory=list)  # leaves to cut back to the real batch
    pad_dim: int = 0
    single: tuple[int, int, dict[str, Any]] | None = None  # (ptr, nbytes, meta): one pool output

    def freeze(self) -> None:
        """Precompute the replay fast path: a single output tensor on a storage of its own."""
        if self.spec is None and len(self.kinds) == 1 and self.kinds[0][0] == _POOL:
            self.single = (self.groups[0][0], self.groups[0][1], self.kinds[0][2])

    @classmethod
    def from_recording(
        cls,
        out: Any,
        in_leaves: Sequence[Any],
        in_pool: Any,
        fn_name: str,
        bucket: int,
        pad_dim: int,
    ) -> tuple["OutputPlan", list[Any]]:
        """Describe ``out`` (the outputs of a capture) and return it flattened.

        ``in_leaves`` are the tensors the graph read (placeholders in place of copied inputs,
        the caller's tensors otherwise); ``in_pool(ptr)`` says whether an address is pool memory.
        """
        if isinstance(out, torch.Tensor):
            leaves, spec = [out], None
        elif type(out) is tuple and all(isinstance(x, torch.Tensor) for x in out):
            leaves, spec = list(out), "tuple"
        else:
            leaves, spec = _torch.tree_flatten(out)
        plan = cls(spec=spec, pad_dim=pad_dim)
        input_storage = {}
        for i, x in enumerate(in_leaves):
            if isinstance(x, torch.Tensor) and x.numel():
                input_storage.setdefault(x.untyped_storage().data_ptr(), i)
        group_of: dict[int, int] = {}
        group_outputs: list[list[int]] = []
        seen: dict[int, int] = {}
        for j, t in enumerate(leaves):
            if not isinstance(t, torch.Tensor):
                plan.kinds.append((_CONST, t))
                continue
            if id(t) in seen:
                plan.kinds.append((_DUP, seen[id(t)]))
                continue
            seen[id(t)] = j
            if bucket >= 0 and t.dim() > pad_dim and t.shape[pad_dim] == bucket:
                plan.slice_idx.append(j)
            ptr = t.untyped_storage().data_ptr()
            if t.untyped_storage().nbytes() == 0:
                plan.kinds.append((_EMPTY, _meta(t)))
            elif ptr in input_storage:
                plan.kinds.append((_INPUT, input_storage[ptr], tuple(t.shape), t.stride(), t.storage_offset()))
            elif in_pool(ptr):
                if ptr not in group_of:
                    group_of[ptr] = len(plan.groups)
                    plan.groups.append((ptr, t.untyped_storage().nbytes()))
                    group_outputs.append([])
                g = group_of[ptr]
                group_outputs[g].append(j)
                plan.kinds.append((_POOL, g, _meta(t)))
            else:  # memory the function holds elsewhere (a parameter, a global): same object
                plan.kinds.append((_CONST, t))
        for g, outs in enumerate(group_outputs):
            t = leaves[outs[0]]
            where = f"{t.dtype} {list(t.shape)}".replace("torch.", "")
            plan.group_messages.append(stale_message(fn_name, outs, where))
        return plan, leaves

    def adopt(self, leaves: list[Any], caller_leaves: Sequence[Any]) -> list[Any]:
        """Point outputs that alias an input at the caller's tensor, not at its placeholder."""
        leaves = list(leaves)
        for j, k in enumerate(self.kinds):
            if k[0] == _INPUT:
                leaves[j] = caller_leaves[k[1]].as_strided(k[2], k[3], k[4])
            elif k[0] == _DUP:
                leaves[j] = leaves[k[1]]
        return leaves

    def refs_of(self, leaves: Sequence[Any]) -> list[int]:
        """Weak references (see :func:`graphtree._torch.weak_ref`) to the pool outputs' storages."""
        refs: list[int] = [0] * len(self.groups)
        for j, k in enumerate(self.kinds):
            if k[0] == _POOL and not refs[k[1]]:
                refs[k[1]] = _torch.weak_ref(leaves[j].untyped_storage())
        return refs

    def rebuild(self, in_leaves: list[Any], device: torch.device) -> tuple[list[Any], list[int]]:
        """New output tensors on the recording's memory, and weak references to their storages."""
        storage_at, weak_ref = _torch.storage_at, _torch.weak_ref
        if self.single is not None:
            ptr, nbytes, meta = self.single
            st = storage_at(ptr, device, nbytes)
            return [_torch.tensor_on(meta, st)], [weak_ref(st)]
        storages = [storage_at(ptr, device, nbytes) for ptr, nbytes in self.groups]
        refs = [weak_ref(s) for s in storages]
        out: list[Any] = []
        for k in self.kinds:
            tag = k[0]
            if tag == _POOL:
                out.append(_torch.tensor_on(k[2], storages[k[1]]))
            elif tag == _INPUT:
                out.append(in_leaves[k[1]].as_strided(k[2], k[3], k[4]))
            elif tag == _CONST:
                out.append(k[1])
            elif tag == _DUP:
                out.append(out[k[1]])
            else:
                m = k[1]
                out.append(torch.empty_strided(m["size"], m["stride"], dtype=m["dtype"], device=m["device"]))
        return out, refs

    def finish(self, leaves: list[Any], n: int) -> Any:
        """Cut bucketed outputs back to the real batch ``n`` and rebuild the output structure."""
        if self.slice_idx and n >= 0:
            for j in self.slice_idx:
                leaves[j] = leaves[j].narrow(self.pad_dim, 0, n)
            for j, k in enumerate(self.kinds):
                if k[0] == _DUP:
                    leaves[j] = leaves[k[1]]
        if self.spec is None:
            return leaves[0]
        if self.spec == "tuple":
            return tuple(leaves)
        return _torch.tree_unflatten(leaves, self.spec)
