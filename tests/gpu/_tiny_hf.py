"""Tiny random-weight Hugging Face models the GPU tests share (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch


def tiny_model(kind: str, device: str = "cuda", **config: Any) -> torch.nn.Module:
    """A 2-layer GPT-2, Llama or Mistral (the Llama's shape, with sliding-window attention), vocab 256,
    seeded, in eval mode on ``device``; greedy ``generate()`` with pad token 0. ``config``: more
    settings of a Llama's or Mistral's config (``sliding_window=8``)."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        sizes = {
            "vocab_size": 256,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 128,
        }
        if kind == "llama":
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes, **config))
        else:
            model = transformers.MistralForCausalLM(transformers.MistralConfig(**sizes, **config))
    model.generation_config.pad_token_id = 0
    model.generation_config.do_sample = False
    return model.to(device).eval()
