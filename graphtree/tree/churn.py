"""Noticing a graphed callable whose signatures keep changing, so that it costs what eager costs.

A call that no recording fits is warmed up first: it runs eagerly under graphtree's checks (torch's
sync debug mode, dispatch modes that watch writes and allocations), which cost a few times the
call itself for small kernels. Worth it when the signature comes again and is recorded; wasted
when every call brings a new one (a batch size or a sequence length that changes on each call, a
``DynamicCache`` that grows by a token per step): measured on an H100, a 20-layer MLP fed a new
batch size on every call took 2.04 ms graphed against 0.76 ms eager (issue 27).

:class:`Churn` counts the warm-ups of a callable since its last recording. After ``limit`` of them
in a row, a signature never met before runs plain eager, without the checks (``stats()`` counts
it, with the reason); one met before (shapes settling) is warmed up and recorded as usual, which
ends the run of warm-ups. Only calls that no recording fits pay the bookkeeping: replays do not.

Example::

    churn = Churn()
    if churn.skip(key):          # before warming a call up
        run_eagerly()
"""

from __future__ import annotations

from typing import Any

LIMIT = 16
"""Warm-ups in a row without a recording before new signatures run plain eager. (A left-padded
Mistral batch meets a new signature at each of a ``generate()``'s decode steps past its sliding
window, and records them at the next ``generate()``: below its length, the rule would turn that into
eager runs.) 4 was tried in issue 45 (a warm-up costs about 4.5x the call it checks): a callable with
five or more signatures met in turn (a counter argument, micro-batches of several sizes) then began
replaying a round later, which the GPU suite caught (H100, ``test_real_paths_gpu.py``,
``test_train_step_gpu.py``); kept at 16 until the rule tells churn from a bounded set of signatures."""

KEEP = 1024
"""Signatures remembered per callable (the oldest is forgotten first)."""


class Churn:
    """The run of warm-ups of one graphed callable, and the signatures it has met (see the module)."""

    def __init__(self, limit: int = LIMIT, keep: int = KEEP) -> None:
        self.limit = limit
        self.keep = keep
        self.streak = 0  # warm-ups since the last recording
        self._seen: dict[Any, None] = {}  # signatures met, oldest first

    def skip(self, key: Any) -> bool:
        """Whether a call of signature ``key``, which no recording fits, should run eagerly without
        a warm-up: the callable is churning and has never met ``key``. Notes ``key`` as met."""
        met = key in self._seen
        if met:
            del self._seen[key]  # (moved to the newest end)
        self._seen[key] = None
        if len(self._seen) > self.keep:
            del self._seen[next(iter(self._seen))]
        return not met and self.streak >= self.limit

    def warmed_up(self) -> None:
        """A warm-up ran."""
        self.streak += 1

    def recorded(self) -> None:
        """A recording was made: the signatures have settled."""
        self.streak = 0

    def reason(self, name: str) -> str:
        """The eager reason ``stats()`` counts for a skipped call."""
        return (
            f"`{name}` meets a new signature on almost every call ({self.limit} warm-ups in a row "
            f"without a recording): new signatures run eagerly, without graphtree's checks, until one "
            f"comes again"
        )
