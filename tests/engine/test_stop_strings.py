"""Stop strings end a request in the core as data of the step: the output processor finds them
in the runner's sampled tokens before the update, the scheduler cuts and finishes the request
(no call back down). The text, the tokens kept, the finish reason and the freed blocks are as
if the request had stopped at the token that completes the stop string, with speculation
handing several tokens per step."""

from __future__ import annotations

import pytest

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.messages import FinishReason
from speckv.engine.sampling_params import SamplingParams
from speckv.simulation.toy_runner import toy_core
from tests.engine.engine_test_utils import StillClock
from tests.server.server_test_utils import TOKENIZER


def _engine(model, spec: bool) -> LLMEngine:
    kwargs = dict(speculative_method="ngram", num_spec_tokens=3) if spec else {}
    return LLMEngine(model, engine_config(block_size=4, num_blocks=256, **kwargs),
                     tokenizer=TOKENIZER, spec_clock=StillClock())


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    request_id = engine.add_request(prompt, params)
    deltas, final = "", None
    while engine.has_unfinished_requests():
        for output in engine.step():
            deltas += output.delta_text
            if output.finished:
                final = output
        engine.manager.check_integrity()
    assert final is not None and final.request_id == request_id
    # the stream never sends text a stop string later cuts: its deltas add up to the text
    assert deltas == final.text
    return final


@pytest.mark.parametrize("spec", [False, True])
def test_a_stop_string_cuts_at_the_token_that_completes_it(tiny_chat_model, spec):
    prompt = TOKENIZER.encode("abcabcabcabc abcabc")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    full = _run(_engine(tiny_chat_model, spec), prompt, params)
    text = full.text
    checked = 0
    for start in range(2, len(text) - 3, 3):
        stop = text[start : start + 2]
        if not stop.strip() or "\ufffd" in stop:
            continue
        engine = _engine(tiny_chat_model, spec)
        out = _run(engine, prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=(stop,)))
        # the shortest output prefix whose text holds the stop string
        kept = next(n for n in range(1, len(full.token_ids) + 1)
                    if stop in TOKENIZER.decode(full.token_ids[:n], skip_special_tokens=True))
        assert out.finish_reason == "stop"
        assert out.token_ids == full.token_ids[:kept]
        assert out.text == text[: text.find(stop)]
        assert engine.manager.get_num_free_blocks() == engine.num_blocks - 1  # all freed
        assert out.num_accepted_tokens <= max(0, len(out.token_ids) - 1)
        checked += 1
    assert checked >= 3
    if spec:
        assert full.num_accepted_tokens > 0, "no multi-token steps: the test shows nothing"


def test_update_from_output_takes_a_stop_string_cut_as_input():
    from speckv.cache import KVCacheManager
    from speckv.cache.hash_mode import HashMode
    from speckv.cache.specs import FullAttentionSpec
    from speckv.engine.request import Request

    manager = KVCacheManager([FullAttentionSpec(4)], 32, HashMode.for_lookahead(0))
    core = toy_core(manager, 0)
    hashing = manager.block_hashing("sha256", "0")
    core.scheduler.add_request(Request("a", [1, 2, 3], hashing, max_tokens=8))
    core.scheduler.add_request(Request("b", [4, 5, 6], hashing, max_tokens=8))
    scheduler_output = core.scheduler.schedule()
    runner_output = core.runner.execute_model(scheduler_output)
    outputs = core.scheduler.update_from_output(scheduler_output, runner_output, {"a": 1})
    by_id = {o.request_id: o for o in outputs}
    assert by_id["a"].finish_reason is FinishReason.STOP and len(by_id["a"].new_token_ids) == 1
    assert by_id["b"].finish_reason is None and len(by_id["b"].new_token_ids) == 1
    assert core.scheduler.get_request("a") is None
    manager.check_integrity()
