"""Python numbers among a graphed callable's arguments: keyed by type while they may be device
scalars, by value once a warm-up or a capture shows they are used otherwise, and why.

A float or int argument is keyed by its value unless the function only uses it as an operand of
``+ - * /`` or a comparison with tensors. :class:`Numbers` (one per graphed callable) keys such an
argument by type (``((), float64 | int64, NUMBER)``: a placeholder each replay fills), and a
recording tries it. An int is keyed by its value until the argument comes with another, as
``torch.compile`` specialises ints until one changes: an int is more often a size, a count or a
flag than an operand, and one equal to a constant of the function (``n=2`` beside ``x * 2``) is
taken for an operand by the warm-up, whose capture then fails (PyTorch's
``test_dynamic_warmup``).

- its warm-up runs with the number itself, under a log-only
  :class:`~graphtree.tree.host_scalars.HostScalars` that notes every operator and where each takes
  a value equal to the number (the dispatcher reads numbers in C: a dim, a size, a fill value show
  only there): :meth:`Numbers.warmed`;
- its capture passes the placeholder under ``HostScalars``, which computes what eager computes or
  stops the capture, and notes the operators in the order eager calls them;
- the two lists must be equal (:meth:`Numbers.compare`): a branch on ``isinstance(t, float)`` takes
  another path with a tensor.

Anything else keys that argument by value from then on, with the reason in ``describe()``
(:func:`describe_numbers`). ``bool`` is always a value, and so is an int past int64.

Example::

    numbers = Numbers(owner=gc.id)
    numbers.rekey(call)            # floats and ints keyed by type where they may be device scalars
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

__all__ = ["NUMBER", "NUMBER_TYPES", "Numbers", "describe_numbers", "is_number", "number_part"]


class WarmUpLog(Protocol):
    """What a warm-up's log-only ``HostScalars`` found (tree/host_scalars.py)."""

    log: list[str]  # the operators it called, those taking a watched number as operand marked "@"
    operand: set[int]  # leaves an operator took as the scalar operand of its arithmetic
    elsewhere: dict[int, str]  # leaves an operator took otherwise: where, first


NUMBER = "number"
"""The stride slot of a key part ``((), dtype, NUMBER)``: a Python number read as a device scalar."""

NUMBER_TYPES = frozenset({float, int})
"""The types of the Python numbers that may be device scalars (not ``bool``, a subclass of ``int``)."""
_INT64 = (-(2**63), 2**63 - 1)  # (an int past it is keyed by value: an int64 placeholder cannot hold it)
_MAX_WARM_LOGS = 64


def _fits_int64(x: int) -> bool:
    return _INT64[0] <= x <= _INT64[1]


def number_part(x: float | int) -> tuple[Any, ...]:
    """The key part of a Python number read as a device scalar: a float64 or int64 placeholder."""
    return ((), torch.float64 if type(x) is float else torch.int64, NUMBER)


class Numbers:
    """A graphed callable's Python number arguments: which are keyed by value, and why.

    ``owner``: the graphed callable's id, under which :func:`describe_numbers` finds it."""

    def __init__(self, owner: int | None = None) -> None:
        self.by_value: dict[int, str] = {}  # leaf index -> why it is keyed by value
        self.device: set[int] = set()  # leaf indices recorded as device scalars at least once
        self._warm_logs: dict[Any, list[str]] = {}  # call key -> the operators its last warm-up called
        self._names: dict[int, str] = {}  # leaf index -> the keyword it was passed by, if one
        self._ints: dict[int, int | None] = {}  # leaf index -> the one value an int argument had, None once it changed
        if owner is not None:
            _owners[owner] = self

    def rekey(self, call: Any) -> None:
        """Key the call's float and int arguments by type where they may be device scalars (not
        ``bool``, not those found to reach Python). For a call that has numbers (``call.numbers``:
        ``read_call`` looked)."""
        leaves = call.leaves
        key = list(call.key)
        for i in range(call.n_args):
            x = leaves[i]
            t = type(x)
            if t not in NUMBER_TYPES or i in self.by_value:
                continue
            if i not in self._names:
                self._names[i] = _keyword(call.spec, i)
            if t is float or self._int_changed(i, x):
                key[i] = number_part(x)
        call.key = tuple(key)

    def _int_changed(self, i: int, x: int) -> bool:
        """Whether int argument ``i`` has come with another value than ``x`` (and fits an int64)."""
        seen = self._ints.setdefault(i, x)
        if seen is not None and seen != x:
            self._ints[i] = seen = None
        return seen is None and _fits_int64(x)

    @staticmethod
    def positions(call: Any) -> list[int]:
        """The leaves of ``call`` read as device scalars (its key says which)."""
        return [i for i in range(call.n_args) if is_number(call.key[i])]

    def keep_by_value(self, positions: Sequence[int], reason: str) -> None:
        """Key the numbers at ``positions`` by value from now on (the first reason is kept)."""
        for i in positions:
            self.by_value.setdefault(i, reason)

    # --- the warm-up --------------------------------------------------------------------------
    def warmed(self, call: Any, positions: Sequence[int], mode: WarmUpLog) -> None:
        """After a warm-up under ``mode`` (a log-only :class:`HostScalars` watching the numbers at
        ``positions``): a number an operator took other than as an arithmetic operand, or that none
        took as one, is keyed by value from now on, this call's key too (the warm-up counts for that
        signature); the operators it called are kept for the capture to compare."""
        why = {i: _warm_up_reason(mode, i) for i in positions}
        demoted = [i for i in positions if why[i]]
        if demoted:
            key = list(call.key)
            for i in demoted:
                self.keep_by_value([i], why[i])
                x = call.leaves[i]
                key[i] = (type(x), x)
            call.key = tuple(key)
        if len(self._warm_logs) >= _MAX_WARM_LOGS:
            self._warm_logs.pop(next(iter(self._warm_logs)))
        self._warm_logs[call.key] = mode.log

    def compare(self, key: Any, log: list[str], positions: Sequence[int]) -> str | None:
        """After a capture under :class:`HostScalars`: why its operators are not its warm-up's
        (the numbers are then keyed by value), or None (they are device scalars)."""
        warm = self._warm_logs.get(key)  # (kept: a re-recording, another place or thread compares again)
        reason = None
        if warm is None:
            reason = "no warm-up of this signature noted its operators"
        elif warm != log:
            at = next((k for k, (a, b) in enumerate(zip(warm, log)) if a != b), min(len(warm), len(log)))
            seen = (warm[at] if at < len(warm) else "nothing", log[at] if at < len(log) else "nothing")
            reason = (
                f"given a tensor in its place, the function calls other operators "
                f"(aten::{seen[1]} where eager calls aten::{seen[0]})"
            )
        if reason is not None:
            self.keep_by_value(positions, reason)
        else:
            self.device.update(positions)
        return reason

    def describe(self) -> list[str]:
        """One line per number argument: read as a device scalar, or keyed by value and why."""
        lines = []
        for i in sorted(self.device - set(self.by_value)):
            lines.append(f"{self._name(i)}: a device scalar, filled on each call")
        for i, why in sorted(self.by_value.items()):
            lines.append(f"{self._name(i)}: keyed by value ({why})")
        for i, seen in sorted(self._ints.items()):
            if seen is not None and i not in self.by_value:
                lines.append(f"{self._name(i)}: an int keyed by its value ({seen}) until it comes with another")
        return lines

    def _name(self, i: int) -> str:
        name = self._names.get(i, "")
        return f"argument {i} ({name}=)" if name else f"argument {i}"


_owners: weakref.WeakValueDictionary[int, Numbers] = weakref.WeakValueDictionary()


def describe_numbers(owner: int) -> list[str]:
    """What :meth:`Numbers.describe` says of graphed callable ``owner``'s numbers ([] if none)."""
    numbers = _owners.get(owner)
    return numbers.describe() if numbers is not None else []


def _keyword(spec: Any, i: int) -> str:
    """The keyword leaf ``i`` was passed by, for a flat call with keywords ("" otherwise)."""
    names, n_args = getattr(spec, "names", None), getattr(spec, "n_args", None)
    if names is None or n_args is None or i < n_args:
        return ""
    return str(names[i - n_args])


def _warm_up_reason(mode: WarmUpLog, leaf: int) -> str:
    """Why a warm-up keys number ``leaf`` by value ("" if it may be a device scalar)."""
    if leaf in mode.elsewhere:
        return f"{mode.elsewhere[leaf]}, not as an operand of add, sub, mul, div or a comparison"
    if leaf not in mode.operand:
        return "no operator graphtree sees takes it as an operand (it is unused, or used inside compiled code)"
    return ""


def is_number(part: Any) -> bool:
    return type(part) is tuple and len(part) == 3 and part[2] is NUMBER
