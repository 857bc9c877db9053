"""`POST /tokenize` and `POST /detokenize` as `vllm serve` answers them, so vLLM's clients
(`vllm bench serve` aligns its prompts with them) work against `speckv serve` unchanged.

    /tokenize    {"prompt": str, "add_special_tokens": true}  or
                 {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {"tokens": [int]} -> {"prompt": str}

Chat messages go through the same template and checks as `/v1/chat/completions`
(`speckv.api.protocol.chat_text`), so `/tokenize` says exactly what a chat request's prompt is.
Errors are the OpenAI shape, naming the field.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from speckv.api.errors import bad_request, model_not_found
from speckv.api.protocol import (
    ChatTokenizer,
    ModelLimits,
    _ChatMessage,
    _validate,
    chat_text,
    check_token_ids,
)


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[_ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[Any]


def _check(model: str | None, limits: ModelLimits, tokenizer: ChatTokenizer | None) -> None:
    if model is not None and model != limits.served_model_name:
        raise model_not_found(model, limits.served_model_name)
    if tokenizer is None:
        raise bad_request("This model has no tokenizer.", None, "invalid_value")


def tokenize(body: dict[str, Any], limits: ModelLimits,
             tokenizer: ChatTokenizer | None) -> dict[str, Any]:
    parsed: _TokenizeBody = _validate(_TokenizeBody, body)
    _check(parsed.model, limits, tokenizer)
    assert tokenizer is not None
    if (parsed.prompt is None) == (parsed.messages is None):
        raise bad_request("Send either 'prompt' or 'messages'.", "prompt",
                          "missing_required_parameter")
    if parsed.messages is not None:
        if not tokenizer.chat_template:
            raise bad_request("This model has no chat template: send 'prompt'.", "messages",
                              "invalid_value")
        text = chat_text(parsed.messages, parsed.add_generation_prompt, tokenizer)
        special = bool(parsed.add_special_tokens)
    else:
        text = parsed.prompt or ""
        special = parsed.add_special_tokens is not False
    tokens = tokenizer.encode(text, add_special_tokens=special)
    strs = [tokenizer.token_text(t) or "" for t in tokens] if parsed.return_token_strs else None
    return {"count": len(tokens), "max_model_len": limits.max_model_len, "tokens": tokens,
            "token_strs": strs}


def detokenize(body: dict[str, Any], limits: ModelLimits,
               tokenizer: ChatTokenizer | None) -> dict[str, Any]:
    parsed: _DetokenizeBody = _validate(_DetokenizeBody, body)
    _check(parsed.model, limits, tokenizer)
    assert tokenizer is not None
    return {"prompt": tokenizer.decode(check_token_ids(parsed.tokens, limits, "tokens"))}
