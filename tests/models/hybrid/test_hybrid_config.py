"""HybridConfig parsing: layer interleaving, partial rotary, refused layer types named."""

from __future__ import annotations

import pytest

from speckv.models.hybrid.config import HybridConfig
from speckv.models.hybrid.loader import tiny_hybrid_config
from tests.models.hybrid.hybrid_test_utils import TINY_HF


def _next(**kw):
    return {"model_type": "qwen3_next", "num_experts": 0, **TINY_HF, **kw}


def test_full_attention_interval_gives_the_layer_types():
    cfg = HybridConfig.from_hf_config(_next(num_hidden_layers=8, full_attention_interval=4))
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",) \
        + ("linear_attention",) * 3 + ("full_attention",)
    assert cfg.linear_layers == (0, 1, 2, 4, 5, 6) and cfg.attention_layers == (3, 7)
    explicit = HybridConfig.from_hf_config(
        _next(layer_types=["full_attention", "linear_attention", "linear_attention",
                           "linear_attention"]))
    assert explicit.attention_layers == (0,)


def test_partial_rotary_and_roundtrip():
    cfg = HybridConfig.from_hf_config(
        _next(rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                               "partial_rotary_factor": 0.5}))
    assert cfg.rope_theta == 5e5 and cfg.rotary_dim == 8
    assert HybridConfig.from_hf_config(cfg.to_hf_config()) == cfg
    tiny = tiny_hybrid_config(architecture="qwen3_5")
    assert HybridConfig.from_hf_config(tiny.to_hf_config()) == tiny


def test_moe_layers_from_the_config():
    cfg = HybridConfig.from_hf_config(_next(num_experts=8, num_experts_per_tok=2,
                                            decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.moe_layers == (1,) and cfg.num_experts == 8  # (i + 1) % 2 == 0, minus layer 3
    assert HybridConfig.from_hf_config(cfg.to_hf_config()) == cfg
    dense = HybridConfig.from_hf_config(_next(num_experts=8, mlp_only_layers=[0, 1, 2, 3]))
    assert dense.moe_layers == ()
    everywhere = HybridConfig.from_hf_config(
        {"model_type": "qwen3_5_moe_text", **{k: v for k, v in TINY_HF.items()
                                              if k != "intermediate_size"},
         "num_experts": 4, "num_experts_per_tok": 2})
    assert everywhere.moe_layers == (0, 1, 2, 3) and everywhere.architecture == "qwen3_5"
    assert HybridConfig.from_hf_config(everywhere.to_hf_config()) == everywhere
    with pytest.raises(ValueError, match="num_experts_per_tok must be <= num_experts"):
        tiny_hybrid_config(moe_layers=(0,), num_experts=2, num_experts_per_tok=3,
                           moe_intermediate_size=8, shared_expert_intermediate_size=8)


def test_other_refusals():
    with pytest.raises(ValueError, match="layer 1: layer type 'mamba2'"):
        HybridConfig.from_hf_config(
            _next(layer_types=["full_attention", "mamba2", "linear_attention",
                               "full_attention"]))
    with pytest.raises(ValueError, match="only default RoPE"):
        HybridConfig.from_hf_config(_next(rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ValueError, match="not a Gated DeltaNet hybrid"):
        HybridConfig.from_hf_config({"model_type": "llama"})
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        tiny_hybrid_config(linear_num_value_heads=3)
