"""The Qwen3-Next / Qwen3.5 checkpoints' own MTP head: loaded from `mtp.*` tensors next to the
target's, run by the engine (greedy speculative output equals greedy)."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

from speckv.drafters.gated_mtp import GatedMTPDrafter, load_gated_mtp, random_gated_mtp
from speckv.engine.llm import LLM
from speckv.engine.sampling_params import SamplingParams
from speckv.models.hybrid.loader import load_hybrid_dir
from tests.models.hybrid.hybrid_test_utils import hf_hybrid

pytest.importorskip("transformers")


def _checkpoint_with_mtp(tmp_path, family: str, num_modules: int, **hf_kw):
    hf = hf_hybrid(family, **hf_kw)
    hf.save_pretrained(tmp_path)
    model, _ = load_hybrid_dir(tmp_path)
    drafter = random_gated_mtp(model, num_modules, seed=3)
    tensors = {drafter.hf_name(k): v.contiguous() for k, v in drafter.state_dict().items()}
    save_file(tensors, str(tmp_path / "mtp.safetensors"))
    return model, drafter


@pytest.mark.parametrize(("family", "hf_kw", "num_modules"), [
    ("qwen3_next", {}, 1),
    ("qwen3_5", {}, 2),
    ("qwen3_next", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 48}, 1),
])
def test_mtp_head_loads_from_the_checkpoint(tmp_path, family, hf_kw, num_modules):
    model, saved = _checkpoint_with_mtp(tmp_path, family, num_modules, **hf_kw)
    loaded = load_gated_mtp(tmp_path, model)
    assert isinstance(loaded, GatedMTPDrafter) and loaded.policy.num_modules == num_modules
    assert bool(loaded.config.moe_layers) == bool(hf_kw)
    for name, tensor in saved.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_engine_speculates_with_the_checkpoint_mtp_head(tmp_path):
    _checkpoint_with_mtp(tmp_path, "qwen3_next", 1)
    prompt = [random.Random(1).randrange(97) for _ in range(30)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(str(tmp_path), progress=False, block_size=4, mamba_block_size=8,
                num_blocks=256)
    spec = LLM(str(tmp_path), progress=False, block_size=4, mamba_block_size=8,
               num_blocks=256, speculative_method="mtp", num_spec_tokens=2,
               speculative_model=str(tmp_path))
    (a,), (b,) = plain.generate([prompt], params), spec.generate([prompt], params)
    assert a.token_ids == b.token_ids
    assert b.num_draft_tokens > 0


def test_a_checkpoint_without_mtp_is_refused(tmp_path):
    hf_hybrid("qwen3_next").save_pretrained(tmp_path)
    model, _ = load_hybrid_dir(tmp_path)
    with pytest.raises(ValueError, match="has no MTP head"):
        load_gated_mtp(tmp_path, model)
