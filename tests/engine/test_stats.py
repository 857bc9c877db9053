"""`LLMEngine.last_stats`: the per-step record a metrics exporter reads. Its totals must agree
with what the requests themselves report (cached tokens, drafts, preemptions)."""

from __future__ import annotations

import pytest

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.stats import SchedulerStats, StatsCollector
from tests.engine.engine_test_utils import shared_prefix_prompts


def _drive(engine, prompts, max_tokens=6):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{index}")
    finals, steps = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        assert isinstance(engine.last_stats, SchedulerStats)
        steps.append(engine.last_stats)
    return finals, steps


def test_prefix_counters_equal_the_requests_cached_tokens(tiny_model):
    engine = LLMEngine(tiny_model, engine_config(num_blocks=128, block_size=4, max_num_seqs=3))
    prompts = shared_prefix_prompts(9, 90, seed=3)
    finals, steps = _drive(engine, prompts)
    prefix = [s.prefix_cache for s in steps]
    assert sum(p.num_requests for p in prefix) == len(prompts)
    assert sum(p.num_query_tokens for p in prefix) == sum(len(p) for p in prompts)
    hits = sum(p.num_hit_tokens for p in prefix)
    assert hits == sum(o.num_cached_tokens for o in finals.values()) > 0
    admitted = [rid for s in steps for rid in s.newly_admitted_request_ids]
    assert sorted(admitted) == sorted(finals)
    assert max(s.num_running_reqs for s in steps) == 3  # max_num_seqs
    assert steps[0].num_waiting_reqs == 6
    assert max(s.kv_cache_usage for s in steps) > 0
    assert steps[-1].num_used_blocks == 0 and steps[-1].kv_cache_usage == 0
    assert all(s.spec_decoding is None for s in steps)


def test_preemptions_are_counted_and_requeries_kept_apart(tiny_model):
    prompts = [[(3 * i + j * 7) % 90 + 1 for j in range(10 + 3 * i)] for i in range(5)]
    engine = LLMEngine(tiny_model, engine_config(num_blocks=14, block_size=4,
                                                 max_num_batched_tokens=16))
    finals, steps = _drive(engine, prompts, max_tokens=10)
    preemptions = sum(s.num_preemptions for s in steps)
    assert preemptions == sum(o.num_preemptions for o in finals.values()) > 0
    prefix = [s.prefix_cache for s in steps]
    assert sum(p.num_preempted_requests for p in prefix) == preemptions
    assert sum(p.num_requests for p in prefix) == len(prompts)
    assert sum(p.num_hit_tokens for p in prefix) == sum(
        o.num_cached_tokens for o in finals.values())


def test_spec_decoding_counters_equal_the_requests_drafts(tiny_model):
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=5)
    engine = LLMEngine(tiny_model, engine_config(num_blocks=128, block_size=4,
                                                 speculative_method="eagle", num_spec_tokens=3),
                       drafter=drafter)
    # repetitive prompts: the random drafter gets some drafts right
    prompts = [[5, 6, 7, 8] * 4, [9, 10] * 7, [11] * 12]
    finals, steps = _drive(engine, prompts, max_tokens=20)
    spec = [s.spec_decoding for s in steps if s.spec_decoding is not None]
    assert len(spec) == len(steps)
    draft_tokens = sum(s.num_draft_tokens for s in spec)
    accepted = sum(s.num_accepted_tokens for s in spec)
    assert draft_tokens == sum(o.num_draft_tokens for o in finals.values()) > 0
    assert accepted == sum(o.num_accepted_tokens for o in finals.values())
    per_pos = [sum(s.num_accepted_tokens_per_pos[i] for s in spec) for i in range(3)]
    assert sum(per_pos) == accepted
    assert per_pos[0] >= per_pos[1] >= per_pos[2]
    assert sum(s.num_drafts for s in spec) * 3 >= draft_tokens


def test_collector_rejects_impossible_acceptance_and_resets():
    collector = StatsCollector(num_spec_tokens=2)
    with pytest.raises(ValueError):
        collector.record_verification(2, 3)
    collector.record_verification(2, 1)
    collector.record_admission("a", 10, 4, preempted=False)
    first = collector.take(1, 0, num_free_blocks=6, num_usable_blocks=8)
    assert first.spec_decoding is not None
    assert first.spec_decoding.num_accepted_tokens_per_pos == (1, 0)
    assert first.kv_cache_usage == 0.25 and first.newly_admitted_request_ids == ("a",)
    second = collector.take(0, 0, num_free_blocks=8, num_usable_blocks=8)
    assert second.prefix_cache.num_requests == 0
    assert second.spec_decoding is not None and second.spec_decoding.num_drafts == 0
