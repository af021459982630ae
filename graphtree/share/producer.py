"""The producer side of ``graphtree.share``: tensors in shareable GPU memory, served by name.

Example::

    pub = graphtree.share.Publisher("decoder")
    logits = pub.empty("logits", (8, 32000), torch.float16)   # write into it; consumers see it
    pub.publish("weights", w)                                 # a shared copy of an existing tensor
    ch = pub.channel("tokens", (8,), torch.int64)             # versions, stream-ordered
    ch.next().copy_(t); ch.commit()
    ...
    pub.close()   # no new consumers; memory stays valid while any consumer holds it
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from graphtree.share._control import MAX_CHANNELS, MAX_CONSUMERS, MAX_SLOTS, ControlBlock, alive
from graphtree.share._memory import ExportPool, ShareUnavailableError
from graphtree.share._rendezvous import Peer, Server, default_path
from graphtree.share.channel import Channel

__all__ = ["Publisher"]


class Publisher:
    """Publish GPU tensors to other processes of this user under ``name``.

    Tensors are allocated in a CUDA memory pool that can be exported (at most ``max_bytes``);
    a consumer that :func:`graphtree.share.attach` es gets tensors on the same memory, with no
    copy. The handle of that pool travels only over a Unix-domain socket (``path``, by default
    ``$XDG_RUNTIME_DIR/graphtree/<name>.sock``) whose peer's uid the kernel vouches for: this
    user and ``allow_uids``.

    Raises :class:`ShareUnavailableError` without CUDA or ``cuda.core``, ``FileExistsError``
    when another producer serves ``name``.

    Example::

        with graphtree.share.Publisher("decoder") as pub:
            x = pub.publish("x", torch.arange(4.0, device="cuda"))
    """

    def __init__(
        self,
        name: str,
        *,
        device: int | None = None,
        max_bytes: int = 1 << 30,
        allow_uids: Iterable[int] = (),
        path: str | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise ShareUnavailableError("graphtree.share needs a CUDA GPU, and torch sees none")
        if type(max_bytes) is not int or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.device = torch.cuda.current_device() if device is None else int(device)
        self.path = path or default_path(name)
        self._uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        self._pool = ExportPool(self.device, max_bytes)
        self._pool_id = uuid.uuid4().hex  # names the pool to consumers, who reuse an open import of it
        self._tensors: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._channels: dict[str, tuple[Channel, list[dict[str, Any]]]] = {}
        self._block = ControlBlock.create()
        self._consumers: set[int] = set()  # the consumer numbers given out (their bits in the masks)
        self._lock = threading.Lock()
        self._server = Server(self.path, handler=self._serve, allow_uids=allow_uids)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor (uninitialised) in shared memory, published as ``name``; write into it."""
        shape = _check(name, shape, dtype)
        with self._lock:
            self._unused(name)
            t, export = self._pool.tensor(shape, dtype)
            meta = {"shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "export": export}
            self._tensors[name] = (t, meta)
        return t

    def publish(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A shared copy of ``tensor`` (a CUDA tensor on this producer's device), published as ``name``."""
        if not isinstance(tensor, torch.Tensor) or not tensor.is_cuda:
            kind = f"a tensor on {tensor.device}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise TypeError(f"graphtree.share publishes CUDA tensors, got {kind}")
        if tensor.device.index != self.device:
            raise ValueError(f"this producer shares memory of cuda:{self.device}, the tensor is on {tensor.device}")
        shared = self.empty(name, tensor.shape, tensor.dtype)
        shared.copy_(tensor)
        torch.cuda.current_stream(self.device).synchronize()  # consumers read it as soon as they attach
        return shared

    def channel(
        self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32, *, slots: int = 3
    ) -> Channel:
        """A channel ``name``: versions of a ``shape``/``dtype`` tensor in ``slots`` rotating buffers.

        Write each version into ``ch.next()`` and publish it with ``ch.commit()``; consumers read
        the newest with ``attach(...).channel(name).read()`` (see :class:`~graphtree.share.channel.Channel`).
        More slots let the producer run further ahead of slow readers (each is one more buffer,
        and one more recording when a graphed step writes into it); one slot is overwritten in
        place once its readers are done.
        """
        shape = _check(name, shape, dtype)
        if type(slots) is not int or not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"slots is an int from 1 to {MAX_SLOTS}, got {slots!r}")
        with self._lock:
            self._unused(name)
            if len(self._channels) >= MAX_CHANNELS:
                raise ValueError(f"a producer has at most {MAX_CHANNELS} channels")
            made = [self._pool.tensor(shape, dtype) for _ in range(slots)]
            ch = Channel(name, len(self._channels), [t for t, _ in made], self._block, reap=self._reap)
            self._channels[name] = (ch, [export for _, export in made])
        torch.cuda.current_stream(self.device).synchronize()  # the buffers exist before consumers map them
        return ch

    def names(self) -> list[str]:
        """The names published so far (tensors and channels)."""
        with self._lock:
            return [*self._tensors, *self._channels]

    def consumers(self) -> list[int]:
        """The process ids of the consumers attached now (dead ones are dropped first)."""
        self._reap()
        with self._block.locked():
            return [p for c in range(MAX_CONSUMERS) if (p := self._block.get(self._block.pid_cell(c)))]

    def close(self) -> None:
        """Stop serving new consumers (idempotent). Memory already attached stays valid."""
        self._server.close()

    def _unused(self, name: str) -> None:
        if name in self._tensors or name in self._channels:
            raise ValueError(f"{name!r} is already published by this producer")

    def _reap(self) -> None:
        """Forget consumers that detached or died, and their claims on slots."""
        block = self._block
        with self._lock, block.locked():
            for c in list(self._consumers):
                pid = block.get(block.pid_cell(c))
                if pid and alive(pid):
                    continue
                bit = ~(1 << c)
                for ch, _ in self._channels.values():
                    for s in range(len(ch.buffers)):
                        cell = block.reading_cell(ch.index, s)
                        block.set(cell, block.get(cell) & bit)
                block.set(block.pid_cell(c), 0)
                self._consumers.discard(c)

    def _serve(self, request: dict[str, Any], peer: Peer) -> tuple[dict[str, Any], list[int]]:
        if request.get("op") != "attach":
            raise ValueError(f"unknown request {request.get('op')!r}")
        self._reap()
        block = self._block
        with self._lock:
            tensors = {n: meta for n, (_, meta) in self._tensors.items()}
            with block.locked():
                free = [c for c in range(MAX_CONSUMERS) if c not in self._consumers]
                if not free:
                    raise RuntimeError(f"{MAX_CONSUMERS} consumers are attached already")
                c = free[0]
                block.set(block.pid_cell(c), peer.pid)
            self._consumers.add(c)
            channels = {
                n: {
                    "index": ch.index,
                    "shape": list(ch.buffers[0].shape),
                    "dtype": str(ch.buffers[0].dtype).removeprefix("torch."),
                    "slots": exports,
                }
                for n, (ch, exports) in self._channels.items()
            }
        reply = {
            "device_uuid": self._uuid,
            "pid": os.getpid(),
            "pool": self._pool_id,
            "tensors": tensors,
            "channels": channels,
            "consumer": c,
        }
        return reply, [self._pool.fd(), block.fd]


def _check(name: str, shape: Sequence[int], dtype: torch.dtype) -> tuple[int, ...]:
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tensor's name is a non-empty str, got {name!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"a shape has no negative sizes, got {shape}")
    return shape
