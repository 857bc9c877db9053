"""Workloads the benchmarks and the demo send: synthetic generators and prompt files."""

from speckv.workloads.prefix_repetition import (
    PrefixRepetitionConfig,
    exact_length_tokens,
    oracle_hit_tokens,
    prefix_repetition,
)
from speckv.workloads.requests import TextTokenizer, WorkloadRequest, load_jsonl

__all__ = [
    "PrefixRepetitionConfig",
    "TextTokenizer",
    "WorkloadRequest",
    "exact_length_tokens",
    "load_jsonl",
    "oracle_hit_tokens",
    "prefix_repetition",
]
