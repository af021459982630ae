"""A small GPT-style decoder with a static KV cache, for decode-loop demos and benchmarks.

Everything here is shaped for CUDA graph capture: one decode step reads a token tensor and a
0-dim position *tensor*, writes that step's keys and values into preallocated cache buffers in
place, and attends over all ``max_seq`` positions under a mask. There are no data-dependent
shapes and no host synchronisations inside :meth:`TinyGPT.decode_step`, so the same step can be
recorded once and replayed for every position.

Weights are random (normal, std 0.02) and seeded, so two models built with the same ``seed``
are identical on any device; nothing is downloaded.

Example::

    import torch
    from graphtree.demo.gpt import GPTConfig, TinyGPT, greedy_decode

    cfg = GPTConfig(n_layer=2, n_head=4, d_model=64, vocab=512, max_seq=32)
    model = TinyGPT(cfg, batch=1)
    first = torch.zeros(1, 1, dtype=torch.long)
    with torch.inference_mode():
        tokens, times = greedy_decode(model.decode_step, model, first, n_steps=8)
    tokens.shape  # torch.Size([1, 8])
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "greedy_decode"]


@dataclass
class GPTConfig:
    """Shape of a :class:`TinyGPT`. The defaults are GPT-2 small (124M parameters).

    ``d_model`` must be divisible by ``n_head``; ``max_seq`` is the KV cache length and the
    largest number of decode steps one cache can hold. ``dropout``: the probability of the
    dropouts :meth:`TinyGPT.loss` applies in training mode (embeddings and each residual branch,
    as GPT-2 does); decoding never drops.
    """

    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    vocab: int = 50304
    max_seq: int = 256
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        """Width of one attention head (``d_model // n_head``)."""
        return self.d_model // self.n_head


class _Block(nn.Module):
    """One pre-LayerNorm transformer block: causal self-attention over the cache, then a GELU MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)


class TinyGPT(nn.Module):
    """A GPT-style decoder for one-token-at-a-time decoding with a static KV cache.

    The model embeds tokens (``wte``) and absolute positions (``wpe``), runs ``n_layer`` pre-LN
    blocks (multi-head attention, then a 4x GELU MLP), a final LayerNorm, and a head tied to
    ``wte``. The key/value cache lives in two buffers of shape
    ``[n_layer, batch, n_head, max_seq, head_dim]``, zero-initialised; :meth:`decode_step`
    updates them in place, so a captured CUDA graph sees the same storage on every replay.

    Args:
        cfg: the model shape.
        batch: the batch size the cache is allocated for (fixed for the model's lifetime).
        device: where parameters and caches live (``None``: the default device).
        dtype: floating point type of parameters and caches.
        seed: seeds the weight initialisation (normal, std 0.02; LayerNorm weight 1, biases 0).
            Initialisation draws on the CPU, so the same seed gives the same weights everywhere.

    Example::

        model = TinyGPT(GPTConfig(n_layer=2, d_model=64, n_head=4, vocab=256), batch=2)
        logits = model.decode_step(torch.zeros(2, 1, dtype=torch.long), torch.tensor(0))
        logits.shape  # torch.Size([2, 256])
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    _positions: torch.Tensor

    def __init__(
        self,
        cfg: GPTConfig,
        batch: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_head != 0:
            raise ValueError(f"d_model ({cfg.d_model}) must be divisible by n_head ({cfg.n_head})")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, got {batch}")
        self.cfg = cfg
        self.batch = batch
        self.wte = nn.Embedding(cfg.vocab, cfg.d_model)
        self.wpe = nn.Embedding(cfg.max_seq, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self._init_weights(seed)
        self.to(device=device, dtype=dtype)

        dev = self.wte.weight.device
        cache_shape = (cfg.n_layer, batch, cfg.n_head, cfg.max_seq, cfg.head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, device=dev, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(cache_shape, device=dev, dtype=dtype))
        self.register_buffer("_positions", torch.arange(cfg.max_seq, device=dev, dtype=torch.long), persistent=False)
        self._scale = 1.0 / math.sqrt(cfg.head_dim)
        self.eval()

    def _init_weights(self, seed: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if isinstance(self.get_submodule(name.rsplit(".", 1)[0]), nn.LayerNorm):
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02, generator=gen)

    @property
    def device(self) -> torch.device:
        """The device of the model's parameters and caches."""
        return self.k_cache.device

    def reset_cache(self) -> None:
        """Zero both KV caches in place (their storage, and so any captured graph, is kept)."""
        with torch.no_grad():
            self.k_cache.zero_()
            self.v_cache.zero_()

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one decode step and return the next-token logits.

        Writes this step's keys and values into the caches at index ``pos`` (in place, indexed
        by the tensor, never a Python int), then attends over all ``max_seq`` cached positions
        with the mask ``arange(max_seq) <= pos``. Capturable in a CUDA graph: shapes do not
        depend on ``pos`` and nothing synchronises with the host.

        Args:
            tokens: int64 ``[batch, 1]``, the current token of each sequence.
            pos: int64 0-dim tensor on the model's device, the position of ``tokens``
                (the same for the whole batch); must be in ``[0, max_seq)``.
            out: where to write the logits (``[batch, vocab]``, the model's dtype and device),
                for example a :mod:`graphtree.share` channel's slot; a new tensor if ``None``.

        Returns:
            Logits ``[batch, vocab]`` in the model's dtype (``out`` when given).

        Example::

            pos = torch.zeros((), dtype=torch.long)
            logits = model.decode_step(torch.zeros(model.batch, 1, dtype=torch.long), pos)
        """
        cfg = self.cfg
        b = tokens.shape[0]
        h, hd = cfg.n_head, cfg.head_dim
        idx = pos.reshape(1)

        x = self.wte(tokens) + self.wpe.weight.index_select(0, idx)  # [b, 1, d]
        visible = self._positions <= pos  # [max_seq]
        bias = torch.zeros(visible.shape, device=x.device, dtype=x.dtype)
        bias = bias.masked_fill(~visible, float("-inf"))  # [max_seq]

        blocks = cast("Iterable[_Block]", self.blocks)  # a ModuleList iterates as plain Modules for mypy
        for i, blk in enumerate(blocks):
            y = blk.ln1(x)
            q, k, v = blk.qkv(y).split(cfg.d_model, dim=-1)
            q = q.view(b, 1, h, hd).transpose(1, 2)  # [b, h, 1, hd]
            k = k.view(b, 1, h, hd).transpose(1, 2)
            v = v.view(b, 1, h, hd).transpose(1, 2)
            k_all = self.k_cache[i]  # [b, h, max_seq, hd], a view of the buffer
            v_all = self.v_cache[i]
            k_all.index_copy_(2, idx, k)
            v_all.index_copy_(2, idx, v)

            att = torch.matmul(q, k_all.transpose(-2, -1)) * self._scale  # [b, h, 1, max_seq]
            att = torch.softmax(att + bias, dim=-1)
            y = torch.matmul(att, v_all)  # [b, h, 1, hd]
            y = y.transpose(1, 2).reshape(b, 1, cfg.d_model)
            x = x + blk.proj(y)
            x = x + blk.fc_out(F.gelu(blk.fc(blk.ln2(x))))

        x = self.ln_f(x[:, 0])
        if out is None:
            return F.linear(x, self.wte.weight)  # tied head
        return torch.mm(x, self.wte.weight.t(), out=out)

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Same as :meth:`decode_step`."""
        return self.decode_step(tokens, pos)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next-token cross-entropy of whole sequences, for training: no cache, causal attention.

        Args:
            tokens: int64 ``[batch, T]`` with ``2 <= T <= max_seq`` (any batch: the cache's is not used).

        Returns:
            The mean loss over the ``batch * (T - 1)`` predicted tokens, a 0-dim tensor that
            requires grad where the parameters do.

        Example::

            model.train()
            model.loss(torch.randint(0, model.cfg.vocab, (8, 64))).backward()
        """
        cfg = self.cfg
        b, t = tokens.shape
        h, hd = cfg.n_head, cfg.head_dim
        p = cfg.dropout if self.training else 0.0
        x = F.dropout(self.wte(tokens) + self.wpe.weight[:t], p)  # [b, t, d]
        for blk in cast("Iterable[_Block]", self.blocks):
            q, k, v = blk.qkv(blk.ln1(x)).split(cfg.d_model, dim=-1)
            q, k, v = (z.view(b, t, h, hd).transpose(1, 2) for z in (q, k, v))  # [b, h, t, hd]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.dropout(blk.proj(y.transpose(1, 2).reshape(b, t, cfg.d_model)), p)
            x = x + F.dropout(blk.fc_out(F.gelu(blk.fc(blk.ln2(x)))), p)
        logits = F.linear(self.ln_f(x[:, :-1]), self.wte.weight)  # tied head
        return F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))


def greedy_decode(
    step_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    model: TinyGPT,
    first_tokens: torch.Tensor,
    n_steps: int,
    before_step: Callable[[], object] | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Greedily decode ``n_steps`` tokens, timing every step.

    Each step runs ``before_step()`` (if given), ``logits = step_fn(tokens, pos)``,
    ``tokens = logits.argmax(-1, keepdim=True)`` and ``pos += 1``, where ``pos`` is a 0-dim
    int64 tensor on the model's device that starts at 0 and is updated in place. The cache is
    *not* reset here: call ``model.reset_cache()`` between runs.

    Args:
        step_fn: ``model.decode_step`` or a wrapped (for example graphed) version of it.
        model: the model whose device and ``max_seq`` are used.
        first_tokens: int64 ``[batch, 1]``, the token at position 0.
        n_steps: number of steps, at most ``model.cfg.max_seq``.
        before_step: called at the start of every step (e.g. ``graphtree.mark_step``).

    Returns:
        ``(tokens, times)``: the generated tokens ``[batch, n_steps]`` and each step's wall time
        in seconds (measured around device synchronisation on CUDA).

    Example::

        tokens, times = greedy_decode(model.decode_step, model, first, n_steps=16)
    """
    if n_steps < 0 or n_steps > model.cfg.max_seq:
        raise ValueError(f"n_steps must be in [0, {model.cfg.max_seq}] (max_seq), got {n_steps}")
    device = model.device
    cuda = device.type == "cuda"
    tokens = first_tokens.to(device=device, dtype=torch.long)
    pos = torch.zeros((), dtype=torch.long, device=device)
    out: list[torch.Tensor] = []
    times: list[float] = []

    if cuda:
        torch.cuda.synchronize(device)
    for _ in range(n_steps):
        t0 = time.perf_counter()
        if before_step is not None:
            before_step()
        logits = step_fn(tokens, pos)
        tokens = logits.argmax(-1, keepdim=True)
        pos += 1
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
        out.append(tokens)

    if not out:
        return torch.empty(first_tokens.shape[0], 0, dtype=torch.long, device=device), times
    return torch.cat(out, dim=1), times
