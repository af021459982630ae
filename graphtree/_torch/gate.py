"""The version gate of graphtree's use of torch private APIs, and the few helpers every part of
:mod:`graphtree._torch` shares (weak storage references, storage addresses, generator keys).

Everything here is re-exported by :mod:`graphtree._torch`; import it from there.
"""

from __future__ import annotations

import functools
import re
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch

TESTED_TORCH = ((2, 11), (2, 13))
"""Oldest and newest torch (major, minor) whose private APIs graphtree was checked against."""


def _parse_version(v: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", v)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


TORCH_VERSION = _parse_version(torch.__version__)
VERSION_SUPPORTED = TESTED_TORCH[0] <= TORCH_VERSION <= TESTED_TORCH[1]


class PrivateAPIMissing(RuntimeError):
    """A torch private function graphtree relies on does not exist in this torch build."""


_warned_version = False


@functools.cache  # resolved once per name: some are called on every step (invalidate_storage)
def _private(name: str) -> Callable[..., Any]:
    global _warned_version
    if not VERSION_SUPPORTED and not _warned_version:
        _warned_version = True
        warnings.warn(
            f"graphtree is tested with torch {TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to "
            f"{TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]}; torch {torch.__version__}'s private APIs "
            "may behave differently (run the GPU tests: python -m pytest -m gpu)",
            RuntimeWarning,
            stacklevel=3,
        )
    fn = getattr(torch._C, name, None)
    if fn is None:
        raise PrivateAPIMissing(
            f"graphtree needs torch._C.{name}, which torch {torch.__version__} does not have "
            f"(graphtree is tested with torch {TESTED_TORCH[0][0]}.{TESTED_TORCH[0][1]} to "
            f"{TESTED_TORCH[1][0]}.{TESTED_TORCH[1][1]} with CUDA)"
        )
    return fn


def has_private(name: str) -> bool:
    """Whether ``torch._C.<name>`` exists here (used by tests and ``graphtree doctor``)."""
    return getattr(torch._C, name, None) is not None


_strided = torch.strided
_UNSAFE_TAG = getattr(torch.Tag, "cudagraph_unsafe", None)
"""Operators tagged so read host state a graph would freeze (inductor's trees honour it too)."""


weak_ref = cast(Callable[[torch.UntypedStorage], int], torch.UntypedStorage._weak_ref)
"""``weak_ref(storage)``: a weak reference (an int) that must be released with :func:`weak_free`."""
weak_expired = cast(Callable[[int], bool], torch.UntypedStorage._expired)
"""``weak_expired(ref)``: whether no tensor holds the storage any more."""
weak_free: Callable[[int], None] = torch.UntypedStorage._free_weak_ref
"""``weak_free(ref)``: release a weak reference."""
storage_use_count: Callable[[int], int] = torch._C._storage_Use_Count
"""``storage_use_count(ref)``: how many tensors and storage objects hold the storage of a weak
reference (0 once it died): what tells a replay output the caller dropped from one still held
while graphtree keeps a tensor on it itself."""


def tensor_impl(t: torch.Tensor) -> int:
    """The address of ``t``'s C++ ``TensorImpl`` (``Tensor._cdata``): the native address check of a
    module's parameters reads a parameter's address through it while the parameter still holds it."""
    return cast(int, t._cdata)


def generator_key(gen: torch.Generator) -> int:
    """What tells two ``torch.Generator`` objects of one C++ generator apart from others (``_cdata``):
    a dispatch mode is handed a new Python object for the generator its caller passed."""
    return cast(int, gen._cdata)  # type: ignore[attr-defined]


def storage_ptr(st: torch.UntypedStorage) -> int:
    """``st.data_ptr()``, or 0 for a storage Python cannot read: a wrapper subclass's, such as the
    functional collectives' ``_wrap_tensor_autograd`` handles (found on the H100 under torch 2.11:
    dispatch modes that read every storage raised there)."""
    try:
        return int(st.data_ptr())
    except RuntimeError:
        return 0
