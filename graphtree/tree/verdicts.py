"""What the trees decided about one graphed callable's signatures, and the counts they decide by.

A signature is *given up* when it cannot be graphed (a host sync, a mutated input, a failed
capture, the re-record limit...): its later calls run eagerly with the reason, while the
callable's other signatures are still graphed. Some outcomes are given a few chances first: a
warm-up that kept tensors it allocated (a cache filled on first use) warms up again, up to three
times; a recording dropped because ``torch.compile`` traced during it is warmed up and recorded
again, up to three times. A part graphtree chose itself in a module graphed in parts
(:mod:`graphtree.tree.parts`) is given up when its warm-ups dispatch fewer than ``min_ops``
operators: a graph of it would not gain.

Example (what :class:`~graphtree.tree.grow.Grower` does after a warm-up)::

    verdicts = Verdicts("step", min_ops=0)
    if verdicts.note_kept_state(key):      # the third warm-up that kept what it allocated
        verdicts.give_up(key, "it keeps tensors it allocated on every call")
    verdicts.given_up.get(key)             # the reason, for the next call of that signature
"""

from __future__ import annotations

from typing import Any

KEPT_STATE_TRIES = 3
"""Warm-ups of one signature that may keep tensors they allocated before it is given up."""
COMPILED_TRIES = 3
"""Recordings of one signature that ``torch.compile`` may trace during before it is given up."""


class Verdicts:
    """The signatures of one graphed callable (``name``) given up, with their reasons, and the
    counts of the outcomes that get a few chances first; ``min_ops``: the floor of a part's size."""

    def __init__(self, name: str, min_ops: int = 0) -> None:
        self.name = name
        self.min_ops = min_ops
        self.given_up: dict[Any, str] = {}  # signature -> why its calls run eagerly
        self._kept_state: dict[Any, int] = {}
        self._compiled_in_capture: dict[Any, int] = {}  # recordings dropped because torch.compile traced in them
        self._small = False  # a warm-up ran fewer than min_ops operators, and none ran more
        self._big_enough = False

    def give_up(self, key: Any, reason: str) -> None:
        """Run calls with signature ``key`` eagerly from now on, for the reason given."""
        self.given_up[key] = reason

    def note_kept_state(self, key: Any) -> bool:
        """Count a warm-up of ``key`` that kept tensors it allocated; True once that looks
        like every call (:data:`KEPT_STATE_TRIES` times), not a cache filled on first use."""
        n = self._kept_state[key] = self._kept_state.get(key, 0) + 1
        return n >= KEPT_STATE_TRIES

    def may_record_again(self, key: Any) -> bool:
        """Count a recording of ``key`` dropped because torch.compile traced during it; True while
        that happened fewer than :data:`COMPILED_TRIES` times (a compile on first use, a guard that
        failed once)."""
        n = self._compiled_in_capture[key] = self._compiled_in_capture.get(key, 0) + 1
        return n < COMPILED_TRIES

    def size_reason(self, ops: int) -> str | None:
        """Why a warm-up that dispatched ``ops`` operators is not worth a graph, or None: only a
        part graphtree chose itself has a floor (``min_ops``)."""
        if ops >= self.min_ops:
            self._big_enough = True
            return None
        self._small = True
        return (
            f"`{self.name}` runs {ops} operator(s), fewer than {self.min_ops}: a graph of it would not gain "
            f"(graphtree graphed it as a part of a module that cannot be graphed whole)"
        )

    def too_small(self) -> bool:
        """Every warm-up so far ran too few operators for a graph to gain (see :meth:`size_reason`)."""
        return self._small and not self._big_enough
