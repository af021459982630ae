"""Where a recording's tensor inputs live: placed in the pool for a capture, copied in on replay.

A copied input gets a placeholder in the tree's pool, which the graph reads; each replay copies
the caller's tensor into it (:class:`InputPlan`, one ``cudaMemcpyAsync`` on the fast path), or
fills it with the value of a 0-dim CPU tensor (a step count, a learning rate). An input
read in place (a parameter, a tensor marked with :func:`graphtree.mark_static`, one inside an object
argument, an output of the recording before it that the caller still holds) is not copied: the
graph reads it where it is, and a replay checks it is still there.

Example::

    plan, graph_leaves, owning = place_inputs(call, held_ptrs, device, pad_dim)
    plan.copy_in(call.leaves, call.n)     # before each replay
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from graphtree import _native, _torch
from graphtree.tree.inputs import Call
from graphtree.tree.numbers import NUMBER, NUMBER_TYPES

_Tensor = torch.Tensor
_current_stream: Callable[[int], int] = _torch.raw_stream_getter() or (lambda device: 0)  # (a CPU build: never called)


@functools.cache
def raw_copier() -> Callable[[int, int, int, int], None] | None:
    """``copy(dst_ptr, src_ptr, nbytes, device)``: a device-to-device ``cudaMemcpyAsync`` on the
    device's current stream, or ``None`` where ``cuda.bindings`` is missing.

    For a contiguous input of the recorded shape this does what ``Tensor.copy_`` does, minus
    the dispatcher and TensorIterator set-up: on the replay path that is most of the cost of
    the copy. Stream order is the same as ``copy_``'s (the current stream). Resolved once, at
    the first recording that can use it, not at import. Once graphtree's native helpers are
    built, the same ``cudaMemcpyAsync`` of the runtime torch loaded is called from C++. Here, not in
    ``graphtree._torch`` (it touches no private API of torch's but the stream getter): a replay's
    copy-in stays in this module (issue 47, item 4).

    Example::

        copy = raw_copier()
        copy(placeholder.data_ptr(), x.data_ptr(), x.nbytes, x.get_device())
    """
    try:
        from cuda.bindings import runtime as cudart
    except Exception:  # noqa: BLE001 - absent or broken cuda-bindings: Tensor.copy_ does the copy
        return None
    memcpy = cudart.cudaMemcpyAsync
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    ok = cudart.cudaError_t.cudaSuccess
    current_stream = _torch.raw_stream_getter()
    if current_stream is None:
        return None

    def copy(dst: int, src: int, nbytes: int, device: int) -> None:
        native = _native.loaded  # the same call without cuda.bindings' argument conversions
        if native is not None and native.copy_d2d(dst, src, nbytes, current_stream(device)):
            return
        (err,) = memcpy(dst, src, nbytes, kind, current_stream(device))
        if err != ok:
            raise RuntimeError(f"graphtree: cudaMemcpyAsync of an input failed: {err}")

    return copy


def is_marked_static(t: torch.Tensor) -> bool:
    """Whether the caller asked for ``t`` to be used in place (see :func:`graphtree.mark_static`)."""
    return isinstance(t, torch.nn.Parameter) or getattr(t, "_graphtree_static", False)


class RawCopy(NamedTuple):
    """The replay fast path for one contiguous copied input: ``copy(dst, leaves[leaf].data_ptr(), nbytes, device)``
    (a ``cudaMemcpyAsync``, see :func:`raw_copier`)."""

    leaf: int
    dst: int
    nbytes: int
    device: int
    copy: Callable[[int, int, int, int], None]


class InputPlan:
    """How a recording's tensor inputs reach its graph; built once, applied on every replay.

    ``raw`` is set when the whole copy-in is one ``cudaMemcpyAsync`` (one contiguous, unpadded
    copied input); :meth:`copy_in` does any plan.
    """

    def __init__(
        self,
        *,
        inplace_idx: list[int],
        inplace_ptrs: list[int],
        copy_idx: list[int],
        placeholders: list[torch.Tensor],
        padded: tuple[int, ...],
        pad_dim: int,
        bucket: int,
        device: int,
        relaid: tuple[int, ...] = (),
        host: tuple[int, ...] = (),
        numbers: tuple[int, ...] = (),
        lazy: dict[int, int] | None = None,
    ) -> None:
        self.inplace_idx = inplace_idx
        self.inplace_ptrs = inplace_ptrs  # aligned with the leaves; 0 elsewhere
        self.copy_idx = copy_idx
        self.placeholders = placeholders  # non-owning views into the pool
        self.padded = padded
        self.pad_dim = pad_dim
        self.bucket = bucket
        self.device = device
        self.relaid = relaid  # copied inputs whose placeholder is dense where the input is not (expanded)
        self.host = host  # 0-dim CPU tensors and Python numbers: their placeholders are filled with their values
        self.lazy = lazy or {}  # leaf -> lazy bits: copied as memory (the bits flipped off), read with the bits
        self._fills = [(ph, i) for ph, i in zip(placeholders, copy_idx) if i in host]
        copies = [(ph, i) for ph, i in zip(placeholders, copy_idx) if i not in host]  # the device copies
        self._copies = ([ph for ph, _ in copies], [i for _, i in copies])
        self.raw = self._raw_copy()
        self._native = self._native_plan(copies, numbers)

    def _native_plan(
        self, copies: list[tuple[torch.Tensor, int]], numbers: tuple[int, ...]
    ) -> tuple[list[tuple[torch.Tensor, int]], tuple[int, ...], tuple[int, ...]] | None:
        """The copy-in as one native call (``_native`` ``copy_in``): the 0-dim CPU tensors' fills
        (left to ``fill_``), then the contiguous copies and the Python numbers' writes, flattened;
        None where the Python path must do it (padding, an expanded input, nothing to copy)."""
        if self.padded or self.relaid or self.lazy or not (copies or numbers):
            return None
        if any(not ph.is_contiguous() or not ph.numel() for ph, _ in copies):
            return None
        flat_copies = tuple(v for ph, i in copies for v in (i, ph.data_ptr(), ph.numel() * ph.element_size()))
        writes = tuple(v for ph, i in self._fills if i in numbers for v in (i, ph.data_ptr()))
        tensor_fills = [(ph, i) for ph, i in self._fills if i not in numbers]
        return tensor_fills, flat_copies, writes

    def _raw_copy(self) -> RawCopy | None:
        if len(self.copy_idx) != 1 or self.padded or self.relaid or self.host or self.lazy:
            return None
        ph = self.placeholders[0]
        # The key fixes shape, dtype and strides: a contiguous placeholder means a contiguous input.
        copy = raw_copier() if ph.is_contiguous() and ph.numel() else None
        if copy is None:
            return None
        return RawCopy(self.copy_idx[0], ph.data_ptr(), ph.numel() * ph.element_size(), self.device, copy)

    def copy_in(self, leaves: Sequence[Any], n: int) -> None:
        """Copy the copied inputs into their placeholders (padding rows past ``n`` are zeroed);
        fill those of 0-dim CPU tensors with their values (a kernel launch with the value as its
        argument: no host-to-device copy, no synchronisation) and write Python numbers'. Once the
        native helpers are built, the contiguous copies and the numbers' writes are one C call
        (``cudaMemcpyAsync`` each, ``cuStreamWriteValue64`` for a number: no kernel).

        An input with its conjugate or negative bit set (``torch.conj``'s lazy view) holds its
        values unconjugated in memory. Its recording reads a placeholder with the same bits
        (``lazy``): its memory is copied as it is, with the bits flipped off the source. A raw
        copy never meets one it was not planned for (its key would differ); it checks anyway."""
        plan, native = self._native, _native.loaded
        if plan is not None and native is not None:
            tensor_fills, copies, writes = plan
            for ph, i in tensor_fills:
                ph.fill_(leaves[i])
            if native.copy_in(_current_stream(self.device), leaves, copies, writes):
                return
        raw = self.raw
        if raw is not None:
            x = leaves[raw.leaf]
            if not (x.is_conj() or x.is_neg()):
                raw.copy(raw.dst, x.data_ptr(), raw.nbytes, raw.device)
                return
        for ph, i in self._fills:
            ph.fill_(leaves[i])
        placeholders, copy_idx = self._copies
        if not copy_idx:
            return
        lazy = self.lazy
        if not self.padded or n == self.bucket:
            if lazy:
                _torch.foreach_copy(placeholders, [_torch.flip_bits(leaves[i], lazy.get(i, 0)) for i in copy_idx])
            elif len(copy_idx) == 1:
                placeholders[0].copy_(leaves[copy_idx[0]])
            else:
                _torch.foreach_copy(placeholders, [leaves[i] for i in copy_idx])
            return
        dsts, srcs = [], []
        for ph, i in zip(placeholders, copy_idx):
            if i in self.padded:
                ph.narrow(self.pad_dim, n, self.bucket - n).zero_()
                ph = ph.narrow(self.pad_dim, 0, n)
            dsts.append(ph)
            srcs.append(_torch.flip_bits(leaves[i], lazy[i]) if i in lazy else leaves[i])
        _torch.foreach_copy(dsts, srcs)


def place_inputs(
    call: Call, held: set[int], device: int, pad_dim: int
) -> tuple[InputPlan, list[Any], list[torch.Tensor]]:
    """Decide how each tensor input of ``call`` reaches the graph about to be captured.

    Static-marked tensors, parameters, tensors held by object arguments and inputs whose
    storage address is in ``held`` (outputs of the current path) are read in place; the others
    get a placeholder, allocated here from the current allocation context (the tree's pool).
    Returns the plan, the leaves the capture runs on (placeholders in place of copied inputs)
    and the placeholders themselves, which the caller keeps alive until the capture is over.
    """
    leaves = call.leaves
    dev = torch.device("cuda", device)
    inplace_idx: list[int] = []
    inplace_ptrs = [0] * len(leaves)
    copy_idx: list[int] = []
    views: list[torch.Tensor] = []
    owning: list[torch.Tensor] = []
    relaid: list[int] = []  # copied inputs whose placeholder is laid out unlike the input
    host: list[int] = []  # 0-dim CPU tensors (stride None: inputs.read_call) and Python numbers (NUMBER)
    numbers: list[int] = []  # the Python numbers among them
    lazy: dict[int, int] = {}  # copied inputs with lazy bits: the placeholder holds their memory as it is
    graph_leaves = list(leaves)
    for i, x in enumerate(leaves):
        if not isinstance(x, _Tensor):
            if i >= call.n_args or type(x) not in NUMBER_TYPES or call.key[i][-1] is not NUMBER:
                continue  # (a Python number keyed by value: part of the graph)
        elif i not in call.padded and (
            i >= call.n_args or is_marked_static(x) or x.untyped_storage().data_ptr() in held
        ):
            inplace_idx.append(i)
            inplace_ptrs[i] = x.data_ptr()
            continue
        shape, dtype, stride = call.key[i][:3]
        bits = call.key[i][3] if len(call.key[i]) == 4 else 0  # a conjugate or negative view (inputs._tensor_part)
        if stride is None or stride is NUMBER:  # a 0-dim CPU tensor or a Python number: a device scalar
            ph = torch.empty(shape, dtype=dtype, device=dev)
            host.append(i)
            if stride is NUMBER:
                numbers.append(i)
        elif any(st == 0 and n > 1 for n, st in zip(shape, stride)):
            # An expanded input (stride 0): a placeholder of the same strides could not be copied
            # into (its elements share memory); a dense one holds the same values.
            ph = torch.empty(shape, dtype=dtype, device=dev)
            relaid.append(i)
        else:
            ph = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
        owning.append(ph)
        graph_leaves[i] = _torch.flip_bits(ph, bits) if bits else ph  # (the capture's kernels are eager's)
        if bits:
            lazy[i] = bits
        copy_idx.append(i)
        storage = ph.untyped_storage()
        views.append(_torch.tensor_on(_torch.meta_of(ph), _torch.storage_at(storage.data_ptr(), dev, storage.nbytes())))
    plan = InputPlan(
        inplace_idx=inplace_idx,
        inplace_ptrs=inplace_ptrs,
        copy_idx=copy_idx,
        placeholders=views,
        padded=call.padded,
        pad_dim=pad_dim,
        bucket=call.bucket,
        device=device,
        relaid=tuple(relaid),
        host=tuple(host),
        numbers=tuple(numbers),
        lazy=lazy,
    )
    return plan, graph_leaves, owning


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


def copied_inputs(call: Call) -> list[int]:
    """Indices of the leaves a recording of ``call`` would copy (the writes to watch for)."""
    return [i for i, x in enumerate(call.leaves[: call.n_args]) if isinstance(x, _Tensor) and not is_marked_static(x)]


def state_watch(leaves: Sequence[Any], idx: Sequence[int], track_reads: bool = False) -> _torch.StateWatch:
    """A dispatch mode that notes writes to ``leaves[i]`` (i in idx), tensors made and (optionally)
    every CUDA storage read (see :class:`graphtree._torch.StateWatch`)."""
    watched = {leaves[i].untyped_storage().data_ptr(): i for i in idx if leaves[i].numel()}
    return _torch.StateWatch(watched, track_reads)
