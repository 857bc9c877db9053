"""Gemma 3 text decoder over the paged KV cache: interleaved sliding-window / global layers.

Owns the Gemma-specific model the engine runs (`Gemma3ForCausalLM` / `Gemma3TextConfig`
checkpoints, the text part only) and its config parsing:

    embed * sqrt(hidden)                                   (scaled in the weights' dtype)
    per layer:  h += post_attn_norm(attn(input_norm(h)))    attn: q/k RMSNorm per head, RoPE
                h += post_ff_norm(mlp(pre_ff_norm(h)))      mlp: down(gelu_tanh(gate) * up)
    norm, tied LM head, optional final logit soft-capping: cap * tanh(logits / cap)

Gemma RMSNorm scales by (1 + w) in fp32. Sliding layers (window W: a query at p sees keys
p - W + 1 .. p) use the local RoPE base, global layers the global base (and its scaling);
attention scale is `query_pre_attn_scalar ** -0.5`. The KV cache layout is one full-attention
group (global layers) plus one sliding-window group (local layers), so the cache manager frees
blocks that fell behind the window.

`model.config` is the Llama-compatible `ModelConfig` view (shapes, layer types, window, the
global RoPE) that the engine and the drafters read; the Gemma extras are `model.gemma`.
Parameter names equal Hugging Face's minus the leading "model.".

Not supported (refused with an error naming it): attention logit soft-capping (Gemma 2),
bidirectional attention, multimodal towers (`Gemma3ForConditionalGeneration`: vision), MoE /
MLA layers of other families. Gemma 4 is `gemma4.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speckv.attention import (
    AnyAttentionMetadata,
    AttentionBackend,
    PagedKVCache,
    get_attention_backend,
    metadata_for_layer,
)
from speckv.models.common import hf_config
from speckv.models.common.config import ModelConfig
from speckv.models.common.decoder import CausalLMBase, ModelOutput
from speckv.models.common.kv_layout import KVCacheLayout, attention_layout
from speckv.models.common.random_init import random_init
from speckv.models.common.rope import RotaryEmbedding, apply_rope

CosSin = tuple[torch.Tensor, torch.Tensor]

GEMMA3_MODEL_TYPES = ("gemma3_text",)
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM",)
# Config keys of features this decoder does not have, and the layer type each names.
_REFUSED_KEYS: dict[str, str] = {
    "vision_config": "vision tower (multimodal)",
    "audio_config": "audio tower (multimodal)",
    "num_experts": "MoE block",
    "num_local_experts": "MoE block",
    "n_routed_experts": "MoE block",
    "kv_lora_rank": "MLA attention",
    "q_lora_rank": "MLA attention",
}


def is_gemma_config(cfg: Mapping[str, Any]) -> bool:
    """Whether a HF config.json dict names a Gemma family model (any variant)."""
    model_type = str(cfg.get("model_type", "")).lower()
    archs = [str(a) for a in cfg.get("architectures") or []]
    return model_type.startswith("gemma") or any(a.lower().startswith("gemma") for a in archs)


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 3 text: the Llama-compatible shapes plus the Gemma numerics. Validated."""

    base: ModelConfig  # shapes, layer types, sliding window, GLOBAL RoPE theta / scaling, eos
    rope_local_theta: float = 10_000.0  # RoPE base of sliding layers
    query_pre_attn_scalar: float = 256.0  # attention scale = this ** -0.5
    final_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"

    def __post_init__(self) -> None:
        if self.rope_local_theta <= 0:
            raise ValueError(f"rope_local_base_freq must be > 0, got {self.rope_local_theta}")
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(
                f"query_pre_attn_scalar must be > 0, got {self.query_pre_attn_scalar}")
        cap = self.final_logit_softcapping
        if cap is not None and cap <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0, got {cap}")
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(
                f"hidden_activation {self.hidden_activation!r} is not supported "
                "(Gemma uses gelu_pytorch_tanh)")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> GemmaConfig:
        """Parse a HF `Gemma3TextConfig` / `Gemma3ForCausalLM` config.json dict."""
        model_type = str(cfg.get("model_type", "")).lower()
        archs = [str(a) for a in cfg.get("architectures") or []]
        for key, layer in _REFUSED_KEYS.items():
            if cfg.get(key):
                raise ValueError(f"{key}: this model needs a {layer} layer, which speckv does "
                                 "not have (Gemma text decoders only)")
        if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in archs:
            raise ValueError("Gemma3ForConditionalGeneration: the vision tower (multimodal) is "
                             "not supported; use a text-only Gemma3ForCausalLM checkpoint")
        if model_type.startswith("gemma4") or any(a.startswith("Gemma4") for a in archs):
            raise ValueError("a Gemma 4 config: parse it with Gemma4Config (load_gemma_dir "
                             "picks the right one)")
        if model_type not in GEMMA3_MODEL_TYPES and not set(archs) & set(GEMMA3_ARCHITECTURES):
            raise ValueError(f"model_type {model_type!r}: not a Gemma 3 text model "
                             f"(supported: {GEMMA3_MODEL_TYPES}, {GEMMA3_ARCHITECTURES})")
        if cfg.get("attn_logit_softcapping") is not None:
            raise ValueError("attn_logit_softcapping: attention-logit soft-capping is not "
                             "supported by the paged attention backend")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention: only causal attention is supported")
        num_layers = int(cfg["num_hidden_layers"])
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                           for i in range(num_layers)]
        global_rope, local_theta = _rope_params(cfg)
        head_dim = int(cfg.get("head_dim", 256))
        base = ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg["num_key_value_heads"]),
            head_dim=head_dim,
            architecture="gemma3",
            rope_theta=float(global_rope.get("rope_theta", 1_000_000.0)),
            rope_scaling=_scaling_of(global_rope),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_output_bias=bool(cfg.get("attention_bias", False)),
            qk_norm=True,
            sliding_window=int(cfg["sliding_window"]) if "sliding_attention" in layer_types
            else None,
            layer_types=tuple(layer_types),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=hf_config.eos_token_ids(cfg, default=1),
            torch_dtype=hf_config.torch_dtype(cfg),
        )
        return cls(
            base=base,
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", head_dim)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            hidden_activation=str(cfg.get("hidden_activation") or "gelu_pytorch_tanh"),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `Gemma3TextConfig`-shaped dict (what `from_hf_config` reads back)."""
        b = self.base
        full_rope: dict[str, Any] = {"rope_type": "default", "rope_theta": b.rope_theta}
        if b.rope_scaling is not None:
            full_rope = {**b.rope_scaling, "rope_theta": b.rope_theta}
        return {
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "vocab_size": b.vocab_size,
            "hidden_size": b.hidden_size,
            "intermediate_size": b.intermediate_size,
            "num_hidden_layers": b.num_hidden_layers,
            "num_attention_heads": b.num_attention_heads,
            "num_key_value_heads": b.num_key_value_heads,
            "head_dim": b.head_dim,
            "hidden_activation": self.hidden_activation,
            "max_position_embeddings": b.max_position_embeddings,
            "rms_norm_eps": b.rms_norm_eps,
            "tie_word_embeddings": b.tie_word_embeddings,
            "attention_bias": b.attention_bias,
            # HF types it int (checkpoints write 256, 168, ...)
            "query_pre_attn_scalar": int(self.query_pre_attn_scalar)
            if float(self.query_pre_attn_scalar).is_integer() else self.query_pre_attn_scalar,
            "sliding_window": b.sliding_window or 4096,
            "layer_types": list(b.layer_types or ()),
            "final_logit_softcapping": self.final_logit_softcapping,
            "attn_logit_softcapping": None,
            "rope_parameters": {
                "full_attention": full_rope,
                "sliding_attention": {"rope_type": "default",
                                      "rope_theta": self.rope_local_theta},
            },
            "bos_token_id": b.bos_token_id,
            "eos_token_id": list(b.eos_token_ids),
            "pad_token_id": 0,
        }


def _rope_params(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """(global RoPE params with rope_theta, local theta) from either config layout: the new
    `rope_parameters: {full_attention: {...}, sliding_attention: {...}}` or the old
    `rope_theta` / `rope_local_base_freq` / `rope_scaling` keys."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and "full_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        full.setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
        if local.get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.sliding_attention: only default RoPE is supported "
                             "on sliding layers")
        return full, float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10_000.0)))
    full = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
    full["rope_theta"] = cfg.get("rope_theta", 1_000_000.0)
    return full, float(cfg.get("rope_local_base_freq", 10_000.0))


def _scaling_of(rope: Mapping[str, Any]) -> dict[str, Any] | None:
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    return scaling


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32, cast back (Gemma's, not Llama's, order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GemmaScaledEmbedding(nn.Embedding):
    """Embedding times sqrt(hidden), the scale rounded to the weights' dtype (as HF does);
    drafters that share it (`SharedTarget`) see the same scaled vectors."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.embed_scale = embedding_dim**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        out = super().forward(input_ids)
        return out * torch.tensor(self.embed_scale, dtype=out.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = config.base
        assert base.head_dim is not None
        self.layer_idx = layer_idx
        self.num_heads = base.num_attention_heads
        self.num_kv_heads = base.num_key_value_heads
        self.head_dim = d = base.head_dim
        self.scale = config.query_pre_attn_scalar**-0.5
        self.sliding_window = base.layer_sliding_window(layer_idx)
        self.backend = backend
        h, bias = base.hidden_size, base.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = GemmaRMSNorm(d, base.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(d, base.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        cos_sin: CosSin,  # each [num_tokens, 1, head_dim], this layer type's RoPE
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        n = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(n, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache = kv_cache.layer(self.layer_idx)
        metadata = metadata_for_layer(metadata, self.layer_idx)  # its KV cache group's
        self.backend.write_kv(cache, k, v, metadata.slot_mapping)
        o = self.backend.forward(q, cache.key, cache.value, metadata, self.scale,
                                 self.sliding_window)  # [num_tokens, num_heads, head_dim]
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: GemmaConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = config.base
        h, eps = base.hidden_size, base.rms_norm_eps
        self.layer_idx = layer_idx
        self.is_sliding = base.layer_sliding_window(layer_idx) is not None
        self.self_attn = GemmaAttention(config, layer_idx, backend)
        self.mlp = GemmaMLP(h, base.intermediate_size)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, kv_cache: PagedKVCache,
                metadata: AnyAttentionMetadata) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        attn = self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, metadata)
        h = hidden + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaForCausalLM(CausalLMBase, nn.Module):
    """Gemma 3 text decoder, same calling convention as `LlamaForCausalLM` (the engine, the
    runner and the drafters use either)."""

    def __init__(self, gemma: GemmaConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        base = gemma.base
        assert base.head_dim is not None
        self.gemma = gemma
        self.config = base
        self.attn_backend = backend or get_attention_backend()
        self.rotary_global = RotaryEmbedding(base.head_dim, base.rope_theta, base.rope_scaling,
                                             base.max_position_embeddings)
        self.rotary_local = RotaryEmbedding(base.head_dim, gemma.rope_local_theta, None,
                                            base.max_position_embeddings)
        self.embed_tokens = GemmaScaledEmbedding(base.vocab_size, base.hidden_size)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(gemma, i, self.attn_backend) for i in range(base.num_hidden_layers))
        self.norm = GemmaRMSNorm(base.hidden_size, base.rms_norm_eps)
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        if base.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_config(cls, gemma: GemmaConfig, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu", init_std: float = 0.02,
                    norm_std: float = 0.0) -> GemmaForCausalLM:
        """Random init: normal(0, init_std) weights, biases 0, norm weights normal(0, norm_std)
        (0: Gemma's identity norms); seed torch first."""
        norms = (lambda p: p.normal_(0.0, norm_std)) if norm_std else (lambda p: p.zero_())
        return random_init(cls(gemma), init_std, dtype, device, [("norm.weight", norms)])

    @property
    def final_logit_softcapping(self) -> float | None:
        return self.gemma.final_logit_softcapping

    def kv_cache_layout(self, block_size: int, state_block_size: int | None = None
                        ) -> KVCacheLayout:
        """Global layers: one full-attention group; local layers: one sliding-window group
        (no state group: `state_block_size` does not apply)."""
        base = self.config
        return attention_layout(
            [base.layer_sliding_window(i) for i in range(base.num_hidden_layers)], block_size)

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
        global_cs = self.rotary_global.cos_sin(positions, h.dtype)  # [n, 1, head_dim] each
        local_cs = self.rotary_local.cos_sin(positions, h.dtype)
        return self.decode(h, aux_layers, lambda _i, layer, x: layer(
            x, local_cs if layer.is_sliding else global_cs, kv_cache, metadata))


def tiny_gemma_config(**overrides: Any) -> GemmaConfig:
    """A tiny Gemma 3 shape for tests and the `hybrid-swa` model (random weights): 6 layers,
    2 local : 1 global, window 32. Overrides name ModelConfig or GemmaConfig fields."""
    base_fields: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, architecture="gemma3",
        rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=4096,
        tie_word_embeddings=True, qk_norm=True, sliding_window=32,
        layer_types=("sliding_attention", "sliding_attention", "full_attention") * 2,
        eos_token_ids=(1,),
    )
    gemma_fields = {k: overrides.pop(k) for k in list(overrides)
                    if k in {f.name for f in dataclasses.fields(GemmaConfig)}}
    base_fields.update(overrides)
    if "layer_types" in overrides and "num_hidden_layers" not in overrides:
        base_fields["num_hidden_layers"] = len(base_fields["layer_types"])
    gemma_fields.setdefault("query_pre_attn_scalar", float(base_fields["head_dim"]))
    return GemmaConfig(base=ModelConfig(**base_fields), **gemma_fields)

