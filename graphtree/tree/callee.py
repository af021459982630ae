"""The graphed callable as the tree sees it, and whether this thread runs user code for a tree.

:mod:`graphtree.tree.graphed` makes the callables; :mod:`~graphtree.tree.manager` and
:mod:`~graphtree.tree.recorder` only ask of them what :class:`Callee` lists, so neither imports
``graphed`` (which stands above both).

Example::

    from graphtree.tree.callee import UserCode, user_code

    if UserCode.threads and user_code.active:   # inside another graphed function's warm-up or capture: run inline
        ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from graphtree.tree.churn import Churn
    from graphtree.tree.inputs import Bucketing, Call
    from graphtree.tree.lockstep import Lockstep
    from graphtree.tree.numbers import Numbers
    from graphtree.tree.options import Options
    from graphtree.tree.reach import FreeValues
    from graphtree.tree.training_step import TrainingStep
    from graphtree.tree.verdicts import Verdicts


class Callee(Protocol):
    """What the tree's manager and recorder use of a graphed callable."""

    id: int  # its recordings are keyed (id, signature)
    name: str
    fn: Callable[..., Any]
    options: Options  # what it was made with: max_rerecords, max_break_values, debug...
    bucketing: Bucketing | None
    verdicts: Verdicts  # its signatures given up (with the reasons), and the counts that decide it
    churn: Churn  # its run of warm-ups: new signatures run eagerly while they keep changing
    numbers: Numbers  # its Python number arguments: device scalars, or keyed by value and why
    free: FreeValues  # what it reads besides its arguments: plain values keyed, containers watched

    @property
    def warmup(self) -> int: ...  # eager runs before a new signature is recorded
    def run_eager(self, call: Call, reason: str) -> Any: ...
    def lockstep(self, groups: dict[str, tuple[int, ...]] | None = None) -> Lockstep | None: ...
    def static_tensors(self) -> list[torch.Tensor]: ...
    def module(self) -> torch.nn.Module | None: ...
    def training_step(self) -> TrainingStep | None: ...


class UserCode(threading.local):
    """Per thread: whether the thread runs a graphed function's warm-up or capture right now
    (``active``). ``UserCode.threads``, on the class, counts the threads where it is: every graphed
    call reads that first, as ``UserCode.threads and user_code.active``, since an attribute of a
    ``threading.local`` costs some 500 instructions to read and one of a class a tenth of that.

    Example::

        user_code.active = True   # (UserCode.threads is 1 more until it is set False again)
    """

    threads = 0
    _on = False
    _counting = threading.Lock()

    @property
    def active(self) -> bool:
        return self._on

    @active.setter
    def active(self, on: bool) -> None:
        with UserCode._counting:  # (counted before the flag is set, and after it is cleared)
            if on and not self._on:
                UserCode.threads += 1
                self._on = True
            elif not on and self._on:
                self._on = False
                UserCode.threads -= 1


user_code = UserCode()
"""``user_code.active``: this thread runs user code for a tree; graphed functions called from
there run inline, as part of the outer warm-up or recording (read on every graphed call, after
``UserCode.threads``)."""
