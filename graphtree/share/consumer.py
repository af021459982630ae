"""The consumer side of ``graphtree.share``: attach to a producer's tensors, zero-copy.

Example::

    shared = graphtree.share.attach("decoder")
    logits = shared["logits"]                  # a torch tensor on the producer's memory
    w = shared.get("weights", shape=(4096, 4096), dtype=torch.float16)   # checked
    with shared.channel("tokens").read() as frame:   # the newest version, GPU-ordered
        print(frame.version, frame.tensor)
    shared.close()                                    # or let it go: the memory lives while tensors do
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from graphtree.share._control import ControlBlock, Membership
from graphtree.share._memory import ImportPool, ShareUnavailableError
from graphtree.share._rendezvous import default_path, request
from graphtree.share.channel import Subscription, drain_reads

__all__ = ["Attached", "attach"]


class Attached(Mapping[str, torch.Tensor]):
    """A producer's tensors, mapped into this process (a read-only mapping of name to tensor).

    The memory stays valid while any tensor of it is alive here, even after the producer exits.
    Channels (versions, see :meth:`channel`) are read through their :class:`Subscription`;
    :meth:`close` (or the object's end) tells the producer this consumer reads no more.
    """

    def __init__(
        self,
        path: str,
        tensors: dict[str, torch.Tensor],
        channels: dict[str, Subscription],
        membership: Membership,
        *,
        no_channels: str = "",
    ) -> None:
        self.path = path
        self._tensors = tensors
        self._channels = channels
        self._no_channels = no_channels  # why this consumer cannot read channels ("" when it can)
        self._membership = membership

    def __enter__(self) -> Attached:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Detach: the producer stops waiting for this consumer (idempotent). Tensors already
        taken stay valid; channels can no longer be read. Without it, the consumer detaches when
        neither this object nor any of its channels is referenced."""
        if self._channels:
            drain_reads()  # the claims of reads whose GPU work is still running go first
        self._membership.close()
        self._channels = {}

    def channel(self, name: str) -> Subscription:
        """The channel ``name``, to read its versions (``KeyError`` naming the published ones)."""
        try:
            return self._channels[name]
        except KeyError:
            known = ", ".join(sorted(self._channels)) or "none"
            state = f"it publishes: {known}"
            if self._membership.closed:
                state = "this consumer is closed"
            elif self._no_channels:
                state = self._no_channels
            raise KeyError(f"{self.path} publishes no channel {name!r} ({state})") from None

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._tensors[name]
        except KeyError:
            known = ", ".join(sorted(self._tensors)) or "none"
            raise KeyError(f"{self.path} publishes no tensor {name!r} (it publishes: {known})") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def get(  # type: ignore[override]
        self, name: str, *, shape: Sequence[int] | None = None, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The tensor ``name``, checked against the ``shape`` and ``dtype`` expected (``ValueError``).

        Unlike ``dict.get`` it has no default: an unknown name raises ``KeyError`` naming the
        published ones (``shape`` and ``dtype`` are keyword-only, so ``get(name, None)`` is refused).
        """
        t = self[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name!r} has shape {tuple(t.shape)}, not the {tuple(shape)} expected")
        if dtype is not None and t.dtype != dtype:
            raise ValueError(f"{name!r} has dtype {t.dtype}, not the {dtype} expected")
        return t


def _dtype(name: str, meta: dict[str, Any]) -> torch.dtype:
    dtype = getattr(torch, str(meta["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ShareUnavailableError(f"{name!r} has a dtype this torch does not know: {meta['dtype']}")
    return dtype


def _device_with_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ShareUnavailableError(
        f"the producer's GPU (uuid {uuid}) is not visible to this process (CUDA_VISIBLE_DEVICES?)"
    )


_imports: weakref.WeakValueDictionary[tuple[str, int], ImportPool] = weakref.WeakValueDictionary()
_imports_lock = threading.Lock()


def _import(pool_id: str | None, device: int, fd: int) -> ImportPool:
    """The producer's pool imported into this process: the import still open from an earlier
    attach to the same pool (its buffers are then not mapped again), else a new one."""
    if not pool_id:
        return ImportPool(device, fd)
    with _imports_lock:
        pool = _imports.get((pool_id, device))
        if pool is not None and pool.reuse():
            return pool
        pool = _imports[(pool_id, device)] = ImportPool(device, fd)
        return pool


def attach(name_or_path: str, *, timeout: float = 5.0) -> Attached:
    """Map the tensors a :class:`~graphtree.share.Publisher` publishes into this process.

    ``name_or_path`` is the producer's name or its socket's path. Raises ``FileNotFoundError``
    when no producer serves it, :class:`~graphtree.share._rendezvous.RefusedError` when the
    producer does not serve this user, ``TimeoutError`` after ``timeout`` seconds,
    :class:`ShareUnavailableError` without CUDA, ``cuda.core`` or the producer's GPU.

    Example::

        logits = graphtree.share.attach("decoder")["logits"]
    """
    if not torch.cuda.is_available():
        raise ShareUnavailableError("graphtree.share needs a CUDA GPU, and torch sees none")
    path = name_or_path if os.sep in name_or_path else default_path(name_or_path)
    reply, fds = request(path, {"op": "attach"}, timeout=timeout)
    membership = pool = None
    try:
        if len(fds) != 2:
            raise ShareUnavailableError(f"{path} sent {len(fds)} handles, expected 2")
        device = _device_with_uuid(reply["device_uuid"])
        pool = _import(reply.get("pool"), device, fds[0])  # fds are closed below
        membership = Membership(ControlBlock(os.dup(fds[1])), int(reply["consumer"]))
        tensors = {n: pool.tensor(m["export"], tuple(m["shape"]), _dtype(n, m)) for n, m in reply["tensors"].items()}
        channels = {}
        same_process = int(reply["pid"]) == os.getpid()
        for name, meta in () if same_process else reply["channels"].items():
            shape, dtype = tuple(meta["shape"]), _dtype(name, meta)
            buffers = [pool.tensor(export, shape, dtype) for export in meta["slots"]]
            channels[name] = Subscription(name, int(meta["index"]), buffers, membership, int(reply["pid"]))
    except BaseException:
        if membership is not None:
            membership.close()
        raise
    finally:
        if pool is not None:
            pool.done()  # the import is given back when the last of these tensors is gone
        for fd in fds:
            os.close(fd)
    no_channels = "channels are read from other processes; the producer's own process has their buffers"
    return Attached(path, tensors, channels, membership, no_channels=no_channels if same_process else "")
