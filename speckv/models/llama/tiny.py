"""Tiny random Llama models for tests and examples: one shape, built in code (no downloads).

Owns `TINY_MODEL_CONFIG` (2 layers, GQA, a 96-token vocabulary) and `tiny_model`, which
varies it where a test needs another shape (a bigger vocabulary, more layers, another
architecture's config). A large init std gives peaked, input-dependent logits, so greedy
outputs have no long argmax ties.
"""

from __future__ import annotations

import torch

from speckv.models import LlamaForCausalLM, ModelConfig

_TINY_SHAPE: dict[str, object] = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
TINY_MODEL_CONFIG = ModelConfig(**_TINY_SHAPE)


def tiny_model_config(**overrides: object) -> ModelConfig:
    """The tiny shape with some fields replaced (derived fields follow, validated again)."""
    return ModelConfig(**{**_TINY_SHAPE, **overrides})


def tiny_model(seed: int = 1234, init_std: float = 0.2, **overrides: object) -> LlamaForCausalLM:
    """A fp32 CPU model of `tiny_model_config(**overrides)`, seeded."""
    torch.manual_seed(seed)
    return LlamaForCausalLM.from_config(tiny_model_config(**overrides), init_std=init_std)
