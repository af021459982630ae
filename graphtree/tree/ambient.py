"""The state a call computes under without being passed it: part of every recording's key.

A CUDA graph freezes the kernels its capture chose. Which kernels torch chooses depends on more
than the arguments: autocast turns a matmul into a bf16 one, the default dtype decides what
``torch.ones(3)`` makes, TF32 and the cuDNN and SDPA switches pick other kernels, deterministic
mode others again. A recording made under one setting and replayed under another would return
what the other setting computes: silently wrong. So :func:`state` is read on every graphed call
and appended to the call's key: a change records again (a new branch), never replays the old one.

:func:`state` is ``(bits, default dtype, autocast dtype or None)``. ``bits`` packs the switches
below, one or two bits each (``BITS`` names them, lowest first). graphtree's native helpers
compute the same tuple in one C++ call (``_native.ambient``: 0.27 µs against 2.4 µs for this Python
twin on the CI machine's CPU); the two are checked equal before the native one is used, so a process
that starts on the twin keeps its recordings when the helpers arrive.

What is not tracked, and why, is listed in ``DESIGN.md`` beside this file.

Example::

    from graphtree.tree import ambient

    before = ambient.state()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert ambient.state() != before
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from graphtree import _native, _torch

log = logging.getLogger("graphtree")

BITS = (
    "grad mode",
    "inference mode",
    "autocast (cuda)",
    "deterministic algorithms",
    "deterministic fill of uninitialized memory",
    "cuDNN enabled",
    "cuDNN benchmark",
    "cuDNN deterministic",
    "cuDNN TF32",
    "cuBLAS TF32",
    "cuBLAS fp16 accumulation",
    "SDPA flash",
    "SDPA memory-efficient",
    "SDPA math",
    "SDPA cuDNN",
    "SDPA math fp16/bf16 reduction",
    "float32 matmul precision (2 bits: highest, high, medium)",
    "",
    "cuBLAS fp16 reduced-precision reduction (2 bits)",
    "",
    "cuBLAS bf16 reduced-precision reduction (2 bits)",
    "",
    "preferred BLAS backend (3 bits)",
    "",
    "",
    "torch's fp32_precision API in use: the legacy TF32 getters refuse (then bits 26-31 follow)",
    "fp32_precision of cuBLAS matmul (2 bits: none, ieee, tf32, bf16)",
    "",
    "fp32_precision of cuDNN convolutions (2 bits)",
    "",
    "fp32_precision of cuDNN RNNs (2 bits)",
    "",
)
"""What each bit of ``state()[0]`` is, lowest first (the native helper packs them the same way)."""

_PRECISION = {"highest": 0, "high": 1, "medium": 2}
_FP32 = {"none": 0, "ieee": 1, "tf32": 2, "bf16": 3}  # (torch.backends' fp32_precision values)
_NEW_API = 25  # the bit that says the fp32_precision API is in use (the legacy getters raise)


def _reduction(v: Any) -> int:
    """``CuBLASReductionOption`` as an int, from the Python getter's ``(allow_reduced, allow_splitk)``."""
    if isinstance(v, tuple):
        allow, splitk = v
        return 0 if allow else (1 if splitk else 2)
    return 0 if v else 1


_FLAGS = tuple(
    _torch.switch_getter(name)
    for name in (  # BITS 3 to 15, in order
        "_get_deterministic_algorithms",
        "_get_deterministic_fill_uninitialized_memory",
        "_get_cudnn_enabled",
        "_get_cudnn_benchmark",
        "_get_cudnn_deterministic",
        "_get_cudnn_allow_tf32",
        "_get_cublas_allow_tf32",
        "_get_cublas_allow_fp16_accumulation",
        "_get_flash_sdp_enabled",
        "_get_mem_efficient_sdp_enabled",
        "_get_math_sdp_enabled",
        "_get_cudnn_sdp_enabled",
        "_get_math_sdp_allow_fp16_bf16_reduction",
    )
)


def _python_state(
    grad: Callable[[], bool] = torch.is_grad_enabled,
    inference: Callable[[], bool] = torch.is_inference_mode_enabled,
    autocast: Callable[[str], bool] = torch.is_autocast_enabled,
    autocast_dtype: Callable[[str], torch.dtype] = torch.get_autocast_dtype,
    default_dtype: Callable[[], torch.dtype] = torch.get_default_dtype,
    flags: tuple[Callable[[], Any], ...] = _FLAGS,
    precision: Callable[[], str] = _torch.float32_matmul_precision,
    fp16: Callable[[], Any] = _torch.cublas_fp16_reduction,
    bf16: Callable[[], Any] = _torch.cublas_bf16_reduction,
    blas: Callable[[], Any] = _torch.preferred_blas,
) -> tuple[int, torch.dtype, torch.dtype | None]:
    """:func:`state` computed in Python (the native helper's twin).

    With torch's ``fp32_precision`` API in use (``torch.backends.cuda.matmul.fp32_precision =
    "tf32"``, torch 2.9 and later), its legacy TF32 getters raise ("mix of the legacy and new
    APIs"): those bits are then 0, and bit 25 and the new API's settings (bits 26-31) say what the
    native helper, which reads the legacy ones, cannot."""
    on = autocast("cuda")
    bits = grad() | inference() << 1 | on << 2
    refused = False
    shift = 3
    for f in flags:
        try:
            bits |= bool(f()) << shift
        except RuntimeError:  # (a TF32 getter, under the fp32_precision API)
            refused = True
        shift += 1
    try:
        bits |= _PRECISION[precision()] << 16
    except RuntimeError:
        refused = True
    bits |= _reduction(fp16()) << 18 | _reduction(bf16()) << 20 | int(blas()) << 22
    if refused:
        bits |= 1 << _NEW_API | _fp32_precisions() << _NEW_API + 1
    return bits, default_dtype(), autocast_dtype("cuda") if on else None


def _fp32_precisions() -> int:
    """The ``fp32_precision`` of cuBLAS matmul, cuDNN convolutions and cuDNN RNNs, 2 bits each."""
    b: Any = torch.backends  # (untyped in torch's stubs)
    found = (b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.cudnn.rnn.fp32_precision)
    return sum(_FP32.get(v, 0) << 2 * i for i, v in enumerate(found))


def state() -> tuple[int, torch.dtype, torch.dtype | None]:
    """The ambient state of this thread as a hashable key (see the module's docstring)."""
    native = _native.loaded
    if native is not None:
        try:
            if _checked is not native:
                _check(native)
            if _checked is native:
                found: tuple[int, torch.dtype, torch.dtype | None] = native.ambient()
                return found
        except RuntimeError:  # torch's fp32_precision API in use: its legacy TF32 getters refuse
            pass
    return _python_state()


_checked: object = None  # the native module whose ambient() agreed with the twin; False: one disagreed


def _check(native: Any) -> None:
    """Use the native ``ambient()`` only if it agrees with the Python twin (once per module): keys
    made before the helpers loaded must equal those made after, or recordings would be made again."""
    global _checked
    if _checked is False:
        return
    with torch.no_grad():  # a second state, with a switch off the process's own
        same = native.ambient() == _python_state()
    if same and native.ambient() == _python_state():
        _checked = native
    else:
        _checked = False
        log.warning("graphtree: the native ambient() disagrees with its Python twin; using the twin")


def describe(s: tuple[int, torch.dtype, torch.dtype | None]) -> str:
    """``state()`` in words: the switches that are on, the default dtype and autocast's dtype."""
    bits, dtype, cast = s
    on = [name for i, name in enumerate(BITS) if name and i < 16 and bits >> i & 1]
    if not bits >> _NEW_API & 1:
        on.append(f"float32 matmul precision {list(_PRECISION)[bits >> 16 & 3]}")
    else:  # (torch's fp32_precision API: what the legacy getters could not say)
        names = list(_FP32)
        for i, what in enumerate(("cuBLAS matmul", "cuDNN conv", "cuDNN RNN")):
            on.append(f"fp32_precision of {what} {names[bits >> _NEW_API + 1 + 2 * i & 3]}")
    return ", ".join([*on, f"default dtype {dtype}", *([f"autocast dtype {cast}"] if cast is not None else [])])
