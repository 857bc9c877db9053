"""Gemma 3 text decoder vs transformers' own `Gemma3ForCausalLM` on tiny random configs: fp32
logits within 1e-4 for prefill and step-by-step decode, prompts longer than the window."""

from __future__ import annotations

import json

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.models.gemma.gemma3 import GemmaConfig, GemmaForCausalLM, tiny_gemma_config
from speckv.models.gemma.loader import build_gemma, load_gemma_dir, save_gemma_dir

transformers = pytest.importorskip("transformers")
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

ATOL = 1e-4


def hf_pair(seed: int, **overrides) -> tuple[GemmaForCausalLM, Gemma3ForCausalLM]:
    """Our model and transformers' with the same random weights (HF's own init)."""
    config = tiny_gemma_config(**overrides)
    torch.manual_seed(seed)
    hf_cfg = Gemma3TextConfig(**{k: v for k, v in config.to_hf_config().items()
                                 if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    hf = Gemma3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norms: HF inits Gemma norms to 0 (identity)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    ours = build_gemma(GemmaConfig.from_hf_config(hf_cfg.to_dict()), hf.state_dict().items())
    return ours, hf


def paged_logits(model: GemmaForCausalLM, ids: list[int], chunks: list[int],
                 block_size: int = 4) -> torch.Tensor:
    """Logits of every position, computing `ids` in chunks of the given sizes over one
    contiguous block table. [len(ids), vocab]"""
    num_blocks = -(-len(ids) // block_size) + 1
    kv = model.make_kv_cache(num_blocks, block_size)
    table = list(range(1, num_blocks))
    out, done = [], 0
    for size in chunks:
        md = AttentionMetadata.build([size], [done + size], [table], block_size)
        x = torch.tensor(ids[done:done + size])
        hidden = model(x, md.positions(), kv, md).hidden_states
        out.append(model.compute_logits(hidden))
        done += size
    assert done == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("overrides", [
    {},
    {"final_logit_softcapping": 3.0, "sliding_window": 5},
    {"rope_scaling": {"rope_type": "linear", "factor": 8.0}, "num_key_value_heads": 1},
])
def test_prefill_and_decode_logits_match_transformers(overrides):
    ours, hf = hf_pair(0, **overrides)
    window = ours.config.sliding_window
    ids = torch.randint(0, ours.config.vocab_size, (3 * window + 7,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()  # [n, vocab]
    prefill = paged_logits(ours, ids, [len(ids)])
    torch.testing.assert_close(prefill, expected, rtol=0, atol=ATOL)
    # a prefill chunk then one token per step, and uneven chunks crossing the window
    decode = paged_logits(ours, ids, [5] + [1] * (len(ids) - 5))
    torch.testing.assert_close(decode, expected, rtol=0, atol=ATOL)
    chunked = paged_logits(ours, ids, [window - 1, 2, window + 3, len(ids) - 2 * window - 4])
    torch.testing.assert_close(chunked, expected, rtol=0, atol=ATOL)
    assert (expected.argmax(-1) == prefill.argmax(-1)).all()
    # negative control: the same weights without the window differ past the window
    for layer in ours.layers:
        layer.self_attn.sliding_window = None
    unwindowed = paged_logits(ours, ids, [len(ids)])
    assert (unwindowed[window:] - expected[window:]).abs().max() > 1e-3


def test_hf_decode_with_cache_matches_step_by_step():
    ours, hf = hf_pair(2)
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        out = hf(torch.tensor([ids[:10]]), use_cache=True)
        cache, steps = out.past_key_values, [out.logits[0, -1]]
        for token in ids[10:]:
            out = hf(torch.tensor([[token]]), cache=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1])
    expected = torch.stack(steps).float()
    got = paged_logits(ours, ids, [10] + [1] * 30)[9:]
    torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


def test_save_and_load_dir_round_trip(tmp_path):
    ours, _ = hf_pair(4)
    save_gemma_dir(tmp_path, ours)
    loaded = load_gemma_dir(tmp_path)
    ids = list(range(1, 30))
    torch.testing.assert_close(paged_logits(loaded, ids, [29]), paged_logits(ours, ids, [29]),
                               rtol=0, atol=0)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gemma3_text"


@pytest.mark.parametrize(("patch", "message"), [
    ({"vision_config": {"hidden_size": 8}}, "vision tower"),
    ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]},
     "vision tower"),
    ({"num_experts": 8}, "MoE block"),
    ({"kv_lora_rank": 64}, "MLA attention"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "gemma4_text", "architectures": ["Gemma4ForCausalLM"]}, "Gemma 4"),
])
def test_refuses_layers_it_does_not_have(patch, message):
    cfg = {**tiny_gemma_config().to_hf_config(), **patch}
    with pytest.raises(ValueError, match=message):
        GemmaConfig.from_hf_config(cfg)
