"""ModelConfig parsing (Llama / Qwen2 / Qwen3 / SmolLM2 config.json) and validation."""

from __future__ import annotations

from typing import Any

import pytest

from speckv.models.common.config import ModelConfig

SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "hidden_act": "silu",
    "rope_theta": 100000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def _base(**kw: Any) -> dict[str, Any]:
    cfg = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    cfg.update(kw)
    return cfg


def test_smollm2() -> None:
    c = ModelConfig.from_hf_config(SMOLLM2_135M)
    assert c.architecture == "llama" and c.head_dim == 64 and c.num_queries_per_kv == 3
    assert c.tie_word_embeddings and c.eos_token_ids == (2,) and c.torch_dtype == "bfloat16"
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert c.layer_types == ("full_attention",) * 30
    assert ModelConfig.from_hf_config(c.to_hf_config()) == c


def test_llama3_rope_scaling_and_eos_list() -> None:
    hf = dict(
        SMOLLM2_135M,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        eos_token_id=[2, 7],
    )
    c = ModelConfig.from_hf_config(hf)
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert c.eos_token_ids == (2, 7)


def test_transformers5_rope_parameters() -> None:
    hf = dict(SMOLLM2_135M)
    del hf["rope_theta"], hf["rope_scaling"]
    hf["rope_parameters"] = {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
    c = ModelConfig.from_hf_config(hf)
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    assert ModelConfig.from_hf_config(hf).rope_scaling is None


def test_qwen2_and_qwen3() -> None:
    q2 = ModelConfig.from_hf_config(
        dict(_base(), model_type="qwen2", use_sliding_window=False, sliding_window=4096)
    )
    assert q2.attention_bias and not q2.attention_output_bias and not q2.qk_norm
    assert q2.sliding_window is None
    q2sw = ModelConfig.from_hf_config(
        dict(
            _base(),
            model_type="qwen2",
            use_sliding_window=True,
            sliding_window=16,
            max_window_layers=1,
        )
    )
    assert q2sw.layer_types == ("full_attention", "sliding_attention")
    assert q2sw.layer_sliding_window(1) == 16 and q2sw.layer_sliding_window(0) is None
    q3 = ModelConfig.from_hf_config(dict(_base(head_dim=32), model_type="qwen3"))
    assert q3.qk_norm and q3.head_dim == 32 and not q3.attention_bias


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"hidden_size": -1}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"num_attention_heads": 5}, "num_attention_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"rope_theta": 0}, "rope_theta"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps"),
        ({"architecture": "gpt2"}, "architecture"),
        ({"rope_scaling": {"rope_type": "weird"}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0.5}}, "rope_scaling.factor"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor"),
        ({"layer_types": ("full_attention",)}, "layer_types"),
        ({"layer_types": ("full_attention", "sliding_attention")}, "sliding_window"),
        ({"sliding_window": 0}, "sliding_window"),
        ({"eos_token_ids": (100,)}, "eos_token_ids"),
        ({"bos_token_id": -1}, "bos_token_id"),
        ({"torch_dtype": "int8"}, "torch_dtype"),
        ({"max_position_embeddings": 1.5}, "max_position_embeddings"),
    ],
)
def test_bad_values_name_the_field(override: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        ModelConfig(**_base(**override))


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"model_type": "gpt_neox"}, "architecture"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_bad_hf_configs(override: dict[str, Any], field: str) -> None:
    hf = dict(SMOLLM2_135M, **override)
    if override.get("vocab_size", 1) is None:
        del hf["vocab_size"]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(hf)


def test_frozen() -> None:
    c = ModelConfig(**_base())
    with pytest.raises(AttributeError):
        c.vocab_size = 5  # type: ignore[misc]
