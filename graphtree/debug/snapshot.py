"""Copies of a call's inputs in host memory, taken *before* the call, for errors that leave the GPU unreadable.

After a sticky CUDA error (an illegal address, a device-side assert) every later CUDA call
fails, so the inputs of the failing call can no longer be read from the GPU. And a fault inside
a CUDA graph or an asynchronous kernel is reported at a *later* call, whose inputs are not the
ones that faulted. :class:`InputSnapshots` therefore copies each call's tensor arguments to
pinned host memory before the call runs, asynchronously on the current stream, and keeps the
last two calls: the one that raised and the one before it.

Knowing a copy finished without asking the GPU: after a call's copies, one more 8-byte copy
writes the call's number (from a small table on the device) into pinned memory on the same
stream. Streams run in order, so when that number is in host memory, the copies before it are
too; after a sticky error, a snapshot whose number did not arrive is reported as lost, never
written with stale values.

Cost per call: one ``copy_`` per tensor argument plus the 8-byte marker per device, each a
``cudaMemcpyAsync`` (a few microseconds of CPU time), and the bytes themselves at the GPU's
device-to-host bandwidth, on the call's stream (see ``benchmarks/README.md`` for measured
figures). Pinned buffers are reused while the inputs keep their layout.

Example::

    snaps = InputSnapshots()
    snaps.take((x,), {})           # before the call
    out = fn(x)
    ...
    for snap in snaps.completed():  # after an error: newest first
        print(snap.origin, snap.args)
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

import torch

from graphtree import _torch
from graphtree.debug.recipe import Recipe, recipe_of

__all__ = ["ORIGIN_BEFORE", "ORIGIN_RAISED", "InputSnapshots", "Snapshot", "layout_of"]

ORIGIN_RAISED = "the call that raised"
ORIGIN_BEFORE = "the call before it"
_SLOTS = 4  # the last calls snapshotted: a fault surfacing a few calls late still finds the call it came from
_MARKS = 2 * _SLOTS  # call numbers modulo this: a stale marker (a slot's last call) never looks current


@dataclasses.dataclass
class Snapshot:
    """One call's inputs on the host, as taken before the call (see :class:`InputSnapshots`)."""

    origin: str  # ORIGIN_RAISED or ORIGIN_BEFORE
    args: tuple
    kwargs: dict[str, Any]
    tensors: list[dict[str, Any]]  # dtype, shape, stride, device of each tensor argument, in order
    rng: dict[str, Any]
    age: int = 0  # calls between it and the newest call snapshotted (0: the newest)


class _Slot:
    """Pinned buffers and the state of one call's snapshot."""

    def __init__(self) -> None:
        self.n = -1  # the call's number once every copy is queued; -1 while (or if never) taken
        self.spec: Any = None
        self.leaves: list[Any] = []  # the call's leaves, tensors replaced by their buffers
        self.buffers: dict[int, torch.Tensor] = {}  # leaf index -> host buffer (reused)
        self.marks: dict[torch.device, torch.Tensor] = {}  # device -> pinned int64 scalar
        self.active: list[torch.Tensor] = []  # the markers of this call's devices
        self.layouts_by_leaf: dict[int, dict[str, Any]] = {}  # leaf index -> layout of its buffer
        self.devices_by_leaf: dict[int, torch.device] = {}  # leaf index -> device of the tensor it copies
        self.rng: dict[str, Any] = {}


class InputSnapshots:
    """Host copies of the last two calls' arguments, taken before each call.

    ``take(args, kwargs)`` queues the copies (tensors on CUDA go to pinned memory with
    ``non_blocking=True``; other tensors are copied at once); ``completed()`` returns the
    snapshots known to be whole, newest first. Calls whose tensors exceed ``limit_bytes`` are
    not snapshotted (:meth:`lost` says so). Given the callable (``of``), its first call also keeps
    how to rebuild it (:attr:`recipe`: a model with its weights, read while they still can be: a
    sticky CUDA error later leaves them unreadable). Not thread-safe: one per
    graphed callable, whose calls graphtree already serialises per thread.

    Example::

        snaps = InputSnapshots(limit_bytes=1 << 30)
        snaps.take((x, idx), {"scale": 2.0})
    """

    def __init__(self, limit_bytes: int = 4 << 30, of: Callable[..., Any] | None = None) -> None:
        self.limit_bytes = limit_bytes
        self._of = of
        self.recipe: Recipe | None = None  # how to rebuild ``of``, as of its first call
        self._slots = tuple(_Slot() for _ in range(_SLOTS))
        self._calls = 0
        self._kept: list[torch.Tensor] = []  # pinned buffers replaced while the GPU was failing: never freed
        self.skipped = ""  # why the last call was not snapshotted, if it was not
        self._sources: dict[torch.device, list[torch.Tensor]] = {}  # device -> views of arange(_MARKS)
        _live.add(self)

    @property
    def calls(self) -> int:
        """How many calls were snapshotted (or tried)."""
        return self._calls

    def take(self, args: tuple, kwargs: dict[str, Any]) -> None:
        """Queue host copies of this call's arguments (before the call runs)."""
        if self.recipe is None and self._of is not None:
            self.recipe = recipe_of(self._of, self.limit_bytes)
        self._calls = n = self._calls + 1
        slot = self._slots[n % _SLOTS]
        slot.n = -1
        leaves, slot.spec = _torch.tree_flatten((args, kwargs))
        host: list[Any] = []
        devices: set[torch.device] = set()
        with torch.no_grad():
            for i, x in enumerate(leaves):
                if not isinstance(x, torch.Tensor):
                    host.append(x)
                    continue
                buf = slot.buffers.get(i)
                if (
                    buf is None
                    or buf.shape != x.shape
                    or buf.stride() != x.stride()
                    or buf.dtype != x.dtype
                    or slot.devices_by_leaf[i] != x.device  # pinned or not, and the layout's device
                ):
                    buf = self._allocate(slot, i, x)
                    if buf is None:
                        return
                if x.is_cuda:
                    buf.copy_(x, non_blocking=True)
                    devices.add(x.device)
                else:
                    buf.copy_(x)
                host.append(buf)
            slot.rng = {"cpu": torch.get_rng_state()}
            for d in devices:
                slot.rng[f"cuda:{d.index}"] = torch.cuda.get_rng_state(d)
                mark = slot.marks.get(d)
                if mark is None:
                    mark = slot.marks[d] = torch.full((), -1, dtype=torch.int64, pin_memory=True)
                mark.copy_(self._source(d)[n % _MARKS], non_blocking=True)
        self.skipped = ""
        slot.leaves = host
        slot.active = [slot.marks[d] for d in devices]
        slot.n = n

    def _allocate(self, slot: _Slot, i: int, x: torch.Tensor) -> torch.Tensor | None:
        """A (pinned, for CUDA) host buffer for leaf ``i``; ``None`` if the call is over the limit."""
        old = slot.buffers.pop(i, None)
        if old is not None and old.is_pinned() and not _healthy(x.device):
            self._kept.append(old)  # freeing it now would abort the process (see _keep_pinned_buffers_at_exit)
        held = sum(b.untyped_storage().nbytes() for b in slot.buffers.values())
        if held + x.untyped_storage().nbytes() > self.limit_bytes:
            self._kept.extend(b for b in slot.buffers.values() if b.is_pinned() and not _healthy(x.device))
            slot.buffers.clear()
            self.skipped = (
                f"the call's tensors hold over {(held + x.untyped_storage().nbytes()) / 2**20:.1f} MiB, over the "
                f"dump limit of {self.limit_bytes / 2**20:.1f} MiB: not snapshotted"
            )
            return None
        buf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=x.is_cuda)
        slot.buffers[i] = buf
        slot.layouts_by_leaf[i] = layout_of(x)
        slot.devices_by_leaf[i] = x.device
        return buf

    def _source(self, device: torch.device) -> list[torch.Tensor]:
        views = self._sources.get(device)
        if views is None:
            table = torch.arange(_MARKS, dtype=torch.int64, device=device)
            views = self._sources[device] = [table[k] for k in range(_MARKS)]
        return views

    def _pinned(self) -> list[torch.Tensor]:
        slots = [t for s in self._slots for t in (*s.buffers.values(), *s.marks.values()) if t.is_pinned()]
        return slots + self._kept

    def completed(self, scan: bool = False) -> list[Snapshot]:
        """The snapshots whose copies are known to have finished, newest first (at most two): the
        newest call's (``ORIGIN_RAISED``) and the one before it (``ORIGIN_BEFORE``), each if whole.

        Waits for the GPU when it still can (an ordinary error); after a sticky CUDA error it reads
        only what the copies' markers prove arrived. ``scan`` (a fault that surfaced outside the
        calls, :mod:`graphtree.debug.late`): the newest call whose copies arrived instead, and the
        one before it, among the last ``_SLOTS`` calls. The GPU runs nothing after a fault, so that
        is the call whose work faulted (or one before it) even when calls were made after it
        (``age`` says how many).
        """
        for d in {d for s in self._slots for d in s.marks}:
            try:
                torch.cuda.synchronize(d)
            except RuntimeError:  # a sticky error: trust only the markers
                pass
        out: list[Snapshot] = []
        for age in range(_SLOTS if scan else 2):
            n = self._calls - age
            slot = self._slots[n % _SLOTS]
            if n <= 0 or slot.n != n or not self._arrived(slot, n):
                if scan and out:
                    break  # (the call before the newest arrived one did not arrive: none)
                continue
            args, kwargs = _torch.tree_unflatten([_copy(x) for x in slot.leaves], slot.spec)
            layouts = [slot.layouts_by_leaf[i] for i, x in enumerate(slot.leaves) if isinstance(x, torch.Tensor)]
            first = not out if scan else age == 0
            out.append(Snapshot(ORIGIN_RAISED if first else ORIGIN_BEFORE, args, kwargs, layouts, dict(slot.rng), age))
            if len(out) == 2:
                break
        return out

    def lost(self) -> str:
        """Why the newest call has no snapshot ("" when it has one)."""
        n = self._calls
        slot = self._slots[n % _SLOTS]
        if n <= 0:
            return "no call was snapshotted"
        if self.skipped:
            return self.skipped
        if slot.n != n:
            return "the snapshot of the call that raised was not queued whole (the error came while taking it)"
        if not self._arrived(slot, n):
            return (
                "the snapshot of the call that raised never reached host memory: the GPU failed before its "
                "copies ran, so the fault came from earlier work (see the call before it)"
            )
        return ""

    @staticmethod
    def _arrived(slot: _Slot, n: int) -> bool:
        return all(int(m.item()) == n % _MARKS for m in slot.active)


def _healthy(device: torch.device) -> bool:
    """Whether ``device`` (the current CUDA device, for a CPU device) has no sticky CUDA error (a
    stream query does not wait for the GPU)."""
    try:
        torch.cuda.current_stream(device if device.type == "cuda" else None).query()
    except RuntimeError:
        return False
    return True


_live: weakref.WeakSet[InputSnapshots] = weakref.WeakSet()


@atexit.register
def _keep_pinned_buffers_at_exit() -> None:
    """Never free the pinned buffers at exit. Freeing pinned memory that a ``non_blocking`` copy
    used makes torch record a CUDA event, which after a sticky CUDA error throws inside a
    destructor and aborts the process (SIGABRT) as the interpreter shuts down. The operating
    system takes the memory back anyway."""
    for snaps in list(_live):
        for t in snaps._pinned():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))


def layout_of(x: torch.Tensor) -> dict[str, Any]:
    """What a dump records of a tensor argument besides its values: dtype, shape, strides, device."""
    return {"dtype": str(x.dtype), "shape": list(x.shape), "stride": list(x.stride()), "device": str(x.device)}


def _copy(x: Any) -> Any:
    """A plain host tensor the caller may keep (the pinned buffers are reused by later calls)."""
    if isinstance(x, torch.Tensor):
        out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype)
        out.copy_(x)
        return out
    return x
