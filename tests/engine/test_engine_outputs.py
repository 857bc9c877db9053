"""The engine's greedy output equals the reference single-request loop, whatever the batching:
prefix caching on/off under eviction pressure, chunked prefill, preemption, n-gram drafts."""

from __future__ import annotations

import pytest

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.generate import greedy_generate
from tests.engine.engine_test_utils import StillClock, run_engine, shared_prefix_prompts

GREEDY = SamplingParams(max_tokens=12)


def reference(model, prompts, max_tokens=12):
    return [greedy_generate(model, p, max_tokens, block_size=4) for p in prompts]


def outputs_in_order(final, n):
    return [final[f"r{i}"].token_ids for i in range(n)]


@pytest.mark.exactness
def test_greedy_equals_reference_loop(tiny_model):
    prompts = shared_prefix_prompts(6, tiny_model.config.vocab_size, seed=1)
    engine = LLMEngine(tiny_model, engine_config(block_size=4, num_blocks=128))
    final = run_engine(engine, prompts, GREEDY)
    assert outputs_in_order(final, len(prompts)) == reference(tiny_model, prompts)
    assert all(final[f"r{i}"].finish_reason == "length" for i in range(len(prompts)))


@pytest.mark.exactness
def test_prefix_caching_equals_no_caching_under_eviction_pressure(tiny_model):
    vocab = tiny_model.config.vocab_size
    prompts = shared_prefix_prompts(16, vocab, seed=2)
    cold = LLMEngine(
        tiny_model, engine_config(block_size=4, num_blocks=256, enable_prefix_caching=False)
    )
    expected = outputs_in_order(run_engine(cold, prompts, GREEDY), len(prompts))
    # 24 blocks of 4 tokens for 16 requests of up to 44 tokens: hits, evictions, preemptions
    cached = LLMEngine(
        tiny_model, engine_config(block_size=4, num_blocks=24, max_num_batched_tokens=32)
    )
    final = run_engine(cached, prompts, GREEDY, stagger=2)
    assert outputs_in_order(final, len(prompts)) == expected
    assert sum(o.num_cached_tokens for o in final.values()) > 0
    assert sum(o.num_preemptions for o in final.values()) > 0


@pytest.mark.exactness
def test_chunked_prefill_equals_one_shot(tiny_model):
    prompts = shared_prefix_prompts(4, tiny_model.config.vocab_size, seed=3, prefix_lens=(40,))
    one_shot = LLMEngine(tiny_model, engine_config(block_size=4, num_blocks=128))
    chunked = LLMEngine(
        tiny_model, engine_config(block_size=4, num_blocks=128, max_num_batched_tokens=5)
    )
    a = outputs_in_order(run_engine(one_shot, prompts, GREEDY), len(prompts))
    b = outputs_in_order(run_engine(chunked, prompts, GREEDY), len(prompts))
    assert a == b == reference(tiny_model, prompts)


def test_preempted_requests_finish_with_the_same_output(tiny_model):
    prompts = shared_prefix_prompts(6, tiny_model.config.vocab_size, seed=4, prefix_lens=(20,))
    engine = LLMEngine(
        tiny_model,
        engine_config(block_size=4, num_blocks=16, enable_prefix_caching=False),
    )
    final = run_engine(engine, prompts, SamplingParams(max_tokens=20))
    assert sum(o.num_preemptions for o in final.values()) > 0
    assert outputs_in_order(final, len(prompts)) == reference(tiny_model, prompts, 20)


@pytest.mark.parametrize("num_blocks", [256, 36])
def test_ngram_speculative_greedy_equals_plain_greedy(tiny_model, num_blocks):
    base = shared_prefix_prompts(8, tiny_model.config.vocab_size, seed=5)
    # repetitive prompts so prompt lookup finds matches (and some drafts are accepted)
    prompts = [p + p[:6] + p + p[:6] for p in base]
    plain = LLMEngine(tiny_model, engine_config(block_size=4, num_blocks=256))
    spec = LLMEngine(
        tiny_model,
        engine_config(
            block_size=4,
            num_blocks=num_blocks,
            max_num_batched_tokens=48,
            speculative_method="ngram",
            num_spec_tokens=3,
        ),
        spec_clock=StillClock(),  # the adaptive draft length's choices the same everywhere
    )
    params = SamplingParams(max_tokens=24)
    expected = outputs_in_order(run_engine(plain, prompts, params), len(prompts))
    final = run_engine(spec, prompts, params, stagger=1)
    assert outputs_in_order(final, len(prompts)) == expected
    assert sum(o.num_draft_tokens for o in final.values()) > 0
    assert sum(o.num_accepted_tokens for o in final.values()) > 0
    assert all(len(o.token_ids) == 24 and o.error is None for o in final.values())
    if num_blocks < 256:
        assert sum(o.num_preemptions for o in final.values()) > 0


def test_stop_token_truncates_accepted_drafts(tiny_model):
    prompt = shared_prefix_prompts(1, tiny_model.config.vocab_size, seed=6)[0]
    prompt = prompt + prompt
    plain = reference(tiny_model, [prompt], 16)[0]
    stop_at = plain[5]
    first = plain.index(stop_at)
    for method in (None, "ngram"):
        engine = LLMEngine(
            tiny_model,
            engine_config(
                block_size=4, num_blocks=64, speculative_method=method,
                num_spec_tokens=4 if method else 0,
            ),
        )
        final = run_engine(
            engine, [prompt], SamplingParams(max_tokens=16, stop_token_ids=(stop_at,))
        )
        assert final["r0"].token_ids == plain[: first + 1]
        assert final["r0"].finish_reason == "stop"


def test_acceptance_stats_and_speculative_args():
    from speckv.engine.outputs import RequestOutput, acceptance_stats
    from speckv.engine.speculative import speculative_args

    def output(drafts, accepted):
        return RequestOutput("r", [1], [2], "", [2], "", 0, None, "length",
                             num_draft_tokens=drafts, num_accepted_tokens=accepted)

    assert acceptance_stats([output(0, 0)], 3) is None
    # 12 drafts at 3 per step = 4 steps, 6 accepted: 1.5 extra tokens per step
    assert acceptance_stats([output(6, 2), output(6, 4)], 3) == (0.5, 2.5)
    assert speculative_args(None, 3) == {"speculative_method": None, "num_spec_tokens": 0}
