"""A workload's requests, and reading them from a JSONL prompt file.

Owns `WorkloadRequest` (token ids + output length) and `load_jsonl`; generators of synthetic
workloads live beside this module and return the same type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


class TextTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkloadRequest:
    prompt_token_ids: list[int]
    output_len: int
    prefix_index: int | None = None  # which shared prefix, for prefix_repetition


def load_jsonl(path: Path, tokenizer: TextTokenizer, default_output_len: int
               ) -> list[WorkloadRequest]:
    """One JSON object per line: `{"prompt": str}` or `{"prompt_token_ids": [...]}`, optional
    `"output_len"`."""
    requests = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{line_number}: not JSON ({error.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{line_number}: expected an object")
        if "prompt_token_ids" in item:
            token_ids = [int(token) for token in item["prompt_token_ids"]]
        elif isinstance(item.get("prompt"), str):
            token_ids = tokenizer.encode(item["prompt"])
        else:
            raise ValueError(f"{path}:{line_number}: needs 'prompt' or 'prompt_token_ids'")
        output_len = int(item.get("output_len", default_output_len))
        if output_len < 1:
            raise ValueError(f"{path}:{line_number}: output_len must be >= 1")
        requests.append(WorkloadRequest(token_ids, output_len))
    if not requests:
        raise ValueError(f"{path}: no prompts")
    return requests
