"""Pieces every drafter shares: the target's embedding/LM head handle and a dense attention path.

Owns (1) `SharedTarget`, a non-module handle on the target's `embed_tokens` / `lm_head` so a
drafter uses them without copying or re-registering (they stay out of its state_dict and its
optimizer), (2) `drafter_layer_config`, the ModelConfig of a drafter's own decoder layers, and
(3) `dense_attention`, a plain causal SDPA over one padded batch of sequences that computes
exactly what the paged path computes; training and the tests' dense references use it.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common.config import ModelConfig
from speckv.models.common.rope import RotaryEmbedding, apply_rope
from speckv.models.llama.model import LlamaAttention


class SharedTarget:
    """The target's embedding and LM head, shared (not copied, not registered)."""

    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head

    @classmethod
    def of(cls, model: nn.Module) -> SharedTarget:
        return cls(model.embed_tokens, model.lm_head)  # type: ignore[arg-type]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., hidden]
        return self.embed_tokens(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, vocab] fp32
        return self.lm_head(hidden.to(self.lm_head.weight.dtype)).float()


def drafter_layer_config(target: ModelConfig, num_layers: int, **overrides: object) -> ModelConfig:
    """The target's shapes with `num_layers` full-attention layers (a drafter's own KV layers)."""
    return dataclasses.replace(
        target,
        num_hidden_layers=num_layers,
        layer_types=None,
        sliding_window=None,
        **overrides,  # type: ignore[arg-type]
    )


def dense_attention(
    attn: LlamaAttention,
    x: torch.Tensor,  # [batch, seq, in_features] attention input (already normed)
    positions: torch.Tensor,  # [seq] int64
    rotary: RotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal self-attention of `attn`'s weights: (out [b, s, hidden], k, v [b, s, kv, d]).

    Padding must be at the END of each sequence (causality keeps it out of real positions).
    """
    b, s, _ = x.shape
    q = attn.q_proj(x).view(b, s, attn.num_heads, attn.head_dim)
    k = attn.k_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(x).view(b, s, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rotary.cos_sin(positions, x.dtype)  # each [s, 1, d]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=attn.scale,
        enable_gqa=attn.num_heads != attn.num_kv_heads,
    )  # [b, num_heads, s, d]
    o = o.transpose(1, 2).reshape(b, s, attn.num_heads * attn.head_dim)
    return attn.o_proj(o), k, v
