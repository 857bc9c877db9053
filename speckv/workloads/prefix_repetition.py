"""vLLM's `prefix_repetition` workload generator, and the hit a perfect cache would give it.

Owns turning workload parameters into a list of `WorkloadRequest`s (token ids + output length).
`prefix_repetition`: `num_prefixes` random prefixes, each shared by
`num_prompts // num_prefixes` prompts with their own random suffixes:

    prompt = [ prefix_k (prefix_len tokens) | suffix (suffix_len tokens) ]

Random token ids are decoded to text and re-encoded, then cut or padded to the exact length,
so prompts are text a tokenizer really produces (as vLLM's generator does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.workloads.requests import TextTokenizer, WorkloadRequest


@dataclass(frozen=True)
class PrefixRepetitionConfig:
    prefix_len: int = 256
    suffix_len: int = 256
    num_prefixes: int = 10
    output_len: int = 128
    num_prompts: int = 100
    seed: int = 0
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("prefix_len", "suffix_len", "output_len"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_len + self.suffix_len <= 0:
            raise ValueError("prefix_len + suffix_len must be > 0")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.num_prefixes < 1:
            raise ValueError(f"num_prefixes must be >= 1, got {self.num_prefixes}")
        if self.num_prompts < self.num_prefixes:
            raise ValueError(
                f"num_prompts ({self.num_prompts}) must be >= num_prefixes ({self.num_prefixes})"
            )


def exact_length_tokens(rng: np.random.Generator, length: int, vocab_size: int,
                        tokenizer: TextTokenizer | None) -> list[int]:
    """`length` token ids that survive a decode/encode round trip (when a tokenizer is
    given). Pure given the generator state."""
    if length == 0:
        return []
    token_ids = rng.integers(0, vocab_size, size=length).tolist()
    if tokenizer is None:
        return token_ids
    for _ in range(4):
        reencoded = tokenizer.encode(tokenizer.decode(token_ids))
        if len(reencoded) >= length:
            return reencoded[:length]
        token_ids = reencoded + rng.integers(0, vocab_size, size=length - len(reencoded)).tolist()
    return token_ids[:length]


def prefix_repetition(config: PrefixRepetitionConfig, vocab_size: int,
                      tokenizer: TextTokenizer | None = None) -> list[WorkloadRequest]:
    """The workload; deterministic in `config.seed`. Pure."""
    rng = np.random.default_rng(config.seed)
    prompts_per_prefix = config.num_prompts // config.num_prefixes
    requests = []
    for prefix_index in range(config.num_prefixes):
        prefix = exact_length_tokens(rng, config.prefix_len, vocab_size, tokenizer)
        for _ in range(prompts_per_prefix):
            suffix = exact_length_tokens(rng, config.suffix_len, vocab_size, tokenizer)
            requests.append(WorkloadRequest(prefix + suffix, config.output_len, prefix_index))
    if config.shuffle:
        order = rng.permutation(len(requests))
        requests = [requests[index] for index in order]
    return requests


def oracle_hit_tokens(requests: list[WorkloadRequest], block_size: int) -> int:
    """Prompt tokens a perfect cache of unbounded size could serve, in arrival order: each
    prompt reuses whole blocks of its longest common prefix with any earlier prompt, at most
    N - 1 tokens. Pure."""
    algo = get_hash_algo("sha256")
    none_hash = make_none_hash(algo, "oracle")
    legacy = format_for(0)  # chained hashes: equal hash <=> equal prefix
    seen: set[bytes] = set()
    total = 0
    for request in requests:
        hashes = hash_prompt(algo, none_hash, block_size, legacy, request.prompt_token_ids)
        num_candidates = (len(request.prompt_token_ids) - 1) // block_size
        hit_blocks = 0
        while hit_blocks < num_candidates and hashes[hit_blocks] in seen:
            hit_blocks += 1
        total += hit_blocks * block_size
        seen.update(hashes)
    return total
