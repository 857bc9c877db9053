"""OutputProcessor: from the core's token outputs to what callers see, one request at a time.

Owns everything about a request that is text or presentation: detokenization, stop strings,
streaming deltas (token ids and text since the last output, an incomplete UTF-8 sequence held
back), time to first token, and the running totals reported in `RequestOutput`. It never
touches the scheduler: before the core applies a step, `find_stop_strings` looks at the new
tokens of the requests that have stop strings and hands the core how many to keep (data, an
input of `Scheduler.update_from_output`, which ends the request there).

Text is decoded incrementally (a step decodes only the tokens since the last complete
character, in the context of the chunk before them, as vLLM's incremental detokenizer does),
so a step costs O(new tokens), not O(output). The text is the same as decoding the whole
output: the first window starts at the output's first token, later windows begin a chunk
earlier, and a decoder whose output for a window does not extend its previous chunk's (one
that rewrites text across the boundary) sends that request back to whole-output decoding.
Requests with stop strings decode the whole output as before (a stop string may span chunks),
and their stream holds back any end of the text that begins a stop string, so no delta ever
sends characters the stop string later cuts.
A request that asked for its final output only (`RequestOutputKind.FINAL_ONLY`) gets no
output before it finishes, so its text is decoded once, whole, when it does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.engine.messages import EngineCoreOutput, FinishReason
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import RequestOutputKind, SamplingParams
from speckv.models.common.tokenizer import Tokenizer


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
    # stop-string requests: (output tokens, their text) decoded by `find_stop_strings`
    decoded: tuple[int, str | None] | None = None
    final_only: bool = False  # RequestOutputKind.FINAL_ONLY: one output, when it finishes


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize and tokenizer is not None
        self._states: dict[str, _OutputState] = {}
        self._with_stops: dict[str, _OutputState] = {}  # unfinished requests with stop strings
        self._one_token_text: dict[tuple[int, bool], str] = {}  # see `_decode_one`

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float) -> None:
        final_only = params.output_kind is RequestOutputKind.FINAL_ONLY
        # a final-only request's text is decoded once, whole (nothing to do incrementally)
        state = _OutputState(request_id, prompt_token_ids, params, arrival_time,
                             incremental=not params.stop and not final_only,
                             final_only=final_only)
        self._states[request_id] = state
        if params.stop and self.tokenizer is not None:
            self._with_stops[request_id] = state

    def has_request(self, request_id: str) -> bool:
        return request_id in self._states

    def find_stop_strings(self, sampled_token_ids: Mapping[str, list[int]]) -> dict[str, int]:
        """Before the core applies a step: per request whose new tokens complete one of its
        stop strings, how many of them to keep (through the token that completes it). Only
        requests with stop strings are looked at; the text decoded here is kept for
        `process`."""
        cuts: dict[str, int] = {}
        for request_id, state in self._with_stops.items():
            tokens = sampled_token_ids.get(request_id)
            if not tokens:
                continue
            cut, text = self._find_stop_string(state, tokens)
            num_kept = len(tokens) if cut is None else cut
            state.decoded = (len(state.output_token_ids) + num_kept, text)
            if cut is not None:
                cuts[request_id] = cut
        return cuts

    def process(self, core_outputs: Sequence[EngineCoreOutput]) -> list[RequestOutput]:
        """One RequestOutput per core output of a request this processor knows (the core
        already cut the tokens at a stop string and finished the request)."""
        now = time.perf_counter()
        outputs: list[RequestOutput] = []
        states = self._states
        detokenize = self.detokenize
        for core_output in core_outputs:
            state = states.get(core_output.request_id)
            if state is None:
                continue
            tokens = core_output.new_token_ids
            output_token_ids = state.output_token_ids
            if tokens:
                if state.first_token_s is None:
                    state.first_token_s = now
                output_token_ids.extend(tokens)
            state.num_cached_tokens = core_output.num_cached_tokens
            state.num_external_cached_tokens = core_output.num_external_cached_tokens
            state.num_preemptions = core_output.num_preemptions
            num_drafts = core_output.num_draft_tokens
            if num_drafts:
                num_accepted = core_output.num_accepted_tokens
                state.num_draft_tokens += num_drafts
                state.num_accepted_tokens += num_accepted
                _count_positions(state.drafts_by_position, num_drafts)
                if num_accepted:
                    _count_positions(state.accepted_by_position, num_accepted)
            state.finish_reason = core_output.finish_reason
            state.error = core_output.error
            if core_output.kv_transfer_params is not None:
                state.kv_transfer_params = core_output.kv_transfer_params
            if state.final_only and state.finish_reason is None:
                state.decoded = None  # (stop strings: the text `find_stop_strings` decoded)
                continue  # no output before it finishes: its text is decoded then, whole
            if detokenize and (tokens or (state.final_only and output_token_ids)):
                text = None
                decoded = state.decoded
                if decoded is not None:
                    state.decoded = None
                    if decoded[0] == len(output_token_ids):
                        text = decoded[1]
                self._update_text(state, text)
            outputs.append(self._output(state))
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """The final output of an aborted request (None: unknown or already finished)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        state.finish_reason = FinishReason.ABORT
        if self.detokenize and state.final_only and state.output_token_ids:
            self._update_text(state, None)  # not decoded before its one output
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
            prefix = tokens[state.prefix_offset:]
            # one token a step (no drafts accepted): the next window's prefix is one token,
            # whose text depends on nothing else (decoding is a pure function of the ids)
            state.prefix_text = (self._decode_one(state, prefix[0]) if len(prefix) == 1
                                 else self._decode(state, prefix))

    def _decode_one(self, state: _OutputState, token_id: int) -> str:
        """The text of the single token `token_id`, decoded once per (token, flag) and kept
        (at most twice the vocabulary)."""
        key = (token_id, state.params.skip_special_tokens)
        text = self._one_token_text.get(key)
        if text is None:
            text = self._one_token_text[key] = self._decode(state, (token_id,))
        return text

    def _output(self, state: _OutputState) -> RequestOutput:
        finished = state.finish_reason is not None
        text = state.text
        # hold back an incomplete UTF-8 sequence until the next token completes it
        visible = len(text) if finished or not text.endswith("\ufffd") else len(text) - 1
        if not finished and state.params.stop:
            visible -= _stop_prefix_length(text[:visible], state.params.stop)
        visible = max(visible, state.num_sent_chars)
        delta_text = text[state.num_sent_chars : visible]
        delta_ids = state.output_token_ids[state.num_sent_tokens :]
        state.num_sent_chars = visible
        state.num_sent_tokens = len(state.output_token_ids)
        if finished:
            del self._states[state.request_id]
            self._with_stops.pop(state.request_id, None)
        drafts_by_position = state.drafts_by_position
        accepted_by_position = state.accepted_by_position
        first_token_s = state.first_token_s
        return RequestOutput(
            state.request_id, state.prompt_token_ids, list(state.output_token_ids), text,
            delta_ids, delta_text, state.num_cached_tokens,
            first_token_s - state.arrival_time if first_token_s is not None else None,
            state.finish_reason.value if finished else None, state.num_preemptions,
            state.num_draft_tokens, state.num_accepted_tokens, state.error,
            state.num_external_cached_tokens,
            tuple(drafts_by_position) if drafts_by_position else (),
            tuple(accepted_by_position) + (0,) * (
                len(drafts_by_position) - len(accepted_by_position)) if drafts_by_position
            else (),
            state.kv_transfer_params if finished else None,
        )


def _stop_prefix_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of `text` that begins a stop string: those characters
    are held back from the stream until the next tokens show whether the stop string
    completes (then they are cut with it) or not (then they are sent)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _count_positions(counts: list[int], num_positions: int) -> None:
    """Add one to positions 1..num_positions (index j - 1), growing the list. Mutates."""
    if len(counts) < num_positions:
        counts.extend([0] * (num_positions - len(counts)))
    for j in range(num_positions):
        counts[j] += 1
