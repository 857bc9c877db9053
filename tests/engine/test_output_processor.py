"""The output processor's incremental text equals decoding the whole output at every step:
byte-level BPE split inside multi-byte characters, special tokens skipped, and a Metaspace
(SentencePiece-style) decoder that strips the leading space of what it decodes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from speckv.engine.messages import EngineCoreOutput, FinishReason
from speckv.engine.output_processor import OutputProcessor
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.tokenizer import Tokenizer
from tests.server.server_test_utils import TOKENIZER as BYTE_LEVEL


def _metaspace_tokenizer() -> Tokenizer:
    pieces = ["<unk>", "▁", "▁a", "▁bc", "d", "é", "▁ü", "x", "▁▁", "<eos>"]
    backend = HFTokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)},
                                           unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, eos_token_ids=(9,))


METASPACE = _metaspace_tokenizer()


def _run(tokenizer: Tokenizer, tokens: list[int], chunks: list[int]) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1, 2], SamplingParams(max_tokens=10_000), 0.0)
    sent = ""
    position = 0
    for index, size in enumerate(chunks):
        new = tokens[position : position + size]
        position += len(new)
        last = index == len(chunks) - 1 or position >= len(tokens)
        core = EngineCoreOutput(request_id="r", new_token_ids=new, num_cached_tokens=0,
                                finish_reason=FinishReason.LENGTH if last else None)
        (output,) = processor.process([core])
        whole = tokenizer.decode(tokens[:position], skip_special_tokens=True)
        assert output.text == whole
        sent += output.delta_text
        assert whole.startswith(sent)
        if last:
            assert sent == whole
            return


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_incremental_text_equals_whole_decode_byte_level(data):
    # byte tokens: UTF-8 lead / continuation bytes land in separate steps
    text = data.draw(st.text(alphabet="aé ü€😀\n", min_size=1, max_size=30))
    tokens = BYTE_LEVEL.encode(text, add_special_tokens=False)
    specials = data.draw(st.lists(st.integers(0, len(tokens)), max_size=3))
    for at in sorted(specials, reverse=True):
        tokens.insert(at, BYTE_LEVEL.eos_token_ids[0])  # skipped when decoded
    if data.draw(st.booleans()):
        tokens.append(BYTE_LEVEL.encode("€", add_special_tokens=False)[0])  # left incomplete
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=len(tokens), max_size=len(tokens)))
    _run(BYTE_LEVEL, tokens, chunks)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=25), st.data())
def test_incremental_text_equals_whole_decode_metaspace(tokens, data):
    chunks = data.draw(st.lists(st.integers(1, 3), min_size=len(tokens), max_size=len(tokens)))
    _run(METASPACE, tokens, chunks)
