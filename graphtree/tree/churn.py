"""Noticing a graphed callable whose signatures keep changing, so that it costs what eager costs.

A call that no recording fits is warmed up first: it runs eagerly under graphtree's checks (torch's
sync debug mode, dispatch modes that watch writes and allocations), which cost a few times the
call itself for small kernels. Worth it when the signature comes again and is recorded; wasted
when every call brings a new one (a batch size or a sequence length that changes on each call, a
``DynamicCache`` that grows by a token per step): measured on an H100, a 20-layer MLP fed a new
batch size on every call took 2.04 ms graphed against 0.76 ms eager (issue 27).

:class:`Churn` counts the warm-ups of signatures the callable had never met, since its last
recording. After ``limit`` of them in a row, a signature never met before runs plain eager, without
the checks (``stats()`` counts it, with the reason); one met before (shapes settling) is warmed up
and recorded as usual, which ends the run of warm-ups. A warm-up of a signature met before (the
same key warmed up again: state it allocated, a step's gradients made anew) does not count: churn
is new signatures, not warm-ups. Only calls that no recording fits pay the bookkeeping: replays do not.

Once churning, a call of CUDA tensors alone whose tensors (shapes, dtypes, strides, device) the
callable never met runs eagerly before it is read, keyed or taken to its tree (``_eager_now`` in
tree/graphed.py, which asks :meth:`Churn.new_tensors`): no recording can fit it, and the Python
path's read, key, lookup and step were most of what a churning call added to eager (issue 45, item
6: a 20-layer MLP through that path 1.10x eager, its own time inside the function 1.01x, H200). Its
stream is ordered after the tree's last call as the tree orders its own. A call whose tensors were
met before takes the Python path, which warms it up (shapes settling) as above.

Example::

    churn = Churn()
    if churn.skip(key):          # before warming a call up
        run_eagerly()
"""

from __future__ import annotations

from typing import Any

import torch

from graphtree.tree.readable import PLAIN_TYPES as _PLAIN_TYPES

LIMIT = 8
"""Warm-ups of never-met signatures in a row without a recording before new signatures run plain
eager. A bounded set of more signatures than this, met in turn, replays a round later than it could
(its signatures past the limit run eagerly in the first round, warm up in the second); churn pays
this many warm-ups. Issue 45 measured 4 (a warm-up costs about 4.5x the call it checks: H100, the
MLP of ``benchmarks/churn.py`` at 0.93x eager) but then counted every warm-up, and the GPU suite
caught a step's micro-batches, the same signature warmed up again, taken for churn; 16 before."""

KEEP = 1024
"""Signatures remembered per callable (the oldest is forgotten first)."""


class Churn:
    """The run of warm-ups of one graphed callable, and the signatures it has met (see the module)."""

    def __init__(self, limit: int = LIMIT, keep: int = KEEP) -> None:
        self.limit = limit
        self.keep = keep
        self.streak = 0  # warm-ups of never-met signatures since the last recording
        self._seen: dict[Any, None] = {}  # signatures met, oldest first
        self._tensors: dict[Any, None] = {}  # (parts, device) of the calls of tensors alone among them
        self._new = True  # whether the signature skip() saw last was never met before
        self._keys: tuple[Any, Any] = (None, None)  # the last two signatures skip() saw, for the reason
        self._reason: str | None = None  # the reason, fixed for a run (stats() counts one, logged once)

    def skip(self, key: Any, tensors: Any = None) -> bool:
        """Whether a call of signature ``key``, which no recording fits, should run eagerly without
        a warm-up: the callable is churning and has never met ``key`` (nor, for a call of tensors
        alone, its ``tensors``: ``(parts, device)``, met by :meth:`new_tensors`). Notes both as met."""
        met = key in self._seen or (tensors is not None and tensors in self._tensors)
        self._new = not met
        self._keys = (self._keys[1], key)
        _note(self._seen, key, self.keep)
        if tensors is not None:
            _note(self._tensors, tensors, self.keep)
        return not met and self.streak >= self.limit

    def new_tensors(self, tensors: Any) -> bool:
        """Whether the callable never met a call of ``tensors`` (``(parts, device)`` of a call of
        tensors alone); notes them as met."""
        met = tensors in self._tensors
        _note(self._tensors, tensors, self.keep)
        return not met

    def warmed_up(self) -> None:
        """A warm-up ran (of the signature :meth:`skip` saw last; a callable whose ranks decide
        together calls no ``skip``: every warm-up counts)."""
        if self._new:
            self.streak += 1
        self._new = True

    def recorded(self) -> None:
        """A recording was made: the signatures have settled."""
        self.streak = 0
        self._reason = None

    def reason(self, name: str) -> str:
        """The eager reason ``stats()`` counts for a skipped call, with what changed between the
        last two signatures where it can say (a shape, a value, a global the code reads), the same
        for the whole run (one line in ``stats()`` and in the log)."""
        if self._reason is None:
            what = _what_changes(*self._keys)
            self._reason = (
                f"`{name}` meets a new signature on almost every call ({self.limit} warm-ups of new signatures "
                f"in a row without a recording): new signatures run eagerly, without graphtree's checks, "
                f"until one comes again" + (f" (first: {what})" if what else "")
            )
        return self._reason


def _note(seen: dict[Any, None], key: Any, keep: int) -> None:
    """``key`` as met last in ``seen`` (the oldest forgotten past ``keep``)."""
    seen.pop(key, None)  # (moved to the newest end)
    seen[key] = None
    if len(seen) > keep:  # (another thread calling the callable may have taken the oldest)
        seen.pop(next(iter(seen), None), None)


def _what_changes(a: Any, b: Any) -> str:
    """What differs first between signatures ``a`` and ``b`` (call keys), in words, or ""."""
    if not isinstance(a, tuple) or not isinstance(b, tuple) or len(a) != len(b):
        return ""
    for i, (pa, pb) in enumerate(zip(a, b)):
        if pa == pb or not (isinstance(pa, tuple) and isinstance(pb, tuple)) or len(pa) != len(pb):
            continue
        if pa and pa[0] == "reads":  # plain values the code reads (tree/reach.py): (name, type, value)
            for (n, ta, va), (_, tb, vb) in zip(pa[1], pb[1]):
                if ta is tb and va == vb:
                    continue
                if ta not in _PLAIN_TYPES or tb not in _PLAIN_TYPES:  # (an object, keyed by identity)
                    return f"`{n}`, which its code reads, is rebound to another object"
                number = ta in (int, float)
                hint = "; pass it as an argument: a number used only as a tensor operand is a device scalar"
                return f"`{n}`, which its code reads, changes: {va!r} -> {vb!r}" + (hint if number else "")
        elif len(pa) in (3, 4) and isinstance(pa[1], torch.dtype) and isinstance(pa[0], tuple):  # a tensor
            if pa[0] != pb[0]:
                return f"the shape of tensor argument {i} changes: {list(pa[0])} -> {list(pb[0])}"
            return f"tensor argument {i} changes dtype or strides"
        elif len(pa) == 2 and isinstance(pa[0], type):  # a plain value
            return f"argument {i} changes: {pa[1]!r} -> {pb[1]!r}"
    return ""
