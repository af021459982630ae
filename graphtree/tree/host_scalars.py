"""Host scalars among a recording's inputs: 0-dim CPU tensors and Python numbers, read from device
placeholders that each replay fills, computing what eager computes with them.

Eagerly, ``x * s`` with ``s`` a Python number or a 0-dim CPU tensor takes TensorIterator's
*CPU-scalar* path: the kernel gets ``s`` as an argument, read in the operation's math type (float
for float16 and bfloat16), and a division by it multiplies by its reciprocal. A graph cannot take a
new argument per replay, so a recording reads ``s`` from a 0-dim CUDA placeholder, which a kernel
reads as an ordinary operand: cast to ``x``'s dtype first, divided by exactly. Measured on an H100
(torch 2.11): ``x_half * s`` differed from eager for ``s = 0.3``, and ``x / s`` can differ in the
last bit in float32.

:class:`HostScalars`, a dispatch mode active while such a call is captured, gives each operator
that reads a placeholder eager's CPU-scalar arithmetic: ``add``, ``sub``, ``mul`` and ``div`` (and
their in-place forms) compute in the math type with the scalar converted as eager converts it, a
division as a product with the reciprocal; comparisons compare in the common dtype. Any other
operator that reads a placeholder is passed through only where the two paths agree (a 0-dim CPU
tensor, no float16/bfloat16 operand, no operator that picks its kernel by the scalar's value, such
as ``pow``); elsewhere the capture stops with the reason (:class:`ScalarEscapes`).

**Python numbers** (issue 45, item 3). A float or int argument is keyed by its value unless the
function only uses it as an operand of that arithmetic. :class:`Numbers` (one per graphed callable)
keys such an argument by type, and a recording tries it as a device scalar:

- Its warm-up runs with the number itself, under a log-only :class:`HostScalars` that notes every
  operator and where each takes a value equal to the number (the dispatcher reads numbers in C: a
  dim, a size, a fill value show only there).
- Its capture passes the placeholder under :class:`HostScalars`, which notes the operators in the
  order eager calls them, the one taking the number marked.
- The two lists must be equal: a branch on ``isinstance(t, float)`` takes another path with a tensor.

Anything else keys that argument by value from then on, with the reason in ``describe()``.

Example::

    numbers = Numbers()
    numbers.rekey(call)            # floats and ints keyed by type where they may be device scalars
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from graphtree import _torch

__all__ = ["NUMBER", "HostScalars", "Numbers", "ScalarEscapes", "describe_numbers", "number_part"]

NUMBER = "number"
"""The stride slot of a key part ``((), dtype, NUMBER)``: a Python number read as a device scalar."""

_REDUCED = (torch.float16, torch.bfloat16)
_ARITH = frozenset({"add", "sub", "mul", "div"})
_COMPARE = frozenset({"lt", "le", "gt", "ge", "eq", "ne"})
_REFLECT = {"lt": "gt", "gt": "lt", "le": "ge", "ge": "le", "eq": "eq", "ne": "ne"}
# operators whose CUDA kernel for a CPU scalar is chosen or computed by its value
_BY_VALUE = frozenset({"pow", "float_power", "floor_divide", "div", "divide", "true_divide"})
_HOST_READS = frozenset({"_local_scalar_dense", "item"})
# a division by a CPU scalar takes the reciprocal in double from torch 2.11 (seen on the H100; before,
# in the math type, unverified on a GPU here: such a division is not emulated there)
_DIV_IN_DOUBLE = _torch.TORCH_VERSION[:2] >= (2, 11)
_NUMBER_TYPES = frozenset({float, int})
_INT64 = (-(2**63), 2**63 - 1)  # (an int past it is keyed by value: an int64 placeholder cannot hold it)
_MAX_WARM_LOGS = 64


class ScalarEscapes(Exception):
    """A host scalar's placeholder reached an operator where it would not compute what eager does;
    ``positions``: the leaves of the Python numbers among them (keyed by value from then on)."""

    def __init__(self, reason: str, positions: Sequence[int] = ()) -> None:
        super().__init__(reason)
        self.positions = tuple(positions)


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
        if owner is not None:
            _owners[owner] = self

    def rekey(self, call: Any) -> None:
        """Key the call's float and int arguments by type where they may be device scalars (not
        ``bool``, not those found to reach Python). Cheap for a call without numbers."""
        leaves = call.leaves
        if _NUMBER_TYPES.isdisjoint(map(type, itertools.islice(leaves, call.n_args))):
            return
        key = list(call.key)
        for i in range(call.n_args):
            x = leaves[i]
            if (
                type(x) in _NUMBER_TYPES
                and i not in self.by_value
                and (type(x) is float or _INT64[0] <= x <= _INT64[1])
            ):
                key[i] = number_part(x)
                if i not in self._names:
                    self._names[i] = _keyword(call.spec, i)
        call.key = tuple(key)

    @staticmethod
    def positions(call: Any) -> list[int]:
        """The leaves of ``call`` read as device scalars (its key says which)."""
        return [i for i in range(call.n_args) if _is_number(call.key[i])]

    def keep_by_value(self, positions: Sequence[int], reason: str) -> None:
        """Key the numbers at ``positions`` by value from now on (the first reason is kept)."""
        for i in positions:
            self.by_value.setdefault(i, reason)

    # --- the warm-up --------------------------------------------------------------------------
    def warmed(self, call: Any, positions: Sequence[int], mode: HostScalars) -> None:
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


def _warm_up_reason(mode: HostScalars, leaf: int) -> str:
    """Why a warm-up keys number ``leaf`` by value ("" if it may be a device scalar)."""
    if leaf in mode.elsewhere:
        return f"{mode.elsewhere[leaf]}, not as an operand of add, sub, mul, div or a comparison"
    if leaf not in mode.operand:
        return "no operator graphtree sees takes it as an operand (it is unused, or used inside compiled code)"
    return ""


def _is_number(part: Any) -> bool:
    return type(part) is tuple and len(part) == 3 and part[2] is NUMBER


class HostScalars(_torch.EagerDispatchMode):
    """While a call is captured: operators that read a host scalar's placeholder compute what eager
    computes with the scalar on the host (see the module's docstring), or raise
    :class:`ScalarEscapes`. With Python numbers among them, ``log`` notes every operator by the
    name eager calls it (``t - x``: eager's ``rsub``, here ``sub``; ``t / x``: eager's
    ``reciprocal`` and ``mul``). Without placeholders (``placeholders`` empty), it only logs: a
    warm-up's list to compare with.
    """

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Compiled code inside the call stays compiled (under a mode that says False, dynamo skips
        the frame for good: a Mistral compiled inside a graphed call then generated other tokens on
        the H100), and this mode sees the compiled artifact's operators."""
        return True

    def __init__(
        self,
        placeholders: dict[int, tuple[int, str]],
        name: str = "the function",
        watched: dict[int, Any] | None = None,
    ) -> None:
        super().__init__()
        self.placeholders = placeholders  # storage address -> (leaf index, NUMBER or "tensor")
        self.name = name
        self.log: list[str] = []
        self._logging = not placeholders or any(kind == NUMBER for _, kind in placeholders.values())
        # a warm-up's numbers (leaf -> value): where the operators it called take them, by value
        self.watched = watched or {}
        self.escaped: ScalarEscapes | None = None  # the first escape (user code may catch it: the capture fails anyway)
        self.operand: set[int] = set()  # leaves seen as the scalar operand of add, sub, mul, div, a comparison
        self.elsewhere: dict[int, str] = {}  # leaves seen as another argument (a dim, a size): the first

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        packet = func.overloadpacket.__name__
        hits = self._hits(args, kwargs) if self.placeholders else []
        if not hits:
            if self._logging:  # (an operator taking a watched number as its operand: marked, as a capture marks
                operand = bool(self.watched) and self._note_numbers(packet, args, kwargs)  # one reading a placeholder)
                self.log.append(("sub" if packet == "rsub" else packet) + ("@" if operand else ""))
            return self.run(func, args, kwargs)
        with torch.autocast("cuda", enabled=False):  # (autocast ran above this mode already)
            return self._compute(func, packet, args, kwargs, hits)

    def _note_numbers(self, packet: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Where this operator takes a watched number (by value and type: the dispatcher hands it a
        plain one): as the scalar operand of the arithmetic a device scalar can stand in for, or
        otherwise (a dim, a size, a fill value). Returns whether it took one as its operand."""
        base = packet[:-1] if packet.endswith("_") else packet
        arithmetic = base in _ARITH or base in _COMPARE or base == "rsub"
        operand = False
        for pos, a in enumerate((*args, *kwargs.values())):
            for v in a if isinstance(a, (list, tuple)) else (a,):
                if type(v) not in _NUMBER_TYPES:
                    continue
                for leaf, value in self.watched.items():
                    if type(v) is type(value) and v == value:
                        if arithmetic and pos == 1 and not isinstance(a, (list, tuple)):
                            self.operand.add(leaf)
                            operand = True
                        else:
                            self.elsewhere.setdefault(leaf, f"aten::{packet} takes it as argument {pos}")
        return operand

    def _hits(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[int, int, str]]:
        found = []
        for pos, a in enumerate((*args, *kwargs.values())):
            if isinstance(a, torch.Tensor) and a.dim() == 0 and a.layout is torch.strided:
                got = self.placeholders.get(a.untyped_storage().data_ptr())
                if got is not None:
                    found.append((pos, *got))
        return found

    def _escape(self, hits: list[tuple[int, int, str]], what: str) -> ScalarEscapes:
        leaves = ", ".join(str(leaf) for _, leaf, _ in hits)
        numbers = [leaf for _, leaf, kind in hits if kind == NUMBER]
        escape = ScalarEscapes(
            f"`{self.name}`: its host scalar input {leaves} (a Python number or a 0-dim CPU tensor, which a "
            f"recording reads from a CUDA placeholder) {what}: recorded, it would not compute what eager computes",
            numbers,
        )
        if self.escaped is None:
            self.escaped = escape
        return escape

    def in_outputs(self, out: Any) -> ScalarEscapes | None:
        """An escape if the function returns a Python number's placeholder (eager returns the number)."""
        for t in _torch.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() == 0 and t.layout is torch.strided:
                got = self.placeholders.get(t.untyped_storage().data_ptr())
                if got is not None and got[1] == NUMBER:
                    return self._escape([(0, *got)], "is returned (eager returns the number itself)")
        return None

    def _compute(
        self, func: Any, packet: str, args: tuple[Any, ...], kwargs: dict[str, Any], hits: list[tuple[int, int, str]]
    ) -> Any:
        base = packet[:-1] if packet.endswith("_") else packet
        if base in _HOST_READS:
            raise self._escape(hits, "is read on the host (.item(), float(), a shape or an index)")
        binary = func._overloadname == "Tensor" and len(args) == 2 and set(kwargs) <= {"alpha"} and len(hits) == 1
        if binary and (base in _ARITH or (base in _COMPARE and base == packet)):
            pos, _, kind = hits[0]
            other, ph = args[1 - pos], args[pos]
            if isinstance(other, torch.Tensor) and other.device == ph.device and not other.is_complex():
                out = _cpu_scalar_op(base, packet != base, args, pos, kind, kwargs.get("alpha", 1))
                if out is not None:
                    if self._logging:
                        self.log.extend(_eager_names(packet, pos, kind))
                    return out
            raise self._escape(hits, f"reaches aten::{packet} {_why_not(other)}")
        if base in _ARITH | {"rsub"} and kwargs.get("alpha", 1) not in (1, -1):  # (add.out, rsub: as above)
            raise self._escape(hits, f"reaches aten::{packet} with an alpha other than 1 or -1")
        if any(kind == NUMBER for _, _, kind in hits):
            raise self._escape(
                hits,
                f"reaches aten::{packet} (a Python number is read as a device scalar by add, sub, mul, div and "
                "comparisons only)",
            )
        if base in _BY_VALUE:
            raise self._escape(hits, f"reaches aten::{packet}, whose CUDA kernel eager picks by the scalar's value")
        tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))]
        if sum(isinstance(t, torch.Tensor) for t in tensors) == len(hits):
            raise self._escape(
                hits, f"reaches aten::{packet} on its own (eager computes that on the CPU, in a CPU kernel)"
            )
        for a in (*args, *kwargs.values()):
            if isinstance(a, torch.Tensor) and a.dtype in _REDUCED:
                dtype = str(a.dtype).replace("torch.", "")
                raise self._escape(hits, f"reaches aten::{packet} with a {dtype} tensor, where eager reads it in float")
        return self.run(func, args, kwargs)


def _why_not(other: Any) -> str:
    if not isinstance(other, torch.Tensor):
        return f"with a {type(other).__name__} (eager computes that on the host)"
    return "with a complex tensor, one on another device, an alpha other than 1 or -1, or into a dtype eager refuses"


def _eager_names(packet: str, pos: int, kind: str) -> list[str]:
    """The operators eager calls for a host scalar at argument ``pos`` of ``packet``, as a log names
    them: for a Python number, the one taking it marked ``@`` and Python's reflected operators
    followed (``t < x`` is ``x > t``, ``t - x`` is ``rsub``, ``t / x`` is ``x.reciprocal() * t``)."""
    if kind != NUMBER:
        return [packet]
    if pos == 1:
        return [packet + "@"]
    if packet in _COMPARE:
        return [_REFLECT[packet] + "@"]
    if packet == "div":
        return ["reciprocal", "mul@"]
    return [packet + "@"]


def _cpu_scalar_op(base: str, inplace: bool, args: tuple[Any, ...], pos: int, kind: str, alpha: Any) -> Any:
    """``base`` of ``args`` (the placeholder at ``pos``) as eager's CPU-scalar path computes it, or
    None where that is not known to be equal (an ``alpha`` other than 1 or -1 with floats, an in-place
    operation on the placeholder or into a dtype eager refuses)."""
    ph: torch.Tensor = args[pos]
    other: torch.Tensor = args[1 - pos]
    if inplace and pos == 0:
        return None
    # eager's common dtype: a Python number promotes as a wrapped scalar, a 0-dim tensor as one
    common = torch.result_type(other, (1.0 if ph.is_floating_point() else 1) if kind == NUMBER else ph)
    if base == "div" and not (common.is_floating_point or common.is_complex):
        common = torch.get_default_dtype()  # (true division)
    if common.is_complex:
        return None
    if base in _COMPARE:
        return _call(base, _as(args[0], common), _as(args[1], common))
    floating = common.is_floating_point
    if base in ("add", "sub") and floating and alpha not in (1, -1):
        return None
    if inplace and not torch.can_cast(common, other.dtype):
        return None
    math = torch.float32 if common in _REDUCED else common
    if base == "div" and pos == 0 and kind == NUMBER:  # `t / x`: eager's x.reciprocal() * t
        r = torch.reciprocal(other)
        return _cpu_scalar_op("mul", False, (r, ph), 1, kind, 1)
    x, s = _as(other, math), _as(ph, math)
    if base == "div" and pos == 1 and floating:
        # eager multiplies by the reciprocal, taken on the host in double and rounded to the math
        # type (BinaryDivTrueKernel.cu's high_prec_t since pytorch#169507: measured on the H100,
        # x / 2.2 in float32 is x * float(1 / 2.2), one bit from x * (1f / 2.2f))
        if not _DIV_IN_DOUBLE:
            return None
        out = torch.mul(x, _as(torch.reciprocal(_as(ph, torch.float64)), math))
    elif base == "div" and pos == 0 and kind != NUMBER:  # `s / x`: eager reads s in x's dtype first
        out = torch.div(_as(_as(ph, common), math), x)
    else:
        a, b = (s, x) if pos == 0 else (x, s)
        out = _call(base, a, b) if base in ("mul", "div") else _call(base, a, b, alpha=alpha)
    if inplace:
        return other.copy_(out)
    return _as(out, common)


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _call(name: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    out: torch.Tensor = getattr(torch, name)(*args, **kwargs)
    return out


def placeholders_of(call: Any, graph_leaves: Sequence[Any], host: Sequence[int]) -> dict[int, tuple[int, str]]:
    """The placeholders of a capture's host scalars: storage address -> (leaf index, kind)."""
    return {
        graph_leaves[i].untyped_storage().data_ptr(): (i, NUMBER if _is_number(call.key[i]) else "tensor") for i in host
    }
