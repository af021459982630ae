"""What a graphed call's arguments may be: the plain Python values keyed by value
(:data:`PLAIN_TYPES`), the tensors a CUDA graph cannot take (:func:`tensor_kind`), and
:class:`Unsupported`, the error that runs a call eagerly with its reason.

Example::

    tensor_kind(torch.zeros(2).to_sparse())   # "a sparse_coo tensor"
    raise Unsupported("mixed-device inputs")  # (the call runs eagerly; stats() shows why)
"""

from __future__ import annotations

import torch

PLAIN_TYPES = (int, float, bool, str, type(None), torch.dtype, torch.device)
"""Types of arguments keyed by value (a recording per value)."""
PLAIN_SET = frozenset(PLAIN_TYPES)
"""The same, for a membership test by exact type (``type(x) in PLAIN_SET``: the hot loops')."""

_strided = torch.strided
_Tensor = torch.Tensor
_Parameter = torch.nn.Parameter


class Unsupported(Exception):
    """The call cannot be graphed; ``str(self)`` is the reason shown in ``stats()``."""


def tensor_kind(x: torch.Tensor) -> str | None:
    """What makes ``x`` a tensor a CUDA graph cannot take or hand out (sparse, nested, meta, a
    subclass), or ``None`` for a plain dense tensor (``nn.Parameter`` s included)."""
    if x.layout is not _strided:
        return f"a {str(x.layout).replace('torch.', '')} tensor"
    if x.is_nested:
        return "a nested tensor"
    if x.is_meta:
        return "a meta tensor"
    if type(x) is not _Tensor and not isinstance(x, _Parameter):
        return f"a tensor subclass ({type(x).__name__})"
    return None
