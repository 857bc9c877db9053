"""HybridConfig: the frozen, validated shape of a Gated DeltaNet hybrid (Qwen3-Next, Qwen3.5).

Owns the description of a decoder whose layers are either linear attention (Gated DeltaNet,
a fixed-size recurrent state) or full gated attention (partial RoPE, q/k norms, an output
gate), each followed by a dense SwiGLU MLP, and its parsing from a Hugging Face `config.json`
(`qwen3_next`, `qwen3_5_text`, and the text part of `qwen3_5`). What we do not run is refused
with a ValueError naming the layer type: other token mixers (e.g. Mamba2), rope scalings other
than default. Sparse MoE MLPs (Qwen3-Next's experts, `qwen3_5_moe`) run (`moe.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speckv.models.common import hf_config
from speckv.models.common.config import ModelConfig

HYBRID_ARCHITECTURES: tuple[str, ...] = ("qwen3_next", "qwen3_5")
HYBRID_LAYER_TYPES: tuple[str, ...] = ("linear_attention", "full_attention")

# HF model_type -> ours
_HF_HYBRID: dict[str, str] = {
    "qwen3_next": "qwen3_next",
    "qwen3nextforcausallm": "qwen3_next",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5forcausallm": "qwen3_5",
    "qwen3_5forconditionalgeneration": "qwen3_5",
}
_HF_HYBRID.update({"qwen3_5_moe_text": "qwen3_5", "qwen3_5_moe": "qwen3_5",
                   "qwen3_5moeforcausallm": "qwen3_5"})


def is_hybrid_hf_config(cfg: Mapping[str, Any]) -> bool:
    """True when `cfg` names a GDN hybrid family (even one we refuse, e.g. its MoE variant)."""
    return str(cfg.get("model_type") or "").lower() in _HF_HYBRID


def _positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class HybridConfig:
    """Shapes of a Gated DeltaNet hybrid. Validated at construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]  # "linear_attention" | "full_attention" per layer
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    architecture: str = "qwen3_next"  # qwen3_next: fused in_proj_qkvz/ba; qwen3_5: split
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    # sparse MoE MLPs: the layers that have one (the others a dense MLP of intermediate_size)
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim",
                     "max_position_embeddings"):
            _positive(name, getattr(self, name))
        if self.architecture not in HYBRID_ARCHITECTURES:
            raise ValueError(f"architecture must be one of {HYBRID_ARCHITECTURES}, got "
                             f"{self.architecture!r}")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types must have num_hidden_layers ({self.num_hidden_layers}) "
                             f"entries, got {len(self.layer_types)}")
        for index, layer_type in enumerate(self.layer_types):
            if layer_type not in HYBRID_LAYER_TYPES:
                raise ValueError(f"layer {index}: layer type {layer_type!r} is not supported "
                                 f"(supported: {HYBRID_LAYER_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got "
                             f"{self.partial_rotary_factor!r}")
        if self.rotary_dim % 2:
            raise ValueError(f"the rotary dim (head_dim * partial_rotary_factor = "
                             f"{self.rotary_dim}) must be even")
        if self.linear_conv_kernel_dim < 2:
            raise ValueError("linear_conv_kernel_dim must be >= 2")
        object.__setattr__(self, "moe_layers", tuple(sorted(set(self.moe_layers))))
        if self.moe_layers:
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size"):
                _positive(name, getattr(self, name))
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError("num_experts_per_tok must be <= num_experts")
            if self.moe_layers[0] < 0 or self.moe_layers[-1] >= self.num_hidden_layers:
                raise ValueError(f"moe_layers must be in [0, {self.num_hidden_layers}), got "
                                 f"{self.moe_layers}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for v in self.eos_token_ids:
            if not isinstance(v, int) or not 0 <= v < self.vocab_size:
                raise ValueError(f"eos_token_ids entries must be in [0, vocab_size), got {v!r}")
        dtype = str(self.torch_dtype).removeprefix("torch.")
        dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "float": "float32"}.get(dtype, dtype)
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"torch_dtype must be float32/bfloat16/float16, got "
                             f"{self.torch_dtype!r}")
        object.__setattr__(self, "torch_dtype", dtype)

    # ---- derived -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v of the linear attention."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    def drafter_base_config(self) -> ModelConfig:
        """A Llama-layer ModelConfig with this model's attention shapes: what a drafter's own
        full-attention layers (EAGLE / MTP) are built from."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,  # EAGLE3 picks aux layers from it
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            architecture="qwen3",
            rope_theta=self.rope_theta,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            qk_norm=True,
            eos_token_ids=self.eos_token_ids,
            torch_dtype=self.torch_dtype,
        )

    def replace(self, **changes: Any) -> HybridConfig:
        return dataclasses.replace(self, **changes)

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> HybridConfig:
        """Parse a HF `config.json` dict of Qwen3-Next or Qwen3.5 (text, or the text part of
        the multimodal checkpoint; the vision tower is not loaded)."""
        key = str(cfg.get("model_type") or "").lower()
        if key not in _HF_HYBRID:
            raise ValueError(f"model_type {key!r} is not a Gated DeltaNet hybrid "
                             f"(supported: qwen3_next, qwen3_5_text, qwen3_5)")
        arch = _HF_HYBRID[key]
        if key in ("qwen3_5", "qwen3_5_moe") and isinstance(cfg.get("text_config"), Mapping):
            cfg = {**cfg["text_config"], "tie_word_embeddings": cfg.get(
                "tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", False))}
        moe_family = key.startswith("qwen3_5_moe")
        hf_config.require_keys(cfg, ("vocab_size", "hidden_size", "num_hidden_layers",
                                     "num_attention_heads",
                                     *(() if moe_family else ("intermediate_size",))))
        num_layers = int(cfg["num_hidden_layers"])
        hf_config.check_silu(cfg)
        layer_types = cfg.get("layer_types")
        if layer_types is None:
            interval = int(cfg.get("full_attention_interval", 4))
            layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                           for i in range(num_layers)]
        if moe_family:  # every layer sparse MoE
            num_experts = int(cfg.get("num_experts", 256) or 0)
            moe_layers = list(range(num_layers)) if num_experts > 0 else []
        elif arch == "qwen3_next":
            num_experts = int(cfg.get("num_experts", 512) or 0)
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or ())
            moe_layers = [i for i in range(num_layers)
                          if i not in dense_only and num_experts > 0 and (i + 1) % step == 0]
        else:
            num_experts, moe_layers = 0, []
        moe: dict[str, Any] = {}
        if moe_layers:
            moe = dict(moe_layers=tuple(moe_layers), num_experts=num_experts,
                       num_experts_per_tok=int(cfg.get("num_experts_per_tok", 10)),
                       moe_intermediate_size=int(cfg.get("moe_intermediate_size", 512)),
                       shared_expert_intermediate_size=int(
                           cfg.get("shared_expert_intermediate_size", 512)),
                       norm_topk_prob=bool(cfg.get("norm_topk_prob", True)) or moe_family)
        theta, partial = _parse_rope(cfg)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size")
                                  or cfg.get("moe_intermediate_size", 1)),
            num_hidden_layers=num_layers,
            num_attention_heads=int(cfg["num_attention_heads"]),
            num_key_value_heads=int(cfg.get("num_key_value_heads")
                                    or cfg["num_attention_heads"]),
            head_dim=int(cfg.get("head_dim")
                         or cfg["hidden_size"] // cfg["num_attention_heads"]),
            layer_types=tuple(layer_types),
            linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
            partial_rotary_factor=partial,
            rope_theta=theta,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=hf_config.eos_token_ids(cfg),
            torch_dtype=hf_config.torch_dtype(cfg),
            **moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A `config.json` dict (qwen3_next or qwen3_5_text) that parses back to this config."""
        out: dict[str, Any] = {
            "architectures": ["Qwen3NextForCausalLM" if self.architecture == "qwen3_next"
                              else "Qwen3_5ForCausalLM"],
            "model_type": "qwen3_next" if self.architecture == "qwen3_next" else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "layer_types": list(self.layer_types),
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": hf_config.eos_field(self.eos_token_ids),
            "torch_dtype": self.torch_dtype,
        }
        moe = dict(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                   moe_intermediate_size=self.moe_intermediate_size,
                   shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                   norm_topk_prob=self.norm_topk_prob)
        if self.architecture == "qwen3_next":
            out.update(moe, decoder_sparse_step=1, mlp_only_layers=[
                i for i in range(self.num_hidden_layers) if i not in self.moe_layers])
        elif self.moe_layers:
            if len(self.moe_layers) != self.num_hidden_layers:
                raise ValueError("Qwen3.5-MoE configs have a sparse MoE MLP on every layer")
            out.update(moe, model_type="qwen3_5_moe_text",
                       architectures=["Qwen3_5MoeForCausalLM"])
        return out


def _parse_rope(cfg: Mapping[str, Any]) -> tuple[float, float]:
    """(rope_theta, partial_rotary_factor); only default RoPE (text positions of Qwen3.5's
    interleaved M-RoPE are plain RoPE: its three position streams are equal for text)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters must be a dict, got {params!r}")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise ValueError(f"rope_parameters.rope_type {rope_type!r}: only default RoPE is "
                         "supported on GDN hybrids")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    return float(theta), float(partial)
