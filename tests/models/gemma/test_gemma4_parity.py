"""Gemma 4 text decoder vs transformers' own `Gemma4ForCausalLM` on tiny random configs: fp32
logits within 1e-4 for prefill, chunked prefill and step-by-step decode, prompts longer than
the window; global layers with their own head size, K = V, proportional RoPE, per-layer
inputs, KV-shared layers and double-wide MLPs."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.models.gemma.gemma4 import Gemma4Config
from speckv.models.gemma.loader import build_gemma, gemma_config_of

transformers = pytest.importorskip("transformers")
from transformers import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

ATOL = 1e-4
WINDOW = 8
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
            max_position_embeddings=512)
VARIANTS = [
    dict(global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
         hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
         num_kv_shared_layers=2, use_double_wide_mlp=True, final_logit_softcapping=30.0),
    dict(global_head_dim=16, attention_k_eq_v=False, hidden_size_per_layer_input=0,
         num_kv_shared_layers=0, rope_parameters={
             "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
             "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}}),
]


def hf_pair(variant: dict, seed: int = 0):
    torch.manual_seed(seed)
    hf_cfg = Gemma4TextConfig(**TINY, **variant)
    hf_cfg._attn_implementation = "eager"
    hf = Gemma4ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norms and layer scalars
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
        for layer in hf.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
    cfg = hf_cfg.to_dict()
    config = gemma_config_of(cfg)
    assert isinstance(config, Gemma4Config)
    state = {**hf.state_dict(), **{k: v for k, v in hf.named_buffers() if "layer_scalar" in k}}
    return build_gemma(config, state.items()), hf


def paged_logits(model, ids: list[int], chunks: list[int], block_size: int = 4) -> torch.Tensor:
    num_blocks = -(-len(ids) // block_size) + 1
    kv = model.make_kv_cache(num_blocks, block_size)
    table = list(range(1, num_blocks))
    out, done = [], 0
    for size in chunks:
        md = AttentionMetadata.build([size], [done + size], [table], block_size)
        hidden = model(torch.tensor(ids[done:done + size]), md.positions(), kv, md).hidden_states
        out.append(model.compute_logits(hidden))
        done += size
    return torch.cat(out)


@pytest.mark.parametrize("variant", VARIANTS, ids=["full-features", "plain"])
def test_logits_match_transformers(variant):
    ours, hf = hf_pair(variant)
    ids = torch.randint(0, 256, (3 * WINDOW + 7,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids]), logits_to_keep=0).logits[0].float()
    torch.testing.assert_close(paged_logits(ours, ids, [len(ids)]), expected, rtol=0,
                               atol=ATOL)
    torch.testing.assert_close(paged_logits(ours, ids, [5] + [1] * (len(ids) - 5)), expected,
                               rtol=0, atol=ATOL)
    chunks = [WINDOW - 1, 2, WINDOW + 3, len(ids) - 2 * WINDOW - 4]
    torch.testing.assert_close(paged_logits(ours, ids, chunks), expected, rtol=0, atol=ATOL)


def test_refuses_moe_and_multimodal():
    cfg = Gemma4TextConfig(**TINY).to_dict()
    with pytest.raises(ValueError, match="MoE block"):
        gemma_config_of({**cfg, "enable_moe_block": True})
    with pytest.raises(ValueError, match="vision / audio towers"):
        gemma_config_of({**cfg, "model_type": "gemma4",
                         "architectures": ["Gemma4ForConditionalGeneration"]})


def test_hub_style_global_head_dim_keys():
    cfg = Gemma4TextConfig(**TINY).to_dict()
    cfg.pop("per_layer_config")
    hub = {**cfg, "global_head_dim": 32, "num_global_key_value_heads": 1,
           "attention_k_eq_v": True}
    config = gemma_config_of(hub)
    assert (config.global_head_dim, config.global_kv_heads) == (32, 1)
    assert gemma_config_of({**hub, "attention_k_eq_v": False}).global_kv_heads == 2
