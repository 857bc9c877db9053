"""The OpenAI wire format: request bodies in, response bodies and stream chunks out.

Owns validating a `/v1/completions` or `/v1/chat/completions` body against the served model
and turning it into a `GenerationRequest` (prompt token ids + `SamplingParams` + streaming
options), or an `APIError` that names the field (`param`) in the user's words. Also builds the
response objects, the SSE chunks and `usage` (with `prompt_tokens_details.cached_tokens`, the
prefix-cache hit) exactly as the official `openai` client parses them.

Defaults follow `vllm serve`: `max_tokens` omitted = the rest of the context; temperature 1.0.
One prompt per request and `n == 1` (a request for more says so).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, ValidationError

from speckv.api.errors import APIError, bad_request, model_not_found, not_supported
from speckv.api.json_body import parse_json_object as parse_json_object  # re-exported
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams

MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range
# every stop string is checked against every new token's text: bounded, so one request cannot
# slow the engine for everyone (OpenAI allows 4 strings; vLLM clients send a handful)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024  # per stop string
MAX_STOP_TOKEN_IDS = 1024


class ChatTokenizer(Protocol):
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_text(self, token_id: int) -> str | None: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True) -> str: ...


@dataclass(frozen=True)
class ModelLimits:
    """What validation needs to know about the served model."""

    served_model_name: str
    max_model_len: int  # tokens per sequence (prompt + output)
    vocab_size: int


@dataclass(frozen=True)
class GenerationRequest:
    kind: Literal["completion", "chat"]
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with `usage`


# ---- request bodies (strict JSON types; unknown fields are ignored, as OpenAI's are) ----------
class _StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _SamplingBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: Any = None  # str | list[str], checked by hand for a clear message
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int | None = 1
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    best_of: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    # prefill/decode disaggregation: {"do_remote_decode": true} to a prefill engine, the
    # prefill engine's returned params to a decode engine: passed on untouched, only the
    # engine's KV connector reads them (its refusal is a 400 naming the field)
    kv_transfer_params: dict[str, Any] | None = None


class _CompletionBody(_SamplingBody):
    prompt: Any = None  # str | list[int] | [str] | [list[int]], checked by hand
    echo: bool | None = False
    suffix: str | None = None
    logprobs: int | None = None


class _ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: str
    content: Any = None


class _ChatBody(_SamplingBody):
    messages: list[_ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        first = error.errors()[0]
        loc = [str(part) for part in first["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) if loc else "body"
        raise bad_request(f"Invalid value for '{where}': {first['msg']}.", param,
                          "invalid_value") from None


def _check_model(name: str | None, limits: ModelLimits) -> None:
    if name is not None and name != limits.served_model_name:
        raise model_not_found(name, limits.served_model_name)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("'stop' must be a non-empty string or a list of them.", "stop",
                          "invalid_value")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"'stop' holds {len(items)} strings; at most {MAX_STOP_STRINGS} are "
                          "allowed.", "stop", "invalid_value")
    longest = max(len(s) for s in items) if items else 0
    if longest > MAX_STOP_CHARS:
        raise bad_request(f"'stop' holds a string of {longest} characters; at most "
                          f"{MAX_STOP_CHARS} are allowed.", "stop", "invalid_value")
    return tuple(items)


def check_token_ids(token_ids: Sequence[Any], limits: ModelLimits, param: str) -> list[int]:
    for index, token in enumerate(token_ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise bad_request(f"'{param}[{index}]' = {token!r} is not an integer token id.",
                              param, "invalid_value")
        if not 0 <= token < limits.vocab_size:
            raise bad_request(f"'{param}[{index}]' = {token} is outside the vocabulary "
                              f"[0, {limits.vocab_size}).", param, "invalid_value")
    return list(token_ids)


def _sampling_params(body: _SamplingBody, max_tokens: int | None, num_prompt_tokens: int,
                     limits: ModelLimits, prompt_param: str,
                     max_tokens_param: str = "max_tokens") -> SamplingParams:
    if body.n is not None and body.n != 1:
        raise not_supported("n", f"one choice per request (got n={body.n}); send {body.n} "
                                 "requests instead, they share the prompt's cached prefix.")
    if body.best_of is not None and body.best_of > 1:
        raise not_supported("best_of", "one candidate per request.")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise not_supported(name, "no penalties (leave it 0).")
    if body.logit_bias:
        raise not_supported("logit_bias", "no logit bias.")
    room = limits.max_model_len - num_prompt_tokens
    if num_prompt_tokens > limits.max_model_len or room < 1:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens, but the "
            f"prompt has {num_prompt_tokens} tokens (no room for an output token).",
            prompt_param, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    elif max_tokens < 1:
        raise bad_request(f"'{max_tokens_param}' must be at least 1, got {max_tokens}.",
                          max_tokens_param, "invalid_value")
    elif max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"you requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in "
            f"the prompt, {max_tokens} for the completion).", max_tokens_param,
            "context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    if not (math.isfinite(temperature) and 0.0 <= temperature <= MAX_TEMPERATURE):
        raise bad_request(f"'temperature' must be between 0 and {MAX_TEMPERATURE:g}, got "
                          f"{temperature!r}.", "temperature", "invalid_value")
    top_p = 1.0 if body.top_p is None else body.top_p
    if not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise bad_request(f"'top_p' must be in (0, 1], got {top_p!r}.", "top_p",
                          "invalid_value")
    top_k = 0 if body.top_k is None or body.top_k == -1 else body.top_k
    if top_k < 0:
        raise bad_request(f"'top_k' must be -1 or 0 (off) or a positive int, got "
                          f"{body.top_k}.", "top_k", "invalid_value")
    if body.seed is not None and not 0 <= body.seed <= MAX_SEED:
        raise bad_request(f"'seed' must be in [0, 2**63), got {body.seed}.", "seed",
                          "invalid_value")
    if body.stop_token_ids is not None and len(body.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' holds {len(body.stop_token_ids)} ids; at most "
                          f"{MAX_STOP_TOKEN_IDS} are allowed.", "stop_token_ids",
                          "invalid_value")
    stop_token_ids = check_token_ids(body.stop_token_ids or [], limits, "stop_token_ids")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                          top_p=float(top_p), seed=body.seed, stop=_stop_strings(body.stop),
                          stop_token_ids=tuple(stop_token_ids), ignore_eos=body.ignore_eos,
                          skip_special_tokens=body.skip_special_tokens,
                          kv_transfer_params=body.kv_transfer_params)


def _stream_flags(body: _SamplingBody) -> tuple[bool, bool]:
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true.",
                          "stream_options", "invalid_value")
    return stream, bool(body.stream_options and body.stream_options.include_usage)


def _prompt_token_ids(prompt: Any, tokenizer: ChatTokenizer | None,
                      limits: ModelLimits) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' is empty.", "prompt", "invalid_value")
        if tokenizer is None:
            raise bad_request("This model has no tokenizer: send 'prompt' as token ids.",
                              "prompt", "invalid_value")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list):
        if not prompt:
            raise bad_request("'prompt' is empty.", "prompt", "invalid_value")
        if all(isinstance(p, str | list) for p in prompt):
            raise not_supported("prompt", f"one prompt per request (got {len(prompt)}); send "
                                          "one request per prompt.")
        if len(prompt) > limits.max_model_len:  # said before checking every id
            raise bad_request(f"This model's maximum context length is {limits.max_model_len} "
                              f"tokens, but the prompt has {len(prompt)} tokens (no room for "
                              "an output token).", "prompt", "context_length_exceeded")
        return check_token_ids(prompt, limits, "prompt")
    if prompt is None:
        raise bad_request("'prompt' is required.", "prompt", "missing_required_parameter")
    raise bad_request("'prompt' must be a string or a list of token ids.", "prompt",
                      "invalid_value")


def parse_completion(body: dict[str, Any], limits: ModelLimits,
                     tokenizer: ChatTokenizer | None) -> GenerationRequest:
    parsed: _CompletionBody = _validate(_CompletionBody, body)
    _check_model(parsed.model, limits)
    if parsed.echo:
        raise not_supported("echo", "the prompt is not echoed.")
    if parsed.suffix:
        raise not_supported("suffix", "no insertion mode.")
    if parsed.logprobs is not None:
        raise not_supported("logprobs", "no log probabilities.")
    token_ids = _prompt_token_ids(parsed.prompt, tokenizer, limits)
    params = _sampling_params(parsed, parsed.max_tokens, len(token_ids), limits, "prompt")
    stream, include_usage = _stream_flags(parsed)
    return GenerationRequest("completion", token_ids, params, stream, include_usage)


# the roles of OpenAI's chat API (vLLM accepts the same); anything else is a 400
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message_text(message: _ChatMessage, index: int) -> str:
    """The message's text; an unknown role or an empty text is a 400 (the one empty-prompt
    rule: no empty completion prompt, no empty message, no `speckv generate ""`)."""
    if message.role not in CHAT_ROLES:
        raise bad_request(f"Invalid value for 'messages[{index}].role': {message.role!r} is not "
                          f"one of {', '.join(map(repr, CHAT_ROLES))}.", f"messages[{index}].role",
                          "invalid_value")
    text = _content_text(message.content, index)
    if not text:
        raise bad_request(f"'messages[{index}].content' is empty.", f"messages[{index}].content",
                          "invalid_value")
    return text


def _content_text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise not_supported(f"messages[{index}].content",
                                    "text parts only ({'type': 'text', 'text': ...}).")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"'messages[{index}].content' must be a string or a list of text parts.",
                      "messages", "invalid_value")


def chat_text(messages: Sequence[_ChatMessage], add_generation_prompt: bool,
              tokenizer: ChatTokenizer) -> str:
    """The prompt text the chat template makes of `messages` (each checked), or a 400."""
    plain = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # the template's own raise_exception (e.g. role order)
        raise bad_request(f"The chat template rejected the messages: {error}", "messages",
                          "invalid_value") from None


def parse_chat(body: dict[str, Any], limits: ModelLimits,
               tokenizer: ChatTokenizer | None) -> GenerationRequest:
    parsed: _ChatBody = _validate(_ChatBody, body)
    _check_model(parsed.model, limits)
    if parsed.logprobs or parsed.top_logprobs:
        raise not_supported("logprobs", "no log probabilities.")
    if parsed.tools:
        raise not_supported("tools", "no tool calling.")
    if parsed.response_format and parsed.response_format.get("type") not in (None, "text"):
        raise not_supported("response_format", "plain text only.")
    if not parsed.messages:
        raise bad_request("'messages' is empty.", "messages", "invalid_value")
    if tokenizer is None or not tokenizer.chat_template:
        raise bad_request("This model has no chat template: use /v1/completions.", "messages",
                          "invalid_value")
    if len(parsed.messages) > limits.max_model_len:  # each message takes a token at least
        raise bad_request(f"This model's maximum context length is {limits.max_model_len} "
                          f"tokens, but 'messages' holds {len(parsed.messages)} messages.",
                          "messages", "context_length_exceeded")
    token_ids = tokenizer.encode(chat_text(parsed.messages, parsed.add_generation_prompt,
                                           tokenizer))
    # max_completion_tokens is the newer name; it wins when both are given (as in OpenAI's API)
    max_tokens_param = ("max_completion_tokens" if parsed.max_completion_tokens is not None
                        else "max_tokens")
    params = _sampling_params(parsed, getattr(parsed, max_tokens_param), len(token_ids),
                              limits, "messages", max_tokens_param)
    stream, include_usage = _stream_flags(parsed)
    return GenerationRequest("chat", token_ids, params, stream, include_usage)


# ---- responses ----------------------------------------------------------------------------------
def usage(output: RequestOutput) -> dict[str, Any]:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = len(output.token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens}}


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every response object and chunk of one request shares."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, request_id: str, model: str) -> ResponseHeader:
        return cls(request_id, int(time.time()), model)


def _with_transfer_params(response: dict[str, Any], output: RequestOutput) -> dict[str, Any]:
    """vLLM's top-level `kv_transfer_params`, when the KV connector returned some."""
    if output.kv_transfer_params is not None:
        response["kv_transfer_params"] = output.kv_transfer_params
    return response


def completion_response(header: ResponseHeader, output: RequestOutput) -> dict[str, Any]:
    return _with_transfer_params({
        "id": header.id, "object": "text_completion", "created": header.created,
        "model": header.model,
        "choices": [{"index": 0, "text": output.text, "logprobs": None,
                     "finish_reason": output.finish_reason, "stop_reason": None}],
        "usage": usage(output)}, output)


def chat_response(header: ResponseHeader, output: RequestOutput) -> dict[str, Any]:
    return _with_transfer_params({
        "id": header.id, "object": "chat.completion", "created": header.created,
        "model": header.model,
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "content": output.text},
                     "logprobs": None, "finish_reason": output.finish_reason,
                     "stop_reason": None}],
        "usage": usage(output)}, output)


def sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


SSE_DONE = sse("[DONE]")


class ChunkWriter:
    """The SSE chunks of one streamed request, as OpenAI sends them: content deltas (the chat's
    first carries the assistant role), a last choice with `finish_reason`, then with
    `include_usage` a chunk with empty `choices` and the `usage` (every other chunk carries
    `"usage": null`), then `[DONE]`."""

    def __init__(self, kind: Literal["completion", "chat"], header: ResponseHeader,
                 include_usage: bool) -> None:
        self.kind = kind
        self.header = header
        self.include_usage = include_usage
        self._sent_role = False
        self._object = "text_completion" if kind == "completion" else "chat.completion.chunk"

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {"id": self.header.id, "object": self._object, "created": self.header.created,
                 "model": self.header.model, "choices": choices}
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def delta(self, output: RequestOutput) -> bytes:
        """The chunk for one engine output (empty bytes when it carries nothing to send)."""
        finish = output.finish_reason
        if self.kind == "completion":
            if not output.delta_text and finish is None:
                return b""
            choice = {"index": 0, "text": output.delta_text, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None}
            return sse(self._chunk([choice]))
        chunks = b""
        if not self._sent_role:
            self._sent_role = True
            chunks += sse(self._chunk([{"index": 0, "delta": {"role": "assistant",
                                                              "content": ""},
                                        "logprobs": None, "finish_reason": None}]))
        if output.delta_text or finish is not None:
            delta = {"content": output.delta_text} if output.delta_text else {}
            chunks += sse(self._chunk([{"index": 0, "delta": delta, "logprobs": None,
                                        "finish_reason": finish, "stop_reason": None}]))
        return chunks

    def end(self, output: RequestOutput) -> bytes:
        tail = b""
        if self.include_usage:
            tail += sse({"id": self.header.id, "object": self._object,
                         "created": self.header.created, "model": self.header.model,
                         "choices": [], "usage": usage(output)})
        return tail + SSE_DONE


def error_chunk(error: APIError) -> bytes:
    """An error after the stream started (status already sent): the `openai` client raises."""
    return sse(error.body())
