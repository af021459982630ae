"""Counters of what the trees did, as returned by :func:`graphtree.stats`."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("graphtree")


@dataclass
class Stats:
    """What graphtree did since the last :func:`graphtree.reset`.

    ``eager`` counts calls that ran eagerly, by reason (for example ``"autograd"``,
    ``"no CUDA"``, ``"capture failed: ..."``); warm-up runs are counted in ``warmups``, not there.
    ``pool_bytes`` is the memory the trees' pools hold on the GPU. ``replaced`` counts dead
    recordings (everything they read in place had died, such as a cache of an earlier call)
    recorded again; ``rerecordings`` counts recordings made because live inputs moved.
    ``values`` counts recordings made for a value a host read had not given before (a call that
    reads ``.item()`` or ``if t:`` is recorded per value; included in ``recordings``).
    ``adopted`` counts replays whose object arguments brought tensors of the same layout at other
    addresses (a fresh cache) that moved into the recording's memory instead of a new recording
    (:mod:`graphtree.tree.adoption`; the replays are counted in ``replays``). ``kept_bytes`` is the
    memory of those objects' tensors the recordings keep for the next one (outside the pools: a
    cache's worth per layout, whether or not the caller still holds it too). ``agreements`` counts
    the votes ranks took together for functions that call ``torch.distributed`` collectives, after
    each warm-up and around each capture (:mod:`graphtree.tree.lockstep`).

    Example::

        >>> s = graphtree.stats()
        >>> s.replays, s.eager
        (120, {'autograd': 2})
    """

    recordings: int = 0
    replays: int = 0
    warmups: int = 0
    rerecordings: int = 0
    replaced: int = 0
    values: int = 0
    adopted: int = 0
    agreements: int = 0
    eager: dict[str, int] = field(default_factory=dict)
    pool_bytes: int = 0
    kept_bytes: int = 0
    trees: int = 0
    cuda: bool = False
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        eager = ", ".join(f"{k}: {v}" for k, v in sorted(self.eager.items())) or "none"
        s = (
            f"graphtree: {self.recordings} recordings ({self.rerecordings} re-recordings, "
            f"{self.replaced} dead ones replaced"
            + (f", {self.values} for new values read on the host" if self.values else "")
            + "), "
            f"{self.replays} replays"
            + (f" ({self.adopted} adopting a new object's tensors)" if self.adopted else "")
            + f", {self.warmups} warm-ups"
            + (f" ({self.agreements} agreements among ranks)" if self.agreements else "")
            + f"; eager runs: {eager}; "
            f"pool {self.pool_bytes / 2**20:.1f} MiB in {self.trees} tree(s)"
            + (f", {self.kept_bytes / 2**20:.1f} MiB of objects' tensors kept" if self.kept_bytes else "")
        )
        return s + (f" [{self.note}]" if self.note else "")


class Counters:
    """Mutable counters one tree (or the process, for calls with no tree) keeps."""

    __slots__ = (
        "adopted",
        "agreements",
        "eager",
        "recordings",
        "replaced",
        "replays",
        "rerecordings",
        "values",
        "warmups",
    )

    def __init__(self) -> None:
        self.recordings = 0
        self.replays = 0
        self.warmups = 0
        self.rerecordings = 0
        self.replaced = 0  # dead recordings replaced (everything they read in place had died)
        self.values = 0  # recordings for a new value at a host read (tree/breaks.py)
        self.agreements = 0  # votes among ranks (tree/lockstep.py)
        self.adopted = 0  # replays that moved a new object's tensors into the recording's (tree/adoption.py)
        self.eager: Counter[str] = Counter()

    def clear(self) -> None:
        """Every counter back to zero."""
        self.__init__()  # type: ignore[misc]

    def add_to(self, s: Stats) -> None:
        s.recordings += self.recordings
        s.replays += self.replays
        s.warmups += self.warmups
        s.rerecordings += self.rerecordings
        s.replaced += self.replaced
        s.values += self.values
        s.adopted += self.adopted
        s.agreements += self.agreements
        for k, v in self.eager.items():
            s.eager[k] = s.eager.get(k, 0) + v


untreed = Counters()
"""Calls that never reached a tree (eager ones; a module's under autograd), and the eager results of
captures that ran a call whole (tree/grow.py): kept for the process, as no tree owns them."""


def count_eager(name: str, reason: str) -> None:
    """Count (and log once) a call that ran eagerly outside any tree's own counting."""
    untreed.eager[reason] += 1
    log_fallback(name, reason)


def count_untreed(what: str) -> None:
    """Count a warm-up, recording or replay (``what``) made outside the trees (tree/module_training.py)."""
    setattr(untreed, what, getattr(untreed, what) + 1)


_logged: set[tuple[str, str]] = set()


def log_fallback(fn_name: str, reason: str) -> None:
    """One log line per (function, reason) on logger ``graphtree``."""
    if (fn_name, reason) not in _logged:
        _logged.add((fn_name, reason))
        log.warning("graphtree: running `%s` eagerly: %s", fn_name, reason)
