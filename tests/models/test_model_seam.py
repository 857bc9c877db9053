"""The model seam: every family answers what the engine asks of a target (`TargetModel`), a
state group is a property of the layout, and loading by name or path goes through one table."""

from __future__ import annotations

import json

import pytest
import torch

from speckv.attention import bytes_per_block
from speckv.models.base import has_state_group
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from speckv.models.hybrid.loader import tiny_hybrid
from speckv.models.llama.tiny import tiny_model
from speckv.models.registry import BUILTIN_MODELS, family_of, load_model, random_init_note

SEAM = ("config", "dtype", "device", "kv_cache_layout", "kv_cache_bytes_per_block",
        "make_layout_kv_cache", "forward", "compute_logits", "embed_tokens", "lm_head")


def _targets():
    torch.manual_seed(0)
    return {"llama": tiny_model(), "gemma3": GemmaForCausalLM.from_config(tiny_gemma_config()),
            "gdn-hybrid": tiny_hybrid()}


def test_every_family_answers_the_seam():
    for name, model in _targets().items():
        for attribute in SEAM:
            assert hasattr(model, attribute), (name, attribute)
        layout = model.kv_cache_layout(16, None)
        cache = model.make_layout_kv_cache(layout, 4)
        assert cache is not None and model.kv_cache_bytes_per_block(16) > 0
        assert layout.has_state_group == (name == "gdn-hybrid") == has_state_group(model)


def test_attention_bytes_per_block_are_every_layers_kv():
    model = tiny_model()
    c = model.config
    assert model.kv_cache_bytes_per_block(16) == bytes_per_block(
        c.num_hidden_layers, 16, c.num_key_value_heads, c.head_dim, model.dtype)


def test_the_decoder_tail_refuses_an_aux_layer_out_of_range():
    model = tiny_model()
    cache = model.make_kv_cache(4, 4)
    with pytest.raises(ValueError, match="aux_layers entry 99 out of range"):
        model(torch.tensor([1]), torch.tensor([0]), cache, None, aux_layers=(99,))


def test_family_of_reads_config_json(tmp_path):
    cases = {"qwen3_next": "gdn-hybrid", "gemma3_text": "gemma", "llama": "llama"}
    for model_type, family in cases.items():
        d = tmp_path / model_type
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        assert family_of(d).name == family
    empty = tmp_path / "empty"
    empty.mkdir()
    assert family_of(empty).name == "llama"  # whose loader says config.json is missing
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        load_model(empty, "float32", "cpu")


def test_names_and_notes():
    assert set(BUILTIN_MODELS) == {"builtin", "hybrid-swa", "hybrid-gdn"}
    assert "RANDOM-INIT" in (random_init_note("hybrid-gdn") or "")
    assert random_init_note("builtin") is None and random_init_note("/some/dir") is None
    with pytest.raises(FileNotFoundError, match="not 'builtin', an HF model directory"):
        load_model("no-such-model", "float32", "cpu")
