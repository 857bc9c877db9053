"""Speculative decoding with draft models in the engine: lossless greedy output under
preemption and eviction, and a prefix hit's draft KV equal to a cold run's."""

from __future__ import annotations

import pytest

from speckv.bench.draft_kv import measure
from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from tests.engine.engine_test_utils import StillClock

DRAFTERS = [("eagle", {}), ("eagle3", {"aux_layers": (0, 1, 1)}),
            ("mtp", {"num_modules": 1}),
            ("mtp", {"num_modules": 3})]


def _run(engine, prompts, max_tokens=10):
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    done = {}
    preemptions = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
                preemptions += output.num_preemptions
        engine.manager.check_integrity()
    return [done[i].token_ids for i in ids], preemptions, [done[i] for i in ids]


@pytest.mark.exactness
@pytest.mark.parametrize("fmt,kwargs", DRAFTERS)
def test_speculative_greedy_equals_greedy_under_pressure(tiny_model, fmt, kwargs):
    drafter = random_drafter(fmt, tiny_model, init_std=0.2, seed=5, **kwargs)
    prompts = [[(3 * i + j * 7) % 90 + 1 for j in range(10 + 3 * i)] for i in range(5)]
    prompts += [prompts[0][:8] + [5, 6, 7], list(prompts[1])]
    reference, _, _ = _run(LLMEngine(tiny_model, engine_config(num_blocks=200, block_size=4)),
                           prompts)
    method = fmt
    # preemption here comes from the 3 draft slots every step; the adaptive draft length
    # reads a clock that never moves (its choices the same on every machine)
    tight = engine_config(num_blocks=14, block_size=4, speculative_method=method,
                          num_spec_tokens=3, max_num_batched_tokens=16)
    outputs, preemptions, finals = _run(
        LLMEngine(tiny_model, tight, drafter=drafter, spec_clock=StillClock()), prompts)
    assert outputs == reference
    assert preemptions > 0, "the tight cache should force preemptions"
    assert sum(o.num_draft_tokens for o in finals) > 0


@pytest.mark.exactness
@pytest.mark.parametrize("fmt,kwargs", [("eagle", {}), ("mtp", {"num_modules": 2})])
def test_hit_reads_the_draft_kv_of_a_cold_run(tiny_model, fmt, kwargs):
    drafter = random_drafter(fmt, tiny_model, init_std=0.2, seed=2, **kwargs)
    prompt = [(5 * j) % 90 + 1 for j in range(26)]
    hit, control = measure(tiny_model, drafter, "float32", prompt, 4)
    lookahead = drafter.draft_kv_lookahead_tokens
    assert hit.hit_tokens == (26 - lookahead) // 4 * 4
    assert hit.target_max_abs_diff == 0 and hit.draft_max_abs_diff == 0
    # negative control: legacy hashes without the drop reuse a block whose draft KV came
    # from another successor token: target KV still equal, draft KV not
    assert control.target_max_abs_diff == 0
    assert control.draft_max_abs_diff > 1e-3


@pytest.mark.parametrize("reuse", [False, True])
def test_a_changed_successor_token_is_a_miss_in_lookahead_mode(tiny_model, reuse):
    drafter = random_drafter("eagle", tiny_model, seed=1)
    engine = LLMEngine(tiny_model, engine_config(num_blocks=64, block_size=4,
                                                 speculative_method="eagle", num_spec_tokens=2,
                                                 disable_divergent_block_reuse=not reuse),
                       drafter=drafter)
    shared = [(3 * j) % 90 + 1 for j in range(8)]
    _run(engine, [shared + [40, 41, 42, 43]], max_tokens=3)
    _, _, (other,) = _run(engine, [shared + [50, 41, 42, 43]], max_tokens=3)
    _, _, (same,) = _run(engine, [shared + [40, 9, 9, 9]], max_tokens=3)
    # the block [4, 8) under another successor is a miss; with block reuse it is copied and
    # its last position recomputed
    assert (other.num_cached_tokens, same.num_cached_tokens) == ((7 if reuse else 4), 8)


def test_kv_memory_budget_counts_the_draft_layers(tiny_model):
    drafter = random_drafter("mtp", tiny_model, seed=1, num_modules=2)
    budget = engine_config(kv_cache_memory_bytes=4 * 1024**2)
    plain = LLMEngine(tiny_model, budget)
    speculative = LLMEngine(tiny_model, engine_config(kv_cache_memory_bytes=4 * 1024**2,
                                                      speculative_method="mtp",
                                                      num_spec_tokens=2), drafter=drafter)
    # 2 target layers + 2 MTP modules: half the blocks for the same memory
    assert abs(speculative.num_blocks - plain.num_blocks // 2) <= 1
