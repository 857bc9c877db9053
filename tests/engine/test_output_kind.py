"""A request that asks for its final output only (`RequestOutputKind.FINAL_ONLY`, what
`LLM.generate` asks for) gets one output, when it finishes, with the same tokens, text, finish
reason and counters as the last output of the same request streamed every step; its delta
fields hold the whole output. Stop strings and aborts too."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.messages import EngineCoreOutput, FinishReason
from speckv.engine.output_processor import OutputProcessor
from speckv.engine.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.engine_test_utils import StillClock
from tests.server.server_test_utils import TOKENIZER

FINAL = RequestOutputKind.FINAL_ONLY


def _engine(model, spec: bool) -> LLMEngine:
    kwargs = dict(speculative_method="ngram", num_spec_tokens=3) if spec else {}
    return LLMEngine(model, engine_config(block_size=4, num_blocks=256, **kwargs),
                     tokenizer=TOKENIZER, spec_clock=StillClock())


def _outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams):
    engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    return outputs


def _same_but_deltas(a, b) -> None:
    ignore = ("delta_token_ids", "delta_text", "ttft_s")
    for field in dataclasses.fields(a):
        if field.name not in ignore:
            assert getattr(a, field.name) == getattr(b, field.name), field.name


@pytest.mark.parametrize("spec", [False, True])
@pytest.mark.parametrize("stop", [(), ("ab",)])
def test_the_final_output_is_the_streamed_one(tiny_chat_model, spec, stop):
    prompt = TOKENIZER.encode("abcabcabcabc abcabc")
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=stop)
    streamed = _outputs(_engine(tiny_chat_model, spec), prompt, params)
    (final,) = _outputs(_engine(tiny_chat_model, spec), prompt,
                        dataclasses.replace(params, output_kind=FINAL))
    assert len(streamed) > 1 and streamed[-1].finished and final.finished
    _same_but_deltas(final, streamed[-1])
    assert final.text == TOKENIZER.decode(final.token_ids, skip_special_tokens=True)[
        : len(final.text)]
    assert final.delta_token_ids == final.token_ids and final.delta_text == final.text
    assert final.ttft_s is not None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_one_output_at_the_end_with_the_whole_text(data):
    # byte tokens: UTF-8 lead / continuation bytes land in separate steps
    text = data.draw(st.text(alphabet="aé ü€😀\n", min_size=1, max_size=30))
    tokens = TOKENIZER.encode(text, add_special_tokens=False)
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(tokens), max_size=len(tokens)))
    processor = OutputProcessor(TOKENIZER)
    processor.add_request("r", [1, 2], SamplingParams(max_tokens=10_000, output_kind=FINAL),
                          0.0)
    position = 0
    for size in chunks:
        new = tokens[position : position + size]
        position += len(new)
        last = position >= len(tokens)
        outputs = processor.process([EngineCoreOutput(
            request_id="r", new_token_ids=new, num_cached_tokens=0,
            finish_reason=FinishReason.LENGTH if last else None)])
        if not last:
            assert outputs == []
            continue
        (output,) = outputs
        assert output.token_ids == tokens and output.finished
        assert output.text == TOKENIZER.decode(tokens, skip_special_tokens=True) == text
        return


def test_an_aborted_final_only_request_gets_its_text():
    processor = OutputProcessor(TOKENIZER)
    processor.add_request("r", [1], SamplingParams(max_tokens=100, output_kind=FINAL), 0.0)
    tokens = TOKENIZER.encode("hello there", add_special_tokens=False)
    core = EngineCoreOutput(request_id="r", new_token_ids=tokens, finish_reason=None,
                            num_cached_tokens=0)
    assert processor.process([core]) == []
    output = processor.abort("r")
    assert output is not None and output.finish_reason == "abort"
    assert output.text == "hello there" and output.token_ids == tokens


def test_output_kind_must_be_a_kind():
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind="final_only")  # type: ignore[arg-type]
