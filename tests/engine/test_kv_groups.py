"""The engine builds its KV cache groups from the model: a Llama config with sliding layers
runs as a full-attention group plus a sliding-window group, one block table per group."""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, SlidingWindowSpec
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.generate import greedy_generate
from speckv.models.common.kv_layout import KVCacheGroup, KVCacheLayout, attention_layout
from speckv.models.llama.tiny import tiny_model
from tests.engine.engine_test_utils import run_engine

B = 4
WINDOW = 6


@pytest.fixture(scope="module")
def swa_llama():
    layer_types = ["sliding_attention", "full_attention"] * 2
    return tiny_model(seed=5, num_hidden_layers=4, layer_types=layer_types,
                      sliding_window=WINDOW)


def test_attention_layout_groups_layers_by_window():
    layout = attention_layout([None, 8, None, 16, 8], block_size=4)
    assert layout.specs == [FullAttentionSpec(4), SlidingWindowSpec(4, 8),
                            SlidingWindowSpec(4, 16)]
    assert layout.layer_to_group == {0: 0, 2: 0, 1: 1, 4: 1, 3: 2}
    assert layout.draft_group == 0
    assert attention_layout([8, 8], 4).draft_group is None
    with pytest.raises(ValueError, match="two KV cache groups"):
        KVCacheLayout((KVCacheGroup(FullAttentionSpec(4), (0, 1)),
                       KVCacheGroup(SlidingWindowSpec(4, 8), (1,))))


def test_full_attention_model_keeps_one_group(tiny_model):
    engine = LLMEngine(tiny_model, engine_config(block_size=B, num_blocks=32))
    assert engine.layout.num_groups == 1
    assert len(engine.manager.managers) == 1


def test_sliding_model_runs_two_groups_and_matches_reference(swa_llama):
    engine = LLMEngine(swa_llama, engine_config(block_size=B, num_blocks=64))
    assert engine.manager.managers[1].spec == SlidingWindowSpec(B, WINDOW)
    rng = random.Random(3)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (5, 23, 31)]
    params = SamplingParams(max_tokens=9)
    outputs = run_engine(engine, prompts, params)
    for index, prompt in enumerate(prompts):
        expected = greedy_generate(swa_llama, prompt, 9, block_size=B)
        assert outputs[f"r{index}"].token_ids == expected


def test_sliding_group_frees_blocks_behind_the_window_and_hits(swa_llama):
    engine = LLMEngine(swa_llama, engine_config(block_size=B, num_blocks=64))
    prompt = [random.Random(9).randrange(96) for _ in range(30)]
    params = SamplingParams(max_tokens=4)
    engine.add_request(prompt, params, "a")
    engine.step()  # the whole prompt in one chunk, then decodes
    engine.step()
    full, swa = engine.manager.get_block_ids("a")
    assert 0 not in full
    # the second step started at 30 computed tokens: keys before 30 - W + 1 are out of window
    # and their blocks went back to the pool (the runner's copy keeps the stale ids: the
    # attention never reads keys outside the window)
    num_null = (30 - WINDOW + 1) // B
    assert swa[:num_null] == [0] * num_null and 0 not in swa[num_null:]
    assert len(engine.runner.block_tables("a")[1]) == len(swa)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request(prompt, params, "b")
    (out,) = engine.step()
    assert out.num_cached_tokens == (30 - 1) // B * B
    while engine.has_unfinished_requests():
        (out,) = engine.step()
    assert out.token_ids == greedy_generate(swa_llama, prompt, 4, block_size=B)
    engine.manager.check_integrity()


def test_freed_window_blocks_reused_by_others_do_not_change_outputs(swa_llama):
    # few blocks: blocks freed behind one request's window are taken (and overwritten) by
    # the others while it still runs
    engine = LLMEngine(swa_llama, engine_config(block_size=B, num_blocks=40,
                                                max_num_batched_tokens=16))
    rng = random.Random(11)
    prompts = [[rng.randrange(96) for _ in range(n)] for n in (40, 33, 27, 45)]
    outputs = run_engine(engine, prompts, SamplingParams(max_tokens=12), stagger=3)
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"].token_ids == greedy_generate(swa_llama, prompt, 12,
                                                                 block_size=B)


def test_multi_group_model_refuses_a_connector_of_one_group_only(swa_llama):
    from speckv.connectors import OffloadConnector
    from speckv.connectors.capability import SINGLE_FULL_ATTENTION

    class OneGroup(OffloadConnector):
        kv_group_support = SINGLE_FULL_ATTENTION

    config = engine_config(block_size=B, num_blocks=64)
    with pytest.raises(ValueError, match="carries one KV cache group"):
        LLMEngine(swa_llama, config, connector=OneGroup(0.01))
    # the tiers carry every group (tests/connectors/test_hybrid_tiers.py)
    engine = LLMEngine(swa_llama, engine_config(block_size=B, num_blocks=64,
                                                kv_connector="offload"))
    assert engine.connector is not None and len(engine.connector.lanes) == 2
    engine.close()


def test_all_sliding_model_with_a_drafter_runs_one_full_group():
    from speckv.drafters.loaders import random_drafter

    model = tiny_model(seed=6, num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
                       sliding_window=WINDOW)
    assert model.kv_cache_layout(B).draft_group is None
    drafter = random_drafter("eagle", model, init_std=0.2, seed=1)
    engine = LLMEngine(model, engine_config(block_size=B, num_blocks=64,
                                            speculative_method="eagle", num_spec_tokens=2),
                       drafter=drafter)
    assert engine.layout.specs == [FullAttentionSpec(B)]
    prompt = [random.Random(4).randrange(96) for _ in range(27)]
    outputs = run_engine(engine, [prompt], SamplingParams(max_tokens=8))
    assert outputs["r0"].token_ids == greedy_generate(model, prompt, 8, block_size=B)
