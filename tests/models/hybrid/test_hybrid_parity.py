"""Our paged GDN hybrid reproduces transformers' Qwen3-Next / Qwen3.5 logits (fp32) from the same
weights: prefill in one forward, prefill in pieces, and decode token by token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from speckv.models.hybrid.loader import load_hybrid_dir
from tests.models.hybrid.hybrid_test_utils import OneRequest, hf_hybrid

pytest.importorskip("transformers")

FAMILIES = ("qwen3_next", "qwen3_5")


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_decode_match_transformers(family, tmp_path):
    hf = hf_hybrid(family)
    hf.save_pretrained(tmp_path)
    model, config = load_hybrid_dir(tmp_path)
    assert config.layer_types == tuple(hf.config.layer_types)
    assert config.rotary_dim == 4  # head_dim 16 * partial_rotary_factor 0.25
    ids = _ids(150)  # > 2 chunks of 64 and > several state units of 8
    ref = _hf_logits(hf, ids)
    assert ref.std() > 0.5  # not trivially near zero
    prefill = OneRequest(model).forward(ids)
    torch.testing.assert_close(prefill, ref, atol=1e-4, rtol=1e-4)
    step = OneRequest(model)
    decode = torch.cat([step.forward([t]) for t in ids])
    torch.testing.assert_close(decode, ref, atol=1e-4, rtol=1e-4)
    # chunked prefill (the chunked delta rule) equals token-by-token decode (the recurrent one)
    torch.testing.assert_close(prefill, decode, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_pieces_then_decode_matches_transformers(family, tmp_path):
    hf = hf_hybrid(family, seed=3)
    hf.save_pretrained(tmp_path)
    model, _ = load_hybrid_dir(tmp_path)
    ids = _ids(90, seed=2)
    ref = _hf_logits(hf, ids)
    run = OneRequest(model, block_size=4, unit=8)
    # pieces that start and end off the unit grid: states cross unit boundaries mid-forward
    pieces = [ids[:13], ids[13:40], ids[40:41], ids[41:80]]
    out = torch.cat([run.forward(p) for p in pieces] + [run.forward([t]) for t in ids[80:]])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_qwen3_5_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration layout: text_config, model.language_model.* names,
    a vision tower we skip."""
    hf = hf_hybrid("qwen3_5", seed=5)
    hf.save_pretrained(tmp_path / "text")
    cfg = json.loads((tmp_path / "text" / "config.json").read_text())
    out = tmp_path / "mm"
    out.mkdir()
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": cfg, "vision_config": {"depth": 1},
               "tie_word_embeddings": cfg["tie_word_embeddings"]}
    (out / "config.json").write_text(json.dumps(wrapped))
    tensors = load_file(str(tmp_path / "text" / "model.safetensors"))
    renamed = {name.replace("model.", "model.language_model.", 1): t
               for name, t in tensors.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(out / "model.safetensors"))
    model, config = load_hybrid_dir(out)
    assert config.architecture == "qwen3_5"
    ids = _ids(40, seed=6)
    torch.testing.assert_close(OneRequest(model).forward(ids), _hf_logits(hf, ids),
                               atol=1e-4, rtol=1e-4)


def test_bad_weights_are_named(tmp_path: Path):
    hf = hf_hybrid("qwen3_next")
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.0.linear_attn.A_log"
    tensors[name] = torch.zeros(3)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="A_log"):
        load_hybrid_dir(tmp_path)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48)


@pytest.mark.parametrize(("family", "extra"), [
    ("qwen3_next", {"mlp_only_layers": [1]}),  # layers 0, 2, 3 sparse MoE, layer 1 dense
    ("qwen3_5_moe", {}),  # every layer sparse MoE
])
def test_sparse_moe_layers_match_transformers(family, extra, tmp_path):
    hf = hf_hybrid(family, seed=7, **MOE, **extra)
    hf.save_pretrained(tmp_path)
    model, config = load_hybrid_dir(tmp_path)
    assert config.moe_layers == ((0, 2, 3) if family == "qwen3_next" else (0, 1, 2, 3))
    ids = _ids(70, seed=8)
    ref = _hf_logits(hf, ids)
    torch.testing.assert_close(OneRequest(model).forward(ids), ref, atol=1e-4, rtol=1e-4)
    step = OneRequest(model)
    torch.testing.assert_close(torch.cat([step.forward([t]) for t in ids]), ref, atol=1e-4,
                               rtol=1e-4)
