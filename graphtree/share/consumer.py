"""The consumer side of ``graphtree.share``: attach to a producer's tensors, zero-copy.

Example::

    shared = graphtree.share.attach("decoder")
    logits = shared["logits"]                  # a torch tensor on the producer's memory
    w = shared.get("weights", shape=(4096, 4096), dtype=torch.float16)   # checked
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence

import torch

from graphtree.share._memory import ImportPool, ShareUnavailableError
from graphtree.share._rendezvous import default_path, request

__all__ = ["Attached", "attach"]


class Attached(Mapping[str, torch.Tensor]):
    """A producer's tensors, mapped into this process (a read-only mapping of name to tensor).

    The memory stays valid while any tensor of it is alive here, even after the producer exits.
    """

    def __init__(self, path: str, tensors: dict[str, torch.Tensor]) -> None:
        self.path = path
        self._tensors = tensors

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


def _device_with_uuid(uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ShareUnavailableError(
        f"the producer's GPU (uuid {uuid}) is not visible to this process (CUDA_VISIBLE_DEVICES?)"
    )


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
    try:
        if len(fds) != 1:
            raise ShareUnavailableError(f"{path} sent {len(fds)} handles, expected 1")
        device = _device_with_uuid(reply["device_uuid"])
        pool = ImportPool(device, fds[0])  # cuda.core imports from it and leaves it open: closed below
        tensors: dict[str, torch.Tensor] = {}
        for name, meta in reply["tensors"].items():
            dtype = getattr(torch, str(meta["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                raise ShareUnavailableError(f"{name!r} has a dtype this torch does not know: {meta['dtype']}")
            tensors[name] = pool.tensor(meta["export"], tuple(meta["shape"]), dtype)
    finally:
        for fd in fds:
            os.close(fd)
    return Attached(path, tensors)
