"""How a hit is proven: a cryptographic hash is its own proof; with a fast non-cryptographic
hash the pool keeps each cached block's content and serves a hit only if it matches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from speckv.cache.block import BlockContent, KVCacheBlock
from speckv.hashing.extra_keys import HashInputs
from speckv.hashing.functions import HashAlgo


class HitCheck(Protocol):
    """Decides whether a block found under a hash really holds the request's content."""

    stores_content: bool

    def accepts(self, block: KVCacheBlock, expected: Callable[[], BlockContent]) -> bool: ...


class TrustHashes:
    """Cryptographic hashes: a matching hash is the proof."""

    stores_content = False

    def accepts(self, block: KVCacheBlock, expected: Callable[[], BlockContent]) -> bool:
        return True


class CompareContent:
    """Fast non-cryptographic hashes: a hit is served only if the content matches too."""

    stores_content = True

    def accepts(self, block: KVCacheBlock, expected: Callable[[], BlockContent]) -> bool:
        return block.content == expected()


def hit_check_for(algo: HashAlgo) -> HitCheck:
    """Trust cryptographic hashes; verify hits of fast non-cryptographic ones by content."""
    return TrustHashes() if algo.cryptographic else CompareContent()


class CachingRequest(Protocol):
    """What the pool reads of a request when it caches the request's blocks."""

    request_id: str
    all_token_ids: Sequence[int]
    num_prompt_tokens: int
    hash_inputs: HashInputs

    @property
    def lora_name(self) -> str | None: ...


def content_of(
    request: CachingRequest, parent: bytes, start: int, end: int, lookahead_tokens: int
) -> BlockContent:
    """The content a block `[start, end)` of `request` is hashed over. Pure."""
    tokens = request.all_token_ids
    return BlockContent(
        parent_hash=parent,
        token_ids=tuple(tokens[start:end]),
        lookahead_token_ids=tuple(tokens[end : end + lookahead_tokens]),
        extra_keys=request.hash_inputs.extra_keys(start, end + lookahead_tokens),
    )
