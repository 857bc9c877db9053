"""Gemma 4 text decoder over the paged KV cache (`Gemma4ForCausalLM` / `Gemma4TextConfig`).

Owns what Gemma 4 adds to Gemma 3 (`gemma.py`), the config parsing and the HF layout:

    global layers: their own head size / KV heads (`per_layer_config`, or `global_head_dim`,
        `num_global_key_value_heads`), proportional RoPE (a `partial_rotary_factor` of the
        frequencies rotate, the rest pass through), and with `attention_k_eq_v` V = K's
        projection (no v_proj)
    every layer: RMSNorm x * w (not 1 + w), V normalised without a scale, attention scale 1,
        an output `layer_scalar`; with `hidden_size_per_layer_input`, per-layer input
        embeddings (token table + a projection of the embedding) gated into each layer
    KV-shared layers (the last `num_kv_shared_layers`): no K/V of their own; they attend over
        the KV of the last earlier layer of their type (paged: they read its cache, write
        nothing); with `use_double_wide_mlp` their MLP is twice as wide

KV cache layout: the global layers that own KV form the full-attention group, the sliding ones
the sliding-window group; the runner's cache has one `PagedKVCache` per group (the groups'
head sizes differ) through `make_layout_kv_cache`.

Refused (error names the layer type): MoE blocks (`enable_moe_block`), bidirectional attention,
vision / audio towers (`Gemma4ForConditionalGeneration`), per-layer overrides other than the
head size and KV head count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from speckv.attention import (
    AnyAttentionMetadata,
    AttentionBackend,
    GroupedKVCache,
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
from speckv.models.gemma.gemma3 import GemmaMLP, GemmaScaledEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]
GEMMA4_MODEL_TYPES = ("gemma4_text",)
_REFUSED = {"vision_config": "vision tower (multimodal)", "audio_config": "audio tower "
            "(multimodal)", "enable_moe_block": "MoE block", "num_experts": "MoE block",
            "kv_lora_rank": "MLA attention"}


@dataclass(frozen=True)
class Gemma4Config:
    """Gemma 4 text. `base` holds the sliding layers' head size / KV heads (what drafters and
    the engine's sizing read); global layers' shapes are in `global_head_dim` / _kv_heads."""

    base: ModelConfig
    global_head_dim: int
    global_kv_heads: int
    attention_k_eq_v: bool = False
    rope_local_theta: float = 10_000.0
    global_rope_factor: float = 1.0
    global_partial_rotary_factor: float = 1.0
    global_rope_proportional: bool = True
    final_logit_softcapping: float | None = None
    hidden_size_per_layer_input: int = 0
    vocab_size_per_layer_input: int = 0
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    pad_token_id: int = 0
    kv_sharing_modes: tuple[str | None, ...] = field(init=False)

    def __post_init__(self) -> None:
        n = self.base.num_hidden_layers
        if not 0 <= self.num_kv_shared_layers <= n:
            raise ValueError(f"num_kv_shared_layers must be in [0, {n}]")
        if self.hidden_size_per_layer_input and self.vocab_size_per_layer_input <= 0:
            raise ValueError("vocab_size_per_layer_input must be > 0 with per-layer inputs")
        if not 0 < self.global_partial_rotary_factor <= 1:
            raise ValueError("partial_rotary_factor must be in (0, 1]")
        object.__setattr__(self, "kv_sharing_modes", self._sharing_modes())

    def _sharing_modes(self) -> tuple[str | None, ...]:
        """Per layer: None, "store" (the last KV owner of its type) or "reuse" (as HF)."""
        types = list(self.base.layer_types or ())
        n = len(types)
        if self.num_kv_shared_layers == n:
            raise ValueError("num_kv_shared_layers: every layer sharing KV leaves none to own it")
        first_shared = n - self.num_kv_shared_layers
        modes: list[str | None] = [None if i < first_shared else "reuse" for i in range(n)]
        owners = types[:first_shared]
        if set(owners) != set(types):
            raise ValueError("num_kv_shared_layers: a shared layer type has no earlier owner")
        for kind in set(types):
            modes[first_shared - 1 - owners[::-1].index(kind)] = "store"
        return tuple(modes)

    def is_global(self, layer_idx: int) -> bool:
        return self.base.layer_sliding_window(layer_idx) is None

    def layer_shape(self, layer_idx: int) -> tuple[int, int]:
        """(head_dim, num_kv_heads) of a layer."""
        if self.is_global(layer_idx):
            return self.global_head_dim, self.global_kv_heads
        assert self.base.head_dim is not None
        return self.base.head_dim, self.base.num_key_value_heads

    def kv_source(self, layer_idx: int) -> int:
        """The layer whose KV this layer attends over (itself unless KV-shared)."""
        if self.kv_sharing_modes[layer_idx] != "reuse":
            return layer_idx
        kind = (self.base.layer_types or ())[layer_idx]
        first_shared = self.base.num_hidden_layers - self.num_kv_shared_layers
        return max(i for i in range(first_shared) if (self.base.layer_types or ())[i] == kind)

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> Gemma4Config:
        """Validated from an HF config.json: one check per field, in the file's order (what
        speckv refuses: `_check_supported`; the RoPE parameters: `_rope_parameters`)."""
        _check_supported(cfg)
        n = int(cfg["num_hidden_layers"])
        types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else
                                           "full_attention" for i in range(n)]
        types = list(types)
        types[-1] = "full_attention"  # as transformers forces it
        head_dim = int(cfg.get("head_dim", 256))
        kv_heads = int(cfg["num_key_value_heads"])
        k_eq_v = bool(cfg.get("attention_k_eq_v", False))
        global_head_dim = int(cfg.get("global_head_dim", 512))
        global_kv = cfg.get("num_global_key_value_heads") if k_eq_v else None
        overrides = cfg.get("per_layer_config") or {}
        for index, fields in overrides.items():
            unknown = set(fields) - {"head_dim", "num_key_value_heads"}
            if unknown:
                raise ValueError(f"per_layer_config[{index}]: overrides {sorted(unknown)} are "
                                 "not supported (head_dim, num_key_value_heads only)")
            if types[int(index)] != "full_attention":
                raise ValueError("per_layer_config: only global layers may change shape")
        if "per_layer_config" in cfg:
            # a saved config: global layers are the base shape unless overridden (a value
            # equal to the base is left out of the dict)
            global_layers = [i for i, kind in enumerate(types) if kind == "full_attention"]
            shapes = {(int(overrides.get(str(i), overrides.get(i, {})).get("head_dim", head_dim)),
                       int(overrides.get(str(i), overrides.get(i, {})).get(
                           "num_key_value_heads", kv_heads)))
                      for i in global_layers}
            if len(shapes) != 1:
                raise ValueError("per_layer_config: every global layer must share one shape")
            global_head_dim, global_kv = shapes.pop()
        full, local, full_type = _rope_parameters(cfg)
        base = ModelConfig(
            vocab_size=int(cfg["vocab_size"]), hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]), num_hidden_layers=n,
            num_attention_heads=int(cfg["num_attention_heads"]), num_key_value_heads=kv_heads,
            head_dim=head_dim, architecture="gemma4",
            rope_theta=float(full.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            attention_output_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
            sliding_window=int(cfg.get("sliding_window", 512)), layer_types=tuple(types),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=hf_config.eos_token_ids(cfg, default=1),
            torch_dtype=hf_config.torch_dtype(cfg),
        )
        return cls(
            base=base, global_head_dim=global_head_dim,
            global_kv_heads=int(global_kv) if global_kv is not None else kv_heads,
            attention_k_eq_v=k_eq_v, rope_local_theta=float(local.get("rope_theta", 10_000.0)),
            global_rope_factor=float(full.get("factor", 1.0)),
            global_partial_rotary_factor=float(full.get("partial_rotary_factor", 1.0)),
            global_rope_proportional=full_type == "proportional",
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
            hidden_size_per_layer_input=int(cfg.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(cfg.get("vocab_size_per_layer_input") or 0),
            num_kv_shared_layers=int(cfg.get("num_kv_shared_layers") or 0),
            use_double_wide_mlp=bool(cfg.get("use_double_wide_mlp", False)),
            pad_token_id=int(cfg.get("pad_token_id") or 0),
        )


def _check_supported(cfg: Mapping[str, Any]) -> None:
    """ValueError naming the config field of a Gemma 4 that speckv cannot run."""
    model_type = str(cfg.get("model_type", "")).lower()
    archs = [str(a) for a in cfg.get("architectures") or []]
    for key, layer in _REFUSED.items():
        if cfg.get(key):
            raise ValueError(f"{key}: this model needs a {layer} layer, which speckv does "
                             "not have (Gemma text decoders only)")
    if model_type == "gemma4" or "Gemma4ForConditionalGeneration" in archs:
        raise ValueError("Gemma4ForConditionalGeneration: the vision / audio towers "
                         "(multimodal) are not supported; use the text model")
    if model_type not in GEMMA4_MODEL_TYPES and "Gemma4ForCausalLM" not in archs:
        raise ValueError(f"model_type {model_type!r}: not a Gemma 4 text model")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention: only causal attention is supported")
    if cfg.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh",
                                                                  "gelu_tanh"):
        raise ValueError(f"hidden_activation {cfg['hidden_activation']!r} is not supported")


def _rope_parameters(cfg: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The global layers' RoPE parameters, the sliding layers', and the global rope type."""
    rope = cfg.get("rope_parameters") or {}
    full = dict(rope.get("full_attention") or {"rope_type": "proportional",
                                               "partial_rotary_factor": 0.25,
                                               "rope_theta": 1_000_000.0})
    local = dict(rope.get("sliding_attention") or {"rope_theta": 10_000.0})
    if local.get("rope_type", "default") != "default":
        raise ValueError("rope_parameters.sliding_attention: only default RoPE is supported")
    full_type = full.get("rope_type", "default")
    if full_type not in ("default", "proportional"):
        raise ValueError(f"rope_parameters.full_attention: rope_type {full_type!r} is not "
                         "supported (default, proportional)")
    return full, local, full_type


def _proportional_inv_freq(head_dim: int, theta: float, proportion: float,
                           factor: float) -> torch.Tensor:
    """transformers' proportional RoPE: the first `proportion` of the angles rotate with the
    usual frequencies of `head_dim`, the rest have frequency 0 (pass through). [head_dim//2]"""
    angles = int(proportion * head_dim // 2)
    # on the CPU explicitly: models are built under torch.device("meta") by the loaders
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device="cpu").float()
    rotated = 1.0 / (theta ** (exponents / head_dim))
    nope = torch.zeros(head_dim // 2 - angles, device="cpu")
    inv = torch.cat((rotated, nope))
    return inv / factor


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 [* w], in fp32 (Gemma 4: w, not 1 + w)."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


class Gemma4Attention(nn.Module):
    def __init__(self, config: Gemma4Config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = config.base
        self.layer_idx = layer_idx
        self.kv_layer = config.kv_source(layer_idx)  # whose KV cache it reads
        self.num_heads = base.num_attention_heads
        self.head_dim, self.num_kv_heads = config.layer_shape(layer_idx)
        self.sliding_window = base.layer_sliding_window(layer_idx)
        self.backend = backend
        h, d, bias, eps = base.hidden_size, self.head_dim, base.attention_bias, base.rms_norm_eps
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.q_norm = Gemma4RMSNorm(d, eps)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.owns_kv = self.kv_layer == layer_idx
        if self.owns_kv:
            self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
            k_eq_v = config.attention_k_eq_v and config.is_global(layer_idx)
            self.v_proj = None if k_eq_v else nn.Linear(h, self.num_kv_heads * d, bias=bias)
            self.k_norm = Gemma4RMSNorm(d, eps)
            self.v_norm = Gemma4RMSNorm(d, eps, with_scale=False)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, kv_cache,
                metadata: AnyAttentionMetadata) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        n = hidden.shape[0]
        cos, sin = cos_sin
        q = apply_rope(self.q_norm(self.q_proj(hidden).view(n, self.num_heads, self.head_dim)),
                       cos, sin)
        metadata = metadata_for_layer(metadata, self.kv_layer)  # the KV owner's group
        cache = kv_cache.layer(self.kv_layer)
        if self.owns_kv:
            raw_k = self.k_proj(hidden).view(n, self.num_kv_heads, self.head_dim)
            raw_v = raw_k if self.v_proj is None else self.v_proj(hidden).view(
                n, self.num_kv_heads, self.head_dim)
            k = apply_rope(self.k_norm(raw_k), cos, sin)
            self.backend.write_kv(cache, k, self.v_norm(raw_v), metadata.slot_mapping)
        # a KV-shared layer runs after its owner in the same forward: the owner has written
        # this step's KV already
        o = self.backend.forward(q, cache.key, cache.value, metadata, 1.0, self.sliding_window)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class Gemma4DecoderLayer(nn.Module):
    def __init__(self, config: Gemma4Config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = config.base
        h, eps = base.hidden_size, base.rms_norm_eps
        self.is_sliding = not config.is_global(layer_idx)
        self.self_attn = Gemma4Attention(config, layer_idx, backend)
        wide = config.use_double_wide_mlp and config.kv_sharing_modes[layer_idx] == "reuse"
        self.mlp = GemmaMLP(h, base.intermediate_size * (2 if wide else 1))
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.ple = config.hidden_size_per_layer_input
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, self.ple, bias=False)
            self.per_layer_projection = nn.Linear(self.ple, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)

    def forward(self, hidden: torch.Tensor, per_layer_input: torch.Tensor | None,
                cos_sin: CosSin, kv_cache, metadata: AnyAttentionMetadata) -> torch.Tensor:
        h = hidden + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(hidden), cos_sin, kv_cache, metadata))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        if self.ple:
            gate = F.gelu(self.per_layer_input_gate(h), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate))
        return h * self.layer_scalar


class Gemma4ForCausalLM(CausalLMBase, nn.Module):
    """Gemma 4 text decoder; the calling convention of `LlamaForCausalLM`."""

    def __init__(self, gemma: Gemma4Config, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        base = gemma.base
        assert base.head_dim is not None
        self.gemma = gemma
        self.config = base
        self.attn_backend = backend or get_attention_backend()
        self.rotary_local = RotaryEmbedding(base.head_dim, gemma.rope_local_theta, None,
                                            base.max_position_embeddings)
        self.rotary_global = RotaryEmbedding(gemma.global_head_dim, base.rope_theta, None,
                                             base.max_position_embeddings)
        if gemma.global_rope_proportional:
            self.rotary_global.inv_freq = _proportional_inv_freq(
                gemma.global_head_dim, base.rope_theta, gemma.global_partial_rotary_factor,
                gemma.global_rope_factor)
        self.embed_tokens = GemmaScaledEmbedding(base.vocab_size, base.hidden_size)
        self.layers = nn.ModuleList(Gemma4DecoderLayer(gemma, i, self.attn_backend)
                                    for i in range(base.num_hidden_layers))
        self.norm = Gemma4RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        ple = gemma.hidden_size_per_layer_input
        if ple:
            n = base.num_hidden_layers
            self.embed_tokens_per_layer = GemmaScaledEmbedding(gemma.vocab_size_per_layer_input,
                                                               n * ple)
            self.embed_tokens_per_layer.embed_scale = ple**0.5
            self.per_layer_model_projection = nn.Linear(base.hidden_size, n * ple, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(ple, base.rms_norm_eps)
        if base.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_config(cls, gemma: Gemma4Config, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu", init_std: float = 0.02
                    ) -> Gemma4ForCausalLM:
        """Random init (normal weights, unit norms, zero biases); seed torch first."""
        return random_init(cls(gemma), init_std, dtype, device)

    @property
    def final_logit_softcapping(self) -> float | None:
        return self.gemma.final_logit_softcapping

    def kv_cache_layout(self, block_size: int, state_block_size: int | None = None
                        ) -> KVCacheLayout:
        """KV-owning global layers: the full-attention group; KV-owning sliding layers: the
        sliding-window group (KV-shared layers read their owner's blocks; no state group:
        `state_block_size` does not apply)."""
        base = self.config
        windows = [base.layer_sliding_window(i) for i in range(base.num_hidden_layers)]
        owners = [i for i in range(base.num_hidden_layers) if self.gemma.kv_source(i) == i]
        layout = attention_layout([windows[i] for i in owners], block_size)
        # attention_layout numbers layers 0..len(owners)-1: map back to model layers
        from speckv.models.common.kv_layout import KVCacheGroup

        return KVCacheLayout(tuple(
            KVCacheGroup(group.spec, tuple(owners[j] for j in group.layer_indices))
            for group in layout.groups))

    def kv_cache_group_bytes(self, layout: KVCacheLayout) -> None:
        """None: layers share KV across groups (`kv_source`), so a block's bytes do not split
        per group; Gemma 4 keeps one shared pool."""
        return None

    def make_layout_kv_cache(self, layout: KVCacheLayout, num_blocks: int) -> GroupedKVCache:
        """One `PagedKVCache` per group, shaped by its layers (global and sliding layers
        differ in head size and KV heads)."""
        caches, slots = [], {}
        for g, group in enumerate(layout.groups):
            head_dim, kv_heads = self.gemma.layer_shape(group.layer_indices[0])
            caches.append(PagedKVCache(len(group.layer_indices), num_blocks,
                                       group.spec.block_size, kv_heads, head_dim, self.dtype,
                                       self.device))
            slots.update({layer: (g, j) for j, layer in enumerate(group.layer_indices)})
        return GroupedKVCache(caches, slots)

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs over the KV-owning layers (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        owners = [i for i in range(self.config.num_hidden_layers) if self.gemma.kv_source(i) == i]
        return sum(2 * block_size * kv * d * elem
                   for d, kv in (self.gemma.layer_shape(i) for i in owners))

    def make_kv_cache(self, num_blocks: int, block_size: int) -> GroupedKVCache:
        return self.make_layout_kv_cache(self.kv_cache_layout(block_size), num_blocks)

    def _per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[n, num_layers, ple]: (token table + normed projection of the embedding) / sqrt 2."""
        n, layers = h.shape[0], self.config.num_hidden_layers
        ple = self.gemma.hidden_size_per_layer_input
        tokens = self.embed_tokens_per_layer(input_ids).reshape(n, layers, ple)
        projection = self.per_layer_model_projection(h) * self.config.hidden_size**-0.5
        projection = self.per_layer_projection_norm(projection.reshape(n, layers, ple))
        return (projection + tokens) * 2.0**-0.5

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache,
        metadata: AnyAttentionMetadata,
        aux_layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,
    ) -> ModelOutput:
        if inputs_embeds is not None and self.gemma.hidden_size_per_layer_input:
            raise ValueError("Gemma 4 per-layer inputs need input_ids")
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        per_layer = (self._per_layer_inputs(input_ids, h)
                     if self.gemma.hidden_size_per_layer_input else None)
        local_cs = self.rotary_local.cos_sin(positions, h.dtype)
        global_cs = self.rotary_global.cos_sin(positions, h.dtype)
        return self.decode(h, aux_layers, lambda i, layer, x: layer(
            x, per_layer[:, i] if per_layer is not None else None,
            local_cs if layer.is_sliding else global_cs, kv_cache, metadata))
