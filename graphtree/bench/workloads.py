"""The small models the benchmark scenarios run (the decode model is :class:`graphtree.demo.gpt.TinyGPT`).

- :class:`MMChain` -- ``k`` back-to-back small matrix products: exactly ``k`` small kernels in
  eager mode, and still ``k`` under ``torch.compile`` (inductor calls cuBLAS for each ``mm`` and
  cannot fuse them), so every contender launches the same work and only the per-call overhead
  differs. The weights are orthogonal, so values keep their scale through any chain length.
- :class:`MLP` -- residual GELU MLP blocks over ``[batch, tokens, d]`` activations, big enough
  that the memory a recording keeps is visible next to the allocator's 2 MiB granularity.

All weights are seeded ``nn.Parameter``\\ s with ``requires_grad=False``, so every compiler treats
them as static (never copied per call).

Example::

    chain = MMChain(16, dim=64).cuda()
    y = chain(torch.randn(16, 64, device="cuda"))      # 16 cuBLAS kernels
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _orthogonal(dim: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(torch.float32)


class MMChain(nn.Module):
    """``x @ w_1 @ w_2 ... @ w_k``: ``k`` small matmul kernels per call.

    Example::

        >>> MMChain(3, dim=8)(torch.randn(2, 8)).shape
        torch.Size([2, 8])
    """

    def __init__(self, k: int, dim: int = 64, seed: int = 0) -> None:
        super().__init__()
        if k < 1:
            raise ValueError("k must be >= 1")
        gen = torch.Generator().manual_seed(seed)
        self.weights = nn.ParameterList(nn.Parameter(_orthogonal(dim, gen), requires_grad=False) for _ in range(k))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.mm(x, w)
        return x


class MLP(nn.Module):
    """``layers`` residual blocks ``x + fc2(gelu(fc1(x)))`` of width ``d`` and hidden ``hidden``.

    Example::

        >>> MLP(d=8, hidden=16, layers=2)(torch.randn(2, 3, 8)).shape
        torch.Size([2, 3, 8])
    """

    def __init__(self, d: int, hidden: int, layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.fc1 = nn.ParameterList()
        self.fc2 = nn.ParameterList()
        for _ in range(layers):
            self.fc1.append(nn.Parameter(torch.randn(hidden, d, generator=gen) * d**-0.5, requires_grad=False))
            self.fc2.append(
                nn.Parameter(torch.randn(d, hidden, generator=gen) * (0.5 * hidden**-0.5), requires_grad=False)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w1, w2 in zip(self.fc1, self.fc2):
            x = x + F.linear(F.gelu(F.linear(x, w1)), w2)
        return x
