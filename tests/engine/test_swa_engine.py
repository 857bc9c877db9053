"""The engine on a sliding-window model (tiny random Gemma 3): greedy outputs equal the
reference decode, blocks behind the window are freed, and a second request's hit reads
exactly the KV (fp32, max |diff| 0) a cold run writes, in both KV cache groups."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.cache import FullAttentionSpec, SlidingWindowSpec
from speckv.engine.engine_args import engine_config
from speckv.engine.llm import LLM
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.generate import greedy_generate
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from speckv.simulation.group_kv import max_abs_diff, read_group_kv
from tests.engine.engine_test_utils import run_engine

B = 4
WINDOW = 10


@pytest.fixture(scope="module")
def gemma() -> GemmaForCausalLM:
    torch.manual_seed(21)
    config = tiny_gemma_config(sliding_window=WINDOW, final_logit_softcapping=20.0)
    return GemmaForCausalLM.from_config(config, init_std=0.15, norm_std=0.2)


def first_step(engine: LLMEngine, prompt: list[int], request_id: str, max_tokens: int = 5):
    """Add, run one step (the prompt), read the KV of the hit (or all blocks when cold),
    run to the end; (hit tokens, GroupKV, output token ids)."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       request_id)
    engine.step()
    num_hit = engine.get_request(request_id).num_cached_tokens
    tables = engine.manager.get_block_ids(request_id)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            final = output
        engine.manager.check_integrity()
    return num_hit, tables, final


def test_engine_outputs_match_reference_decode(gemma):
    engine = LLMEngine(gemma, engine_config(block_size=B, num_blocks=128,
                                            max_num_batched_tokens=24))
    assert engine.manager.managers[0].spec == FullAttentionSpec(B)
    assert engine.manager.managers[1].spec == SlidingWindowSpec(B, WINDOW)
    rng = random.Random(1)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 31, 58)]
    outputs = run_engine(engine, prompts, SamplingParams(max_tokens=14, ignore_eos=True),
                         stagger=2)
    for index, prompt in enumerate(prompts):
        assert outputs[f"r{index}"].token_ids == greedy_generate(gemma, prompt, 14,
                                                                 block_size=B)


@pytest.mark.exactness
@pytest.mark.parametrize("prompt_len", [9, 45, 101])
def test_second_request_hit_reads_cold_run_kv(gemma, prompt_len):
    prompt = [random.Random(prompt_len).randrange(256) for _ in range(prompt_len)]
    config = engine_config(block_size=B, num_blocks=256)
    warm = LLMEngine(gemma, config)
    first_step(warm, prompt, "first")
    warm.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "second")
    warm.step()
    request = warm.get_request("second")
    num_hit = request.num_cached_tokens
    assert num_hit == (prompt_len - 1) // B * B
    hit_tables = warm.manager.get_block_ids("second")
    hit = read_group_kv(warm, hit_tables, num_hit)
    if prompt_len > WINDOW + B:
        # the sliding group holds only the blocks the next token can see: nulls before
        assert hit_tables[1][0] == 0 and len(hit.block_indices[1]) < num_hit // B
    warm_out = None
    while warm.has_unfinished_requests():
        for output in warm.step():
            warm_out = output

    cold = LLMEngine(gemma, config)
    cold.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "cold")
    cold.step()
    cold_kv = read_group_kv(cold, cold.runner.block_tables("cold"), num_hit,
                            hit.block_indices)
    target_diff, _ = max_abs_diff(hit, cold_kv)
    assert target_diff == 0.0
    cold_out = None
    while cold.has_unfinished_requests():
        for output in cold.step():
            cold_out = output
    assert warm_out.token_ids == cold_out.token_ids
    assert warm_out.token_ids == greedy_generate(gemma, prompt, 5, block_size=B)
    if num_hit:
        # negative control: a different first token changes the KV the hit holds
        other = LLMEngine(gemma, config)
        other.add_request([(prompt[0] + 1) % 256, *prompt[1:]], SamplingParams(max_tokens=1),
                          "other")
        other.step()
        other_kv = read_group_kv(other, other.runner.block_tables("other"), num_hit,
                                 hit.block_indices)
        assert max_abs_diff(other_kv, cold_kv)[0] > 1e-4


def test_llm_runs_hybrid_swa_by_name():
    llm = LLM("hybrid-swa", progress=False, kv_cache_memory_bytes=64 << 20)
    assert llm.engine.layout.num_groups == 2
    prompt = list(range(5, 300))
    first, second = (llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))[0]
                     for _ in range(2))
    assert second.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert first.token_ids == second.token_ids


def test_llm_loads_a_gemma_checkpoint_directory(gemma, tmp_path):
    from speckv.models.gemma.loader import save_gemma_dir

    save_gemma_dir(tmp_path, gemma)
    llm = LLM(str(tmp_path), progress=False, block_size=B, num_blocks=64)
    assert type(llm.engine.model) is GemmaForCausalLM
    prompt = list(range(3, 40))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.token_ids == greedy_generate(gemma, prompt, 6, block_size=B)
