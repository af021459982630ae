"""The producer side of ``graphtree.share``: tensors in shareable GPU memory, served by name.

Example::

    pub = graphtree.share.Publisher("decoder")
    logits = pub.empty("logits", (8, 32000), torch.float16)   # write into it; consumers see it
    pub.publish("weights", w)                                 # a shared copy of an existing tensor
    ...
    pub.close()   # no new consumers; memory stays valid while any consumer holds it
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from graphtree.share._memory import ExportPool, ShareUnavailableError
from graphtree.share._rendezvous import Peer, Server, default_path

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
        self._tensors: dict[str, tuple[torch.Tensor, dict[str, Any]]] = {}
        self._lock = threading.Lock()
        self._server = Server(self.path, handler=self._serve, allow_uids=allow_uids)

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A new tensor (uninitialised) in shared memory, published as ``name``; write into it."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tensor's name is a non-empty str, got {name!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"a shape has no negative sizes, got {shape}")
        with self._lock:
            if name in self._tensors:
                raise ValueError(f"{name!r} is already published by this producer")
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

    def names(self) -> list[str]:
        """The names published so far."""
        with self._lock:
            return list(self._tensors)

    def close(self) -> None:
        """Stop serving new consumers (idempotent). Memory already attached stays valid."""
        self._server.close()

    def _serve(self, request: dict[str, Any], peer: Peer) -> tuple[dict[str, Any], list[int]]:
        if request.get("op") != "attach":
            raise ValueError(f"unknown request {request.get('op')!r}")
        with self._lock:
            tensors = {n: meta for n, (_, meta) in self._tensors.items()}
        return {"device_uuid": self._uuid, "tensors": tensors}, [self._pool.fd()]
