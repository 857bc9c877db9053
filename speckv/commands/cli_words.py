"""Errors in the words of the command line: the flags a user typed, not internal names.

Owns two rewrites of an error message raised below a command: a config or field name
(`EngineArgs.num_spec_tokens`, or a bare `max_model_len` / `num_prompts`) becomes the
command's flag (`--num-spec-tokens`) when the command has that flag, and an internal request id
prefix ("request llm-7f64...-0-0: ") is dropped (a CLI user never named a request).
"""

from __future__ import annotations

import re
from collections.abc import Collection

_QUALIFIED = re.compile(r"\b[A-Z]\w*\.([a-z_]+)\b")  # EngineArgs.num_spec_tokens
_BARE = re.compile(r"(?<![\w.-])([a-z]+(?:_[a-z]+)+)\b")  # identifiers with an underscore
_REQUEST_ID = re.compile(r"\brequest [\w.:-]+?: ")
JSON_FLAGS = ("--kv-transfer-config", "--speculative-config")  # their values are JSON objects


def in_cli_words(message: str, flags: Collection[str]) -> str:
    """`message` with the names the command has flags for written as those flags; not in a
    message about a JSON-valued flag, whose names are the JSON's keys (`kv_role`)."""

    def flag(match: re.Match[str]) -> str:
        option = "--" + match.group(1).replace("_", "-")
        return option if option in flags else match.group(0)

    message = _REQUEST_ID.sub("", message)
    if any(json_flag in message for json_flag in JSON_FLAGS):
        return message
    message = _QUALIFIED.sub(flag, message)
    return _BARE.sub(flag, message)
