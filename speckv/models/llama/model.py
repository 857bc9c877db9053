"""Llama-family decoder over the paged KV cache (Llama, SmolLM2, Qwen2 qkv-bias, Qwen3 qk-norm).

Owns the model forward the engine calls: tokens of many requests flattened on one axis (no
padding), positions per token, KV written into and read from `PagedKVCache` via an attention
backend. Parameter names equal Hugging Face's minus the leading "model." (see loader.py).
`LlamaDecoderLayer` is usable standalone so drafters (EAGLE/EAGLE3/MTP) can stack their own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from speckv.attention import (
    AnyAttentionMetadata,
    AttentionBackend,
    PagedKVCache,
    get_attention_backend,
    metadata_for_layer,
)
from speckv.models.common.config import ModelConfig
from speckv.models.common.decoder import CausalLMBase, ModelOutput
from speckv.models.common.kv_layout import KVCacheLayout, attention_layout
from speckv.models.common.layers import Linear, RMSNorm, SwiGLUMLP
from speckv.models.common.random_init import random_init
from speckv.models.common.rope import RotaryEmbedding, apply_rope

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        sliding_window: int | None,
        backend: AttentionBackend,
    ) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window
        self.backend = backend
        h, d = config.hidden_size, self.head_dim
        self.q_proj = Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=config.attention_output_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: CosSin,  # each [num_tokens, 1, head_dim]
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = hidden.shape[0]
        q = self.q_proj(hidden).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = kv_cache.layer(self.layer_idx)
        metadata = metadata_for_layer(metadata, self.layer_idx)  # its KV cache group's
        self.backend.write_kv(cache, k, v, metadata.slot_mapping)
        o = self.backend.forward(
            q, cache.key, cache.value, metadata, self.scale, self.sliding_window
        )  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))

    def write_kv(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden] (the attention input, normed)
        cos_sin: CosSin,  # each [num_tokens, 1, head_dim]
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
    ) -> None:
        """Only the K/V `forward` writes (no query, no attention): for a drafter's catch-up
        of positions whose outputs nobody reads."""
        n = hidden.shape[0]
        k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos, sin = cos_sin
        metadata = metadata_for_layer(metadata, self.layer_idx)  # its KV cache group's
        self.backend.write_kv(kv_cache.layer(self.layer_idx), apply_rope(k, cos, sin), v,
                              metadata.slot_mapping)


class LlamaDecoderLayer(nn.Module):
    """One pre-norm decoder block; its KV lives in `kv_cache.layer(layer_idx)`."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        backend: AttentionBackend | None = None,
        rotary: RotaryEmbedding | None = None,
    ) -> None:
        super().__init__()
        assert config.head_dim is not None
        # Drafter layers may sit past the target's layer count: they are full attention.
        sliding_window = (
            config.layer_sliding_window(layer_idx) if layer_idx < config.num_hidden_layers else None
        )
        self.layer_idx = layer_idx
        self.self_attn = LlamaAttention(
            config, layer_idx, sliding_window, backend or get_attention_backend()
        )
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Standalone use (drafters) needs its own RoPE; inside the model cos/sin are shared.
        self._rotary = rotary or RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
        cos_sin: CosSin | None = None,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        if cos_sin is None:
            cos_sin = self._rotary.cos_sin(positions, hidden.dtype)
        h = hidden + self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(CausalLMBase, nn.Module):
    """The target model. Build with `from_config` (random init) or a loader (loader.py)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        assert config.head_dim is not None
        self.config = config
        self.attn_backend = backend or get_attention_backend()
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.attn_backend, self.rotary)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
        init_std: float = 0.02,
    ) -> LlamaForCausalLM:
        """Random init (HF-style normal(0, init_std), biases 0, norms 1); seed torch first."""
        return random_init(cls(config), init_std, dtype, device)

    def kv_cache_layout(self, block_size: int, state_block_size: int | None = None
                        ) -> KVCacheLayout:
        """The KV cache groups of this model: one full-attention group, plus one
        sliding-window group per window size when the config has sliding layers (no state
        group: `state_block_size` does not apply)."""
        config = self.config
        return attention_layout(
            [config.layer_sliding_window(i) for i in range(config.num_hidden_layers)], block_size)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
        aux_layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden] overrides input_ids
    ) -> ModelOutput:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary.cos_sin(positions, h.dtype)  # each [num_tokens, 1, head_dim]
        return self.decode(h, aux_layers,
                           lambda _i, layer, x: layer(x, positions, kv_cache, metadata, cos_sin))
