"""CUDA streams that graphtree alone uses: its trees' side streams and the streams it captures on.

``torch.cuda.Stream()`` hands out one of a fixed set of pooled streams per device, round-robin
(32 of each priority): after enough calls it hands out a stream that is already in use, so two
threads' streams can be one CUDA stream. A capture on it then takes in the other thread's work, or
that thread's next operation fails. Seen on the H100 (torch 2.11) once graphtree made a stream per
training capture: in the one-process GPU suite, a thread's warm-up failed with "operation would
make the legacy stream depend on a capturing blocking stream" and another's empty capture with
"operation failed due to a previous error during capture".

:func:`own_stream` makes a stream with ``cudaStreamCreateWithFlags`` (cuda-bindings), which no
one else is handed, wrapped in ``torch.cuda.ExternalStream``; :func:`give_back` keeps it for the
next caller (streams are reused, never destroyed: a stream may still hold queued work). Without
cuda-bindings, ``torch.cuda.Stream()``.

Example::

    stream = own_stream(0)
    try:
        with torch.cuda.stream(stream):
            ...
    finally:
        give_back(stream)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_lock = threading.Lock()
_spare: dict[int, list[torch.cuda.Stream]] = {}


def own_stream(device: int) -> torch.cuda.Stream:
    """A non-blocking stream on ``device`` that no one else is handed until :func:`give_back`."""
    with _lock:
        spare = _spare.get(device)
        if spare:
            return spare.pop()
    try:
        from cuda.bindings import runtime as cudart
    except Exception:  # noqa: BLE001 - absent or broken cuda-bindings: torch's pooled streams
        return torch.cuda.Stream(device)
    with torch.cuda.device(device):
        err, handle = cudart.cudaStreamCreateWithFlags(cudart.cudaStreamNonBlocking)
    if err != cudart.cudaError_t.cudaSuccess:
        raise RuntimeError(f"graphtree: cudaStreamCreateWithFlags failed on cuda:{device}: {err}")
    return torch.cuda.ExternalStream(int(handle), device=torch.device("cuda", device))


def give_back(stream: torch.cuda.Stream) -> None:
    """Keep ``stream`` (from :func:`own_stream`) for the next caller."""
    device = stream.device.index if stream.device.index is not None else 0
    with _lock:
        _spare.setdefault(device, []).append(stream)


@contextmanager
def borrowed(device: int) -> Iterator[torch.cuda.Stream]:
    """:func:`own_stream` for the block, given back after it."""
    stream = own_stream(device)
    try:
        yield stream
    finally:
        give_back(stream)
