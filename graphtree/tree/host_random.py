"""Random numbers drawn on the host during a warm-up: Python's ``random``, NumPy's global generator
and torch's CPU generator. A replay runs no Python and no CPU operator, so a call that draws one
(``if random.random() < p: x = x.flip(-1)``, ``torch.rand(()).item()``) would repeat the draw its
recording made on every replay, where eager draws anew: that signature runs eagerly, with the
reason. (The CUDA generators are the device's: recordings draw from them as eager does,
``tree/draws.py``.)

Example::

    before = HostRandom.now()
    out = fn(*args)                     # the warm-up
    reason = before.drawn("f")          # None, or why the call cannot be recorded
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch

__all__ = ["HostRandom"]


class HostRandom:
    """The host generators' states at one moment (compared after a warm-up: a few µs, warm-ups only)."""

    def __init__(self, states: tuple[Any, ...]) -> None:
        self.states = states

    @staticmethod
    def now() -> HostRandom:
        return HostRandom(_states())

    def drawn(self, name: str) -> str | None:
        """Why ``name``'s call, run since :meth:`now`, cannot be recorded (it drew on the host), or None."""
        after = _states()
        for (what, before), (_, now) in zip(self.states, after):
            if not _equal(before, now):
                return (
                    f"`{name}` draws random numbers on the host ({what}): a replay runs no Python and would "
                    f"repeat its recording's draw where eager draws anew; draw on the GPU (torch.rand(..., "
                    f"device='cuda')) to graph it"
                )
        return None


def _states() -> tuple[tuple[str, Any], ...]:
    out: list[tuple[str, Any]] = [
        ("Python's random module", random.getstate()),
        ("torch's CPU generator", torch.default_generator.get_state()),
    ]
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # (imported by the user, or by a library: never imported here)
        name, key, pos, has_gauss, gauss = numpy.random.get_state()[:5]
        out.append(("NumPy's global generator", (name, key.tobytes(), pos, has_gauss, gauss)))
    return tuple(out)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return bool(a == b)
