"""A request body's JSON, checked before anything reads a field: decoded only when it nests no
deeper than `MAX_JSON_DEPTH` (the decoder recurses), an object, and valid Unicode throughout (a
lone UTF-16 surrogate, which JSON's `\\ud800` escapes allow, reaches no tokenizer). Each
failure is a 400 in the OpenAI error shape that says what is wrong and, for text, where."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from speckv.api.errors import bad_request

# deeper bodies are refused before decoding (the decoder recurses); OpenAI's own bodies (tool
# schemas included) nest a handful of levels
MAX_JSON_DEPTH = 64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or a 400 that says what is wrong with it: not JSON, not an
    object, nested deeper than `MAX_JSON_DEPTH`, or a string that is not valid Unicode (a lone
    UTF-16 surrogate such as `"\\ud800"`, which JSON allows but no tokenizer takes)."""
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH:  # else no deeper than that
        _check_depth(raw)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise bad_request(f"The request body is not valid JSON: {error}", None,
                          "invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request(f"The request body must be a JSON object, got {type(body).__name__}.",
                          None, "invalid_json")
    try:  # C speed; the walk that names the field runs only when this fails
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        where = _surrogate_path(body)
        raise bad_request(f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                          "\\udfff escape): send valid Unicode text.", where.split(".")[0]
                          .split("[")[0], "invalid_value") from None
    return body


def _check_depth(raw: bytes) -> None:
    """A 400 when the JSON text nests arrays / objects deeper than `MAX_JSON_DEPTH` (counted on
    the raw text with its strings cut out, before the recursive decoder sees it; numpy keeps an
    8 MB body's scan in milliseconds)."""
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    steps = np.frombuffer(brackets, dtype=np.uint8)
    depth = np.cumsum(np.where((steps == 0x5B) | (steps == 0x7B), 1, -1))
    if depth.size and int(depth.max()) > MAX_JSON_DEPTH:
        raise bad_request(f"The request body nests JSON arrays / objects deeper than "
                          f"{MAX_JSON_DEPTH} levels.", None, "invalid_json")


def _surrogate_path(body: Any) -> str:
    """Where the first string (key or value) with a lone surrogate sits, as `a.b[2]`."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        items: list[tuple[str, Any]] = []
        if isinstance(value, dict):
            for key, item in value.items():
                if not _is_unicode(key):
                    return f"{path}.{key.encode(errors='backslashreplace').decode()}".lstrip(".")
                items.append((f"{path}.{key}".lstrip("."), item))
        elif isinstance(value, list):
            items = [(f"{path}[{index}]", item) for index, item in enumerate(value)]
        elif isinstance(value, str) and not _is_unicode(value):
            return path or "body"
        stack.extend(reversed(items))
    return "body"


def _is_unicode(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


