"""Aborting through `LLMEngine`: the final output says "abort", every block is free, the runner
forgets the request, and the other requests finish with the same tokens as without it."""

from __future__ import annotations

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

PROMPTS = [[(7 * j + k) % 90 + 1 for j in range(18)] for k in range(3)]


def _engine(model, speculative: bool) -> LLMEngine:
    if not speculative:
        return LLMEngine(model, engine_config(num_blocks=64, block_size=4))
    drafter = random_drafter("eagle", model, init_std=0.2, seed=3)
    config = engine_config(num_blocks=64, block_size=4, speculative_method="eagle",
                           num_spec_tokens=2)
    return LLMEngine(model, config, drafter=drafter)


def _finish(engine: LLMEngine) -> dict[str, list[int]]:
    tokens = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            engine.manager.check_integrity()
            if output.finished:
                tokens[output.request_id] = output.token_ids
    return tokens


def test_abort_mid_decode_frees_everything_and_spares_the_others(tiny_model):
    for speculative in (False, True):
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        reference = _engine(tiny_model, speculative)
        for index, prompt in enumerate(PROMPTS):
            reference.add_request(prompt, params, f"r{index}")
        expected = _finish(reference)

        engine = _engine(tiny_model, speculative)
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(prompt, params, f"r{index}")
        engine.step()
        engine.step()
        final = engine.abort_request("r1")
        assert final is not None and final.finish_reason == "abort"
        assert 0 < len(final.token_ids) < 12
        assert engine.abort_request("r1") is None  # already gone
        tokens = _finish(engine)
        assert "r1" not in tokens
        assert tokens == {k: v for k, v in expected.items() if k != "r1"}
        assert engine.manager.get_num_free_blocks() == engine.num_blocks - 1
        assert engine.step() == []  # the next step tells the runner who left
        assert engine.runner.requests == {}


def test_abort_of_a_waiting_request(tiny_model):
    engine = _engine(tiny_model, speculative=False)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=4), "waiting")
    final = engine.abort_request("waiting")
    assert final is not None and final.finish_reason == "abort" and final.token_ids == []
    assert not engine.has_unfinished_requests()
    assert engine.step() == []
    assert engine.manager.get_num_free_blocks() == engine.num_blocks - 1
