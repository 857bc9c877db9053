"""The engine with the adaptive draft length: greedy output never depends on it, the draft KV
is written even on steps that draft nothing, and acceptance is reported per position."""

from __future__ import annotations

import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.config import EngineConfig
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.spec.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation
from tests.engine.engine_test_utils import run_engine

PROMPTS = [[(3 * i + j * 7) % 90 + 1 for j in range(9 + 4 * i)] for i in range(4)]


class ScriptedSpeculation(AdaptiveSpeculation):
    """Chooses draft lengths from a fixed script (cycled), measuring as usual."""

    def __init__(self, max_spec_tokens: int, script: list[int]) -> None:
        super().__init__(AdaptiveSpecConfig(max_spec_tokens))
        self.script = script
        self.calls = 0

    def _decide(self, num_requests: int) -> int:
        k = self.script[self.calls % len(self.script)]
        self.calls += 1
        return k


def _engine(tiny_model, drafter, script=None, adaptive=True):
    method = drafter.policy.name if drafter is not None else "ngram"
    config = EngineConfig(num_blocks=128, block_size=4, speculative_method=method,
                          num_spec_tokens=3, adaptive_speculation=adaptive)
    engine = LLMEngine(tiny_model, config, drafter=drafter)
    if script is not None:
        engine.spec_policy = engine.runner.spec_policy = ScriptedSpeculation(3, script)
    return engine


def test_greedy_output_is_the_same_for_any_draft_lengths(tiny_model):
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = run_engine(LLMEngine(tiny_model, EngineConfig(num_blocks=128, block_size=4)),
                       PROMPTS, params)
    for script in ([0], [3], [1, 0, 3, 2], [2, 2, 0]):
        engine = _engine(tiny_model, drafter, script)
        outputs = run_engine(engine, PROMPTS, params)
        assert {i: o.token_ids for i, o in outputs.items()} == \
            {i: o.token_ids for i, o in plain.items()}
        drafted = sum(o.num_draft_tokens for o in outputs.values())
        assert (drafted == 0) == (script == [0])
        assert engine.spec_decode_stats().steps_by_num_spec_tokens[0] >= (script.count(0) > 0)


def test_steps_without_drafts_still_write_the_draft_kv(tiny_model):
    """A block cached from a request that never drafted holds the same draft KV as one from a
    request that always drafted: later hits read valid draft KV either way."""
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=3)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    prompt = PROMPTS[2]
    kv = []
    for script in ([0], [3]):
        engine = _engine(tiny_model, drafter, script)
        (first,) = run_engine(engine, [prompt], params).values()
        tokens = prompt + first.token_ids  # 26 tokens, 25 computed
        again = engine.add_request(tokens + [1], SamplingParams(max_tokens=1))
        (out,) = engine.step()
        assert out.num_cached_tokens == 24  # whole blocks whose lookahead token is known
        blocks = engine.manager.get_block_ids(again)[0][:6]
        # [layers, 2, blocks, block_size, kv_heads, head_dim]
        kv.append(engine.proposer.kv_cache.storage[:, :, blocks].clone())
    torch.testing.assert_close(kv[0], kv[1], rtol=0, atol=1e-5)


def test_acceptance_is_reported_per_position(tiny_model):
    engine = _engine(tiny_model, None, adaptive=False)  # n-gram: the tiny model repeats itself
    outputs = run_engine(engine, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    stats = engine.spec_decode_stats()
    assert stats.steps_by_num_spec_tokens[3] > 0
    by_position = [0, 0, 0]
    accepted = [0, 0, 0]
    for output in outputs.values():
        assert sum(output.num_accepted_by_position) == output.num_accepted_tokens
        assert sum(output.num_drafts_by_position) == output.num_draft_tokens
        for j, (d, a) in enumerate(zip(output.num_drafts_by_position,
                                       output.num_accepted_by_position)):
            assert a <= d
            by_position[j] += d
            accepted[j] += a
        rates = output.acceptance_by_position
        assert len(rates) == len(output.num_drafts_by_position)
        assert all(0.0 <= r <= 1.0 for r in rates)
    assert tuple(by_position) == stats.num_drafts_by_position
    assert tuple(accepted) == stats.num_accepted_by_position
    assert sum(accepted) > 0
