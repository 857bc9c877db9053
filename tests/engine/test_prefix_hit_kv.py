"""A second identical request hits floor((N-1)/B)*B tokens and reads the same K/V as a cold
run of a fresh engine writes."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

B = 4


def kv_at(engine: LLMEngine, request_id: str, num_blocks: int) -> torch.Tensor:
    block_ids = engine.manager.get_block_ids(request_id)[0][:num_blocks]
    # [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    return engine.runner.kv_cache.storage[:, :, block_ids].clone()


@pytest.mark.exactness
def test_hit_length_and_hit_kv_equal_cold_run(tiny_model):
    rng = random.Random(7)
    for n in (1, 4, 5, 23, 24, 25):
        prompt = [rng.randrange(tiny_model.config.vocab_size) for _ in range(n)]
        expected_hit = (n - 1) // B * B
        params = SamplingParams(max_tokens=3)
        warm = LLMEngine(tiny_model, engine_config(block_size=B, num_blocks=64))
        warm.add_request(prompt, params, "first")
        while warm.has_unfinished_requests():
            warm.step()
        warm.add_request(prompt, params, "second")
        (out,) = warm.step()
        assert out.num_cached_tokens == expected_hit
        hit_kv = kv_at(warm, "second", expected_hit // B)

        cold = LLMEngine(tiny_model, engine_config(block_size=B, num_blocks=64))
        cold.add_request(prompt, params, "cold")
        (cold_out,) = cold.step()
        assert cold_out.num_cached_tokens == 0
        cold_kv = kv_at(cold, "cold", expected_hit // B)
        torch.testing.assert_close(hit_kv, cold_kv, rtol=0, atol=1e-6)
        assert out.token_ids == cold_out.token_ids
        if expected_hit:
            # negative control: a different first token changes every block's K/V
            other = LLMEngine(tiny_model, engine_config(block_size=B, num_blocks=64))
            other.add_request([(prompt[0] + 1) % 96, *prompt[1:]], params, "other")
            other.step()
            assert (kv_at(other, "other", expected_hit // B) - cold_kv).abs().max() > 1e-3
