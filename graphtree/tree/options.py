"""The options of :func:`graphtree.graphed`: checked once, kept whole for a copy.

A graphed callable is made with them, and a copy of it (``copy.deepcopy``, pickle, ``torch.save``)
is made again with the same ones and no recording (``GraphedCallable.copy_options``). Checking
them here gives the user a ``ValueError`` naming the option at ``graphed(...)``, not at the first
call, also for ``@graphed(...)`` used as a decorator.

Example::

    Options(warmup=2, buckets=[1, 2, 4])      # fine
    Options(warmup=-1)                         # ValueError: warmup must be a non-negative int, got -1
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from graphtree.tree.inputs import Bucketing
from graphtree.tree.lockstep import LOCKSTEP_TIMEOUT

MAX_VALUES = 8
"""Distinct values one host read may give (``tree/breaks.py``) before the call's signature runs
eagerly: the default of ``graphed(..., max_break_values=)``. A bool has two, a float loss read for
logging a new one on every call: a few recordings, then eager with the reason."""


@dataclasses.dataclass(frozen=True)
class Options:
    """What :func:`graphtree.graphed` was given (its docstring says what each does); ``min_ops``
    is graphtree's own, for the parts it makes (``tree/parts.py``)."""

    buckets: Sequence[int] | None = None
    bucket_dim: int = 0
    warmup: int = 1
    max_rerecords: int = 8
    name: str | None = None
    debug: str | os.PathLike[str] | None = None
    max_break_values: int = MAX_VALUES
    lockstep_timeout: float = LOCKSTEP_TIMEOUT
    parts: bool = True
    min_ops: int = 0

    def __post_init__(self) -> None:
        """Raise ``ValueError`` naming the first option that is not allowed."""
        if self.buckets is not None:
            Bucketing(self.buckets, self.bucket_dim)  # checks both
        for option in ("bucket_dim", "warmup", "max_rerecords", "max_break_values"):
            value = getattr(self, option)
            if type(value) is not int or value < 0:
                raise ValueError(f"{option} must be a non-negative int, got {value!r}")
        timeout = self.lockstep_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"lockstep_timeout must be a positive number of seconds, got {timeout!r}")
        if not isinstance(self.parts, bool):
            raise ValueError(f"parts must be True or False, got {self.parts!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        debug = self.debug
        if debug is not None and (not isinstance(debug, (str, os.PathLike)) or not os.fspath(debug)):
            raise ValueError(f"debug must be a folder (a str or path) to write dumps into, got {debug!r}")

    def as_dict(self) -> dict[str, Any]:
        """The options as keyword arguments (a copy is made with them)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
