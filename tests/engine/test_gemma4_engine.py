"""The engine on a tiny Gemma 4 (global layers of another head size, K = V, per-layer inputs,
KV-shared layers): greedy outputs equal the reference decode, with and without EAGLE
speculation, and a second request's hit reads a cold run's KV (fp32 max |diff| 0)."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.generate import greedy_generate
from speckv.models.gemma.gemma4 import Gemma4ForCausalLM
from speckv.models.gemma.loader import gemma_config_of
from speckv.simulation.group_kv import max_abs_diff, read_group_kv
from tests.engine.engine_test_utils import run_engine

transformers = pytest.importorskip("transformers")
from transformers import Gemma4TextConfig  # noqa: E402

B = 4


@pytest.fixture(scope="module")
def gemma4() -> Gemma4ForCausalLM:
    cfg = Gemma4TextConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=9,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=64, num_kv_shared_layers=2,
        use_double_wide_mlp=True, final_logit_softcapping=30.0).to_dict()
    torch.manual_seed(4)
    return Gemma4ForCausalLM.from_config(gemma_config_of(cfg), init_std=0.3)


def test_layout_skips_kv_shared_layers(gemma4):
    layout = gemma4.kv_cache_layout(B)
    assert [group.layer_indices for group in layout.groups] == [(2,), (0, 1, 3)]


@pytest.mark.parametrize("speculative", [False, True])
def test_outputs_match_reference(gemma4, speculative):
    rng = random.Random(2)
    prompts = [[rng.randrange(64) for _ in range(n)] for n in (6, 29, 41)]
    kwargs = {}
    config = engine_config(block_size=B, num_blocks=48, max_num_batched_tokens=16)
    if speculative:
        kwargs["drafter"] = random_drafter("eagle", gemma4, init_std=0.3, seed=1)
        config = engine_config(block_size=B, num_blocks=48, max_num_batched_tokens=16,
                               speculative_method="eagle", num_spec_tokens=3)
    engine = LLMEngine(gemma4, config, **kwargs)
    outputs = run_engine(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True),
                         stagger=2)
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"].token_ids == greedy_generate(gemma4, prompt, 12,
                                                                 block_size=B)


@pytest.mark.exactness
def test_hit_reads_cold_run_kv(gemma4):
    prompt = [random.Random(5).randrange(64) for _ in range(45)]
    config = engine_config(block_size=B, num_blocks=128)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    warm = LLMEngine(gemma4, config)
    warm.add_request(prompt, params, "first")
    while warm.has_unfinished_requests():
        warm.step()
    warm.add_request(prompt, params, "second")
    warm.step()
    num_hit = warm.get_request("second").num_cached_tokens
    assert num_hit == 44
    hit = read_group_kv(warm, warm.manager.get_block_ids("second"), num_hit)
    cold = LLMEngine(gemma4, config)
    cold.add_request(prompt, params, "cold")
    cold.step()
    cold_kv = read_group_kv(cold, cold.runner.block_tables("cold"), num_hit, hit.block_indices)
    assert max_abs_diff(hit, cold_kv)[0] == 0.0


def test_kv_budget_counts_each_layers_shape(gemma4):
    per_block = gemma4.kv_cache_bytes_per_block(B)
    # 3 sliding owners (2 KV heads x 16) + 1 global owner (1 KV head x 32), K and V, fp32
    assert per_block == 2 * B * 4 * (3 * 2 * 16 + 1 * 32)
    engine = LLMEngine(gemma4, engine_config(block_size=B, kv_cache_memory_bytes=100 * per_block))
    assert engine.num_blocks == 100
    assert engine.runner.kv_cache.nbytes == 100 * per_block
