"""Model configuration: the frozen, validated `ModelConfig` of a Llama-family decoder.

Owns the shape and numerics description of the target model (Llama, Qwen2, Qwen3, SmolLM2) and
its parsing from a Hugging Face `config.json` dict (both the classic `rope_theta`/`rope_scaling`
keys and the transformers-5 `rope_parameters` dict). Loaders and the model read only this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from speckv.models.common import hf_config

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "gemma3", "gemma4")
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "dynamic", "llama3", "yarn")
LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")

# HF `model_type` / `architectures[0]` -> our architecture name (SmolLM2 is plain Llama).
_HF_ARCH: dict[str, str] = {
    "llama": "llama",
    "llamaforcausallm": "llama",
    "mistral": "llama",
    "mistralforcausallm": "llama",
    "qwen2": "qwen2",
    "qwen2forcausallm": "qwen2",
    "qwen3": "qwen3",
    "qwen3forcausallm": "qwen3",
}

_DTYPE_ALIASES: dict[str, str] = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def _positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _positive_float(name: str, value: object) -> None:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def _validate_rope_scaling(rs: Mapping[str, Any]) -> None:
    rope_type = rs.get("rope_type")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if rope_type == "default":
        return
    factor = rs.get("factor")
    if rope_type == "yarn" and factor is None:
        return  # derived from max_position_embeddings / original_max_position_embeddings
    _positive_float("rope_scaling.factor", factor)
    if rope_type in ("linear", "dynamic") and factor < 1.0:
        raise ValueError(f"rope_scaling.factor must be >= 1 for {rope_type}, got {factor!r}")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in rs:
                raise ValueError(f"rope_scaling.{key} is required for llama3 RoPE")
        _positive_float("rope_scaling.low_freq_factor", rs["low_freq_factor"])
        _positive_float("rope_scaling.high_freq_factor", rs["high_freq_factor"])
        _positive_int(
            "rope_scaling.original_max_position_embeddings", rs["original_max_position_embeddings"]
        )
        if rs["high_freq_factor"] <= rs["low_freq_factor"]:
            raise ValueError("rope_scaling.high_freq_factor must be > rope_scaling.low_freq_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a Llama-family decoder. Validated at construction."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None -> hidden_size // num_attention_heads
    architecture: str = "llama"
    rope_theta: float = 10000.0
    # Normalised HF rope scaling dict (always has "rope_type"), or None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2: True)
    attention_output_bias: bool = False  # bias on o_proj (Llama/Qwen3 with attention_bias)
    qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # tokens; used by layers whose type is sliding_attention
    layer_types: tuple[str, ...] | None = None  # None -> all full_attention
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            _positive_int(name, getattr(self, name))
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}) when head_dim is not given"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        _positive_int("head_dim", self.head_dim)
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architecture must be one of {ARCHITECTURES}, got {self.architecture!r}"
            )
        _positive_float("rope_theta", self.rope_theta)
        _positive_float("rms_norm_eps", self.rms_norm_eps)
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, Mapping):
                raise ValueError(f"rope_scaling must be a dict or None, got {self.rope_scaling!r}")
            _validate_rope_scaling(self.rope_scaling)
            if self.rope_scaling["rope_type"] == "default":
                object.__setattr__(self, "rope_scaling", None)
            else:
                object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        if self.sliding_window is not None:
            _positive_int("sliding_window", self.sliding_window)
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types must have num_hidden_layers ({self.num_hidden_layers}) entries, "
                f"got {len(self.layer_types)}"
            )
        for lt in self.layer_types:
            if lt not in LAYER_TYPES:
                raise ValueError(f"layer_types entries must be in {LAYER_TYPES}, got {lt!r}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ValueError("sliding_window must be set when layer_types has sliding_attention")
        v = self.bos_token_id
        if v is not None and (not isinstance(v, int) or v < 0 or v >= self.vocab_size):
            raise ValueError(f"bos_token_id must be in [0, vocab_size), got {v!r}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for v in self.eos_token_ids:
            if not isinstance(v, int) or v < 0 or v >= self.vocab_size:
                raise ValueError(f"eos_token_ids entries must be in [0, vocab_size), got {v!r}")
        dtype = _DTYPE_ALIASES.get(str(self.torch_dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"torch_dtype must be one of {DTYPES}, got {self.torch_dtype!r}")
        object.__setattr__(self, "torch_dtype", dtype)

    # ---- derived -------------------------------------------------------------------------

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The sliding window (tokens) of one layer, None for full attention."""
        assert self.layer_types is not None
        if self.layer_types[layer_idx] == "sliding_attention":
            return self.sliding_window
        return None

    # ---- parsing -------------------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> ModelConfig:
        """Parse a Hugging Face `config.json` dict (Llama / Qwen2 / Qwen3 / SmolLM2)."""
        archs = cfg.get("architectures") or []
        key = str(cfg.get("model_type") or (archs[0] if archs else "")).lower()
        arch = _HF_ARCH.get(key)
        if arch is None:
            raise ValueError(
                f"architecture: unsupported model_type {key!r} (supported: {ARCHITECTURES})"
            )
        if cfg.get("mlp_bias"):
            raise ValueError("mlp_bias: MLP biases are not supported")
        hf_config.check_silu(cfg)
        hf_config.require_keys(cfg, ("vocab_size", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads"))

        rope_theta, rope_scaling = _parse_rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = True if arch == "qwen2" else attention_bias
        out_bias = False if arch == "qwen2" else attention_bias

        sliding_window = cfg.get("sliding_window")
        layer_types = cfg.get("layer_types")
        num_layers = cfg["num_hidden_layers"]
        if arch == "qwen2" and layer_types is None:
            use_sw = bool(cfg.get("use_sliding_window", False))
            max_window_layers = cfg.get("max_window_layers", num_layers)
            layer_types = [
                "sliding_attention" if use_sw and i >= max_window_layers else "full_attention"
                for i in range(num_layers)
            ]
        if layer_types is None or "sliding_attention" not in layer_types:
            sliding_window = None  # only meaningful for sliding layers
        if arch == "llama" and sliding_window is not None and layer_types is None:
            layer_types = ["sliding_attention"] * num_layers  # Mistral-style

        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=num_layers,
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            head_dim=cfg.get("head_dim"),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=qkv_bias,
            attention_output_bias=out_bias,
            qk_norm=arch == "qwen3",
            sliding_window=sliding_window,
            layer_types=tuple(layer_types) if layer_types is not None else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=hf_config.eos_token_ids(cfg),
            torch_dtype=hf_config.torch_dtype(cfg),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """A Llama/Qwen `config.json` dict that `from_hf_config` parses back to this config."""
        model_type = self.architecture
        arch_name = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM",
        }[model_type]
        out: dict[str, Any] = {
            "architectures": [arch_name],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_output_bias if model_type != "qwen2" else False,
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types or ()),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": hf_config.eos_field(self.eos_token_ids),
            "torch_dtype": self.torch_dtype,
        }
        return out


def _parse_rope(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, normalised rope_scaling) from classic or transformers-5 keys."""
    params = cfg.get("rope_parameters")
    if (
        isinstance(params, Mapping)
        and params
        and all(isinstance(v, Mapping) for v in params.values())
    ):
        raise ValueError("rope_parameters: per-layer-type RoPE parameters are not supported")
    scaling: dict[str, Any] | None = None
    theta = cfg.get("rope_theta")
    if isinstance(params, Mapping) and params:
        theta = params.get("rope_theta", theta)
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    elif cfg.get("rope_scaling"):
        scaling = dict(cfg["rope_scaling"])
    if theta is None:
        theta = 10000.0
    if scaling is not None:
        rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
        scaling.pop("type", None)
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("rope_scaling.partial_rotary_factor: partial rotary is not supported")
        scaling.pop("partial_rotary_factor", None)
        if rope_type == "default":
            return float(theta), None
        scaling["rope_type"] = rope_type
        if rope_type in ("llama3", "yarn"):
            omax = cfg.get("original_max_position_embeddings")
            if omax is not None:
                scaling["original_max_position_embeddings"] = omax
            scaling.setdefault(
                "original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)
            )
    if not isinstance(theta, int | float) or isinstance(theta, bool):
        raise ValueError(f"rope_theta must be a number, got {theta!r}")
    return float(theta), scaling
