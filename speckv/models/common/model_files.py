"""Reading a model's files (config.json, *.safetensors, .gguf, tokenizer.json): a malformed
file raises one `ValueError` that names the file, never a parser's traceback.

The messages are what a user who points `--model` at a directory reads: the path first, then
what it should have been and the parser's own words.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def read_json_file(path: Path) -> Any:
    """The parsed JSON of `path`; invalid JSON raises ValueError naming the file."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None


@contextmanager
def reading(path: Path, kind: str) -> Iterator[None]:
    """Turns a parser's error while reading `path` into "PATH: not a valid KIND (...)"."""
    try:
        yield
    except (FileNotFoundError, PermissionError):
        raise
    except Exception as error:  # the parsers raise their own types (SafetensorError, ...)
        if str(error).startswith(str(path)):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else \
            type(error).__name__
        raise ValueError(f"{path}: not a valid {kind} ({first_line})") from None
