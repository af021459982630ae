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

Python numbers take the same placeholders: :mod:`graphtree.tree.numbers` says which are device
scalars (issue 45, item 3).

Example::

    with HostScalars(placeholders_of(call, graph_leaves, plan.host), "step"):
        out = fn(*args)            # the capture; ScalarEscapes where it cannot compute as eager does
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from graphtree import _torch
from graphtree.tree.numbers import NUMBER, NUMBER_TYPES, is_number

__all__ = ["HostScalars", "ScalarEscapes", "placeholders_of"]

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


class ScalarEscapes(Exception):
    """A host scalar's placeholder reached an operator where it would not compute what eager does;
    ``positions``: the leaves of the Python numbers among them (keyed by value from then on)."""

    def __init__(self, reason: str, positions: Sequence[int] = ()) -> None:
        super().__init__(reason)
        self.positions = tuple(positions)


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
                if type(v) not in NUMBER_TYPES:  # (the dispatcher hands a wrapped Python number over as one)
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
        graph_leaves[i].untyped_storage().data_ptr(): (i, NUMBER if is_number(call.key[i]) else "tensor") for i in host
    }
