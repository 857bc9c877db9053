"""OutputProcessor: from the core's token outputs to what callers see, one request at a time.

Owns everything about a request that is text or presentation: detokenization, stop strings,
streaming deltas (token ids and text since the last output, an incomplete UTF-8 sequence held
back), time to first token, and the running totals reported in `RequestOutput`. It never
touches the scheduler: a stop string it finds is returned to `LLMEngine`, which ends the
request in the core.

Text is decoded incrementally (a step decodes only the tokens since the last complete
character, in the context of the chunk before them, as vLLM's incremental detokenizer does),
so a step costs O(new tokens), not O(output). The text is the same as decoding the whole
output: the first window starts at the output's first token, later windows begin a chunk
earlier, and a decoder whose output for a window does not extend its previous chunk's (one
that rewrites text across the boundary) sends that request back to whole-output decoding.
Requests with stop strings decode the whole output as before (a stop string may span chunks).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.engine.messages import EngineCoreOutput, FinishReason
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams
from speckv.models.tokenizer import Tokenizer


@dataclass
class _OutputState:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    first_token_s: float | None = None
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    num_preemptions: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafts_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # incremental decoding: text of output_token_ids[:read_offset] is final (`committed`);
    # `prefix_text` = decode(output_token_ids[prefix_offset:read_offset]) on its own
    incremental: bool = True
    prefix_offset: int = 0
    read_offset: int = 0
    committed: str = ""
    prefix_text: str = ""


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize and tokenizer is not None
        self._states: dict[str, _OutputState] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        self._states[request_id] = _OutputState(request_id, prompt_token_ids, params,
                                                arrival_time, incremental=not params.stop)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def process(self, core_outputs: Sequence[EngineCoreOutput]
                ) -> tuple[list[RequestOutput], list[str]]:
        """(one RequestOutput per core output, ids of the requests a stop string ended that the
        core still runs: the caller must finish them there)."""
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        to_stop: list[str] = []
        for core_output in core_outputs:
            state = self._states.get(core_output.request_id)
            if state is None:
                continue
            tokens = core_output.new_token_ids
            reason = core_output.finish_reason
            text = None
            if state.params.stop and self.tokenizer is not None and tokens:
                cut, text = self._find_stop_string(state, tokens)
                if cut is not None:
                    tokens = tokens[:cut]
                    if reason is None:
                        to_stop.append(state.request_id)
                    reason = FinishReason.STOP
            if tokens and state.first_token_s is None:
                state.first_token_s = now
            state.output_token_ids.extend(tokens)
            state.num_cached_tokens = core_output.num_cached_tokens
            state.num_external_cached_tokens = core_output.num_external_cached_tokens
            state.num_preemptions = core_output.num_preemptions
            num_accepted = min(core_output.num_accepted_tokens, max(0, len(tokens) - 1))
            state.num_draft_tokens += core_output.num_draft_tokens
            state.num_accepted_tokens += num_accepted
            if core_output.num_draft_tokens:
                _count_positions(state.drafts_by_position, core_output.num_draft_tokens)
            if num_accepted:
                _count_positions(state.accepted_by_position, num_accepted)
            state.finish_reason = reason
            state.error = core_output.error
            if core_output.kv_transfer_params is not None:
                state.kv_transfer_params = core_output.kv_transfer_params
            if self.detokenize and tokens:
                self._update_text(state, text)
            outputs.append(self._output(state))
        return outputs, to_stop

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (None: unknown or already finished)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        state.finish_reason = FinishReason.ABORT
        return self._output(state)

    # ---- text --------------------------------------------------------------------------------
    def _find_stop_string(self, state: _OutputState, tokens: list[int]
                          ) -> tuple[int | None, str | None]:
        """(tokens to keep when a stop string appears in them, else None; the output text
        decoded through the last token checked)."""
        text = None
        for index in range(len(tokens)):
            text = self._decode(state, state.output_token_ids + tokens[: index + 1])
            if any(stop in text for stop in state.params.stop):
                return index + 1, text
        return None, text

    def _decode(self, state: _OutputState, token_ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=state.params.skip_special_tokens
        )

    def _update_text(self, state: _OutputState, text: str | None) -> None:
        """`text`: the output already decoded through its last token, else decoded here."""
        if text is None and state.incremental:
            self._update_text_incremental(state)
            return
        if text is None:
            text = self._decode(state, state.output_token_ids)
        for stop in state.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        state.text = text

    def _update_text_incremental(self, state: _OutputState) -> None:
        """state.text = the whole output decoded, from the tokens since the last chunk."""
        tokens = state.output_token_ids
        window = self._decode(state, tokens[state.prefix_offset:])
        prefix_text = state.prefix_text
        if not window.startswith(prefix_text):
            state.incremental = False  # this decoder rewrites across chunks: decode it all
            state.text = self._decode(state, tokens)
            return
        state.text = state.committed + window[len(prefix_text):]
        if len(window) > len(prefix_text) and not window.endswith("\ufffd"):
            # a complete character ends the window: its text is final
            state.committed = state.text
            state.prefix_offset, state.read_offset = state.read_offset, len(tokens)
            state.prefix_text = self._decode(state, tokens[state.prefix_offset:])

    def _output(self, state: _OutputState) -> RequestOutput:
        finished = state.finish_reason is not None
        text = state.text
        # hold back an incomplete UTF-8 sequence until the next token completes it
        visible = len(text) if finished or not text.endswith("\ufffd") else len(text) - 1
        visible = max(visible, state.num_sent_chars)
        delta_text = text[state.num_sent_chars : visible]
        delta_ids = state.output_token_ids[state.num_sent_tokens :]
        state.num_sent_chars = visible
        state.num_sent_tokens = len(state.output_token_ids)
        if finished:
            del self._states[state.request_id]
        return RequestOutput(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=list(state.output_token_ids),
            text=text,
            delta_token_ids=delta_ids,
            delta_text=delta_text,
            num_cached_tokens=state.num_cached_tokens,
            ttft_s=(state.first_token_s - state.arrival_time
                    if state.first_token_s is not None else None),
            finish_reason=state.finish_reason.value if finished else None,
            num_preemptions=state.num_preemptions,
            num_draft_tokens=state.num_draft_tokens,
            num_accepted_tokens=state.num_accepted_tokens,
            error=state.error,
            num_drafts_by_position=tuple(state.drafts_by_position),
            num_accepted_by_position=tuple(state.accepted_by_position) + (0,) * (
                len(state.drafts_by_position) - len(state.accepted_by_position)),
            num_external_cached_tokens=state.num_external_cached_tokens,
            kv_transfer_params=state.kv_transfer_params if finished else None,
        )


def _count_positions(counts: list[int], num_positions: int) -> None:
    """Add one to positions 1..num_positions (index j - 1), growing the list. Mutates."""
    if len(counts) < num_positions:
        counts.extend([0] * (num_positions - len(counts)))
    for j in range(num_positions):
        counts[j] += 1
