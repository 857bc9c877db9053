"""Bad requests get a clear error; the other requests finish with the right output."""

from __future__ import annotations

import pytest

from speckv.engine.engine_args import engine_config
from speckv.engine.llm import LLM
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.generate import greedy_generate
from tests.engine.engine_test_utils import shared_prefix_prompts


def test_bad_requests_are_rejected_while_others_finish(tiny_model):
    vocab = tiny_model.config.vocab_size
    engine = LLMEngine(tiny_model, engine_config(block_size=4, num_blocks=64, max_model_len=64))
    good = shared_prefix_prompts(3, vocab, seed=9)
    params = SamplingParams(max_tokens=8)
    for index, prompt in enumerate(good):
        engine.add_request(prompt, params, f"good{index}")
    engine.step()  # the good ones are running when the bad ones arrive
    bad = [
        ([], "prompt is empty"),
        ([1, vocab], rf"prompt\[1\] = {vocab} is outside the vocabulary"),
        ([1, -3], "outside the vocabulary"),
        ([1] * 65, "more than max_model_len"),
        ("text", "needs a tokenizer"),
    ]
    for prompt, message in bad:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], params, "good0")
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.manager.check_integrity()
    for index, prompt in enumerate(good):
        assert final[f"good{index}"].token_ids == greedy_generate(tiny_model, prompt, 8)


def test_generate_returns_errors_in_place(tiny_model):
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_model_len=64)
    good = [5, 6, 7, 8, 9]
    outputs = llm.generate([good, [], [1, 10_000], good], SamplingParams(max_tokens=5))
    assert [o.finish_reason for o in outputs] == ["length", "error", "error", "length"]
    assert "empty" in outputs[1].error and "vocabulary" in outputs[2].error
    assert outputs[0].token_ids == outputs[3].token_ids == greedy_generate(tiny_model, good, 5)
    # the engine keeps serving after errors
    assert llm.generate([good], SamplingParams(max_tokens=5))[0].token_ids == outputs[0].token_ids


def test_max_model_len_stops_generation(tiny_model):
    llm = LLM(tiny_model, block_size=4, num_blocks=64, max_model_len=12)
    (out,) = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=50))
    assert out.finish_reason == "length" and len(out.token_ids) == 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_size": 0}, "block_size"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"hash_algo": "md5"}, "hash_algo"),
        ({"speculative_method": "medusa", "num_spec_tokens": 1}, "speculative_method"),
        ({"speculative_method": "ngram"}, "num_spec_tokens"),
        ({"speculative_method": "ngram", "num_spec_tokens": 1000}, "num_spec_tokens must be <="),
        ({"adaptive_speculation": "yes"}, "adaptive_speculation"),
    ],
)
def test_bad_engine_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine_config(**kwargs)


def test_streaming_deltas_add_up(tiny_model):
    llm = LLM(tiny_model, block_size=4, num_blocks=64)
    prompts = [[3, 4, 5, 6, 7], [9, 8, 7]]
    seen: dict[str, list[int]] = {}
    finals = {}
    for output in llm.stream(prompts, SamplingParams(max_tokens=6)):
        seen.setdefault(output.request_id, []).extend(output.delta_token_ids)
        if output.finished:
            finals[output.request_id] = output
    assert len(finals) == 2
    for request_id, output in finals.items():
        assert seen[request_id] == output.token_ids
        assert output.ttft_s is not None and output.ttft_s >= 0


def test_a_drafter_method_needs_a_drafter(tiny_model):
    from speckv.engine import LLMEngine

    config = engine_config(num_blocks=32, speculative_method="eagle", num_spec_tokens=2)
    with pytest.raises(ValueError, match="needs a drafter: set speculative_model"):
        LLMEngine(tiny_model, config)
    with pytest.raises(ValueError, match="speculative_model needs speculative_method"):
        engine_config(speculative_model="builtin")


def test_draft_model_is_a_deprecated_alias_of_speculative_model():
    with pytest.warns(DeprecationWarning, match="use speculative_model"):
        config = engine_config(speculative_method="eagle", num_spec_tokens=2,
                               draft_model="builtin")
    assert config.speculative is not None and config.speculative.model == "builtin"


def test_fast_hash_hits_are_verified_by_content(tiny_model):
    from speckv.cache.hit_check import CompareContent

    engine = LLMEngine(tiny_model, engine_config(num_blocks=32, block_size=4,
                                                 hash_algo="xxhash"))
    assert isinstance(engine.manager.pool.hit_check, CompareContent)
    prompt = [(5 * j) % 90 + 1 for j in range(13)]
    first = LLM(tiny_model, num_blocks=32, block_size=4, hash_algo="xxhash")
    outputs = first.generate([prompt, prompt], SamplingParams(max_tokens=2))
    assert outputs[1].num_cached_tokens == 12
