"""Tensor parallelism for the demo: a Megatron-style MLP and :class:`TinyGPT`'s decode step split across
the ranks of a process group, with the all-reduces a graph then holds.

Each rank keeps a slice of the weights: the first linear layer of the MLP and the attention's
query/key/value projection by output columns (a rank owns ``n_head / world`` heads), the second
linear layer and the attention's output projection by input rows, followed by one all-reduce
(sum) each. Biases of the row-split layers are added once, after the all-reduce. Every rank
builds the whole model from the same seed and keeps its slice, so no weights are sent.

Example (under ``torchrun --nproc-per-node 2``)::

    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    full = TinyGPT(GPTConfig(n_layer=2, d_model=256, n_head=8, vocab=1024), batch=1, device="cuda")
    tp = ParallelGPT(full, dist.group.WORLD)
    step = graphtree.graphed(tp.decode_step)
    logits = step(tokens, pos)   # the same logits on every rank
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from graphtree.demo.gpt import TinyGPT, _Block

__all__ = ["ParallelGPT", "ParallelMLP"]


def _rank_and_size(group: Any) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _split(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """This rank's slice of ``t`` along ``dim`` (``t.shape[dim]`` divisible by ``world``), a copy."""
    if t.shape[dim] % world:
        raise ValueError(f"dimension {dim} of size {t.shape[dim]} does not split across {world} ranks")
    return t.chunk(world, dim=dim)[rank].contiguous()


class ParallelMLP(nn.Module):
    """``fc_out(gelu(fc(x)))`` with ``fc`` split by columns and ``fc_out`` by rows, one all-reduce.

    Args:
        fc, fc_out: the whole layers (every rank passes the same ones); each rank keeps its slice.
        group: the process group to split across.
    """

    def __init__(self, fc: nn.Linear, fc_out: nn.Linear, group: Any) -> None:
        super().__init__()
        rank, world = _rank_and_size(group)
        self.group = group
        self.w1 = nn.Parameter(_split(fc.weight.detach(), 0, rank, world), requires_grad=False)
        self.b1 = nn.Parameter(_split(fc.bias.detach(), 0, rank, world), requires_grad=False)
        self.w2 = nn.Parameter(_split(fc_out.weight.detach(), 1, rank, world), requires_grad=False)
        self.b2 = nn.Parameter(fc_out.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)
        dist.all_reduce(y, group=self.group)
        return y + self.b2


class ParallelGPT(nn.Module):
    """:class:`TinyGPT`'s decode step across the ranks of ``group``: each rank owns ``n_head / world``
    heads of every layer, its own slice of the KV cache, and a slice of every MLP; two all-reduces per
    layer. Embeddings, LayerNorms and the tied head are whole on every rank, so every rank returns the
    same logits. ``n_head`` and ``4 * d_model`` must divide by the group's size.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    _positions: torch.Tensor

    def __init__(self, full: TinyGPT, group: Any) -> None:
        super().__init__()
        rank, world = _rank_and_size(group)
        cfg = full.cfg
        if cfg.n_head % world:
            raise ValueError(f"n_head ({cfg.n_head}) must divide by the group's size ({world})")
        self.cfg, self.group, self.batch = cfg, group, full.batch
        self.heads = cfg.n_head // world
        d, hd = cfg.d_model, cfg.head_dim
        self.wte, self.wpe, self.ln_f = full.wte, full.wpe, full.ln_f
        blocks = cast("list[_Block]", list(full.blocks))
        self.ln1 = nn.ModuleList(b.ln1 for b in blocks)
        self.ln2 = nn.ModuleList(b.ln2 for b in blocks)

        def keep(ts: Iterable[torch.Tensor]) -> nn.ParameterList:
            return nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in ts)

        self.qkv_w = keep(
            torch.cat([_split(p, 0, rank, world) for p in b.qkv.weight.detach().split(d)]) for b in blocks
        )
        self.qkv_b = keep(torch.cat([_split(p, 0, rank, world) for p in b.qkv.bias.detach().split(d)]) for b in blocks)
        self.proj_w = keep(_split(b.proj.weight.detach(), 1, rank, world) for b in blocks)
        self.proj_b = keep(b.proj.bias.detach().clone() for b in blocks)
        self.mlp = nn.ModuleList(ParallelMLP(b.fc, b.fc_out, group) for b in blocks)
        dev, dtype = full.k_cache.device, full.k_cache.dtype
        shape = (cfg.n_layer, full.batch, self.heads, cfg.max_seq, hd)
        self.register_buffer("k_cache", torch.zeros(shape, device=dev, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(shape, device=dev, dtype=dtype))
        self.register_buffer("_positions", torch.arange(cfg.max_seq, device=dev), persistent=False)
        self._scale = 1.0 / math.sqrt(hd)
        self.eval()

    def reset_cache(self) -> None:
        """Zero this rank's KV caches in place."""
        with torch.no_grad():
            self.k_cache.zero_()
            self.v_cache.zero_()

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decode step, as :meth:`TinyGPT.decode_step` (same arguments), on this rank's heads."""
        cfg = self.cfg
        b, h, hd = tokens.shape[0], self.heads, cfg.head_dim
        idx = pos.reshape(1)
        x = self.wte(tokens) + self.wpe.weight.index_select(0, idx)
        bias = torch.zeros(self._positions.shape, device=x.device, dtype=x.dtype)
        bias = bias.masked_fill(~(self._positions <= pos), float("-inf"))
        for i in range(cfg.n_layer):
            y = F.linear(self.ln1[i](x), self.qkv_w[i], self.qkv_b[i])
            q, k, v = (t.view(b, 1, h, hd).transpose(1, 2) for t in y.split(h * hd, dim=-1))
            self.k_cache[i].index_copy_(2, idx, k)
            self.v_cache[i].index_copy_(2, idx, v)
            att = torch.softmax(torch.matmul(q, self.k_cache[i].transpose(-2, -1)) * self._scale + bias, dim=-1)
            y = torch.matmul(att, self.v_cache[i]).transpose(1, 2).reshape(b, 1, h * hd)
            y = F.linear(y, self.proj_w[i])
            dist.all_reduce(y, group=self.group)
            x = x + y + self.proj_b[i]
            x = x + self.mlp[i](self.ln2[i](x))
        return F.linear(self.ln_f(x[:, 0]), self.wte.weight)
