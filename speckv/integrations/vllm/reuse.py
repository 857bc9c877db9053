"""Block reuse at divergence points, inside vLLM: speckv's `reuses_divergent_blocks`.

Owns the index of cached blocks by (parent hash, block tokens) and the hit extension. With
lookahead hashes a prompt that shares a cached prefix but continues with another token after a
block boundary misses that block (its hash names the other successor), though only the draft KV
of the block's last L positions depends on the successor. So when the request's own hash of
block j misses and a block with its tokens after the same chain is cached under another
successor, the hit takes that block and stops L tokens short of its end:

    hit = j * B + (B - L)      whenever block j ends at or before N - 1

vLLM's own partial-hit path then does the rest: a hit that ends inside a block copies that
block into a private one (copy-on-write, run by the model runner before the step), recomputes
the positions after the hit (their draft KV now from the request's own successor) and caches
the private block under the request's own hash once it exists.

Only for one full-attention group whose block is one hash unit, and requests without extra
hash keys (LoRA, multimodal items, cache salt, prompt embeddings): the index key holds tokens
and the chain only.
"""

from __future__ import annotations

from typing import Any

_INDEX_ATTR = "_speckv_successor_index"


class SuccessorIndex:
    """(parent hash, block tokens) -> the last block cached for them, under any successor.

    Entries are checked on use: a block evicted or re-cached since has another hash (or none),
    and the entry is dropped."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: dict[tuple[bytes, tuple[int, ...]], tuple[Any, Any]] = {}

    def record(self, parent: bytes, tokens: tuple[int, ...], block: Any) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries = {key: entry for key, entry in self._entries.items()
                             if entry[0].block_hash == entry[1]}
            if len(self._entries) >= self.max_entries:  # all live: forget the oldest half
                keys = list(self._entries)[: len(self._entries) // 2]
                for key in keys:
                    del self._entries[key]
        self._entries[(parent, tokens)] = (block, block.block_hash)

    def find(self, parent: bytes, tokens: tuple[int, ...]) -> Any | None:
        key = (parent, tokens)
        entry = self._entries.get(key)
        if entry is None:
            return None
        block, cached_as = entry
        if block.block_hash is None or block.block_hash != cached_as:
            del self._entries[key]
            return None
        return block


def request_has_extra_keys(request: Any) -> bool:
    return bool(request.lora_request or request.mm_features or request.cache_salt
                or getattr(request, "prompt_embeds", None) is not None)


def index_of(block_pool: Any) -> SuccessorIndex:
    index = getattr(block_pool, _INDEX_ATTR, None)
    if index is None:
        index = SuccessorIndex(max_entries=4 * max(1, block_pool.num_gpu_blocks))
        setattr(block_pool, _INDEX_ATTR, index)
    return index


def record_cached_blocks(block_pool: Any, request: Any, blocks: list, first: int, end: int,
                         block_size: int, none_hash: bytes) -> None:
    """Index blocks [first, end) of `request` that `cache_full_blocks` just cached."""
    if request_has_extra_keys(request):
        return
    index = index_of(block_pool)
    hashes, tokens = request.block_hashes, request.all_token_ids
    for position in range(first, min(end, len(blocks), len(hashes))):
        block = blocks[position]
        if block.is_null or block.block_hash is None:
            continue
        parent = hashes[position - 1] if position else none_hash
        start = position * block_size
        index.record(parent, tuple(tokens[start:start + block_size]), block)


def divergent_source(block_pool: Any, request: Any, hit_length: int, block_size: int,
                     lookahead: int, none_hash: bytes) -> Any | None:
    """The cached block holding the request's block after a `hit_length`-token hit under
    another successor, or None (no such block, or block j would end after N - 1). Pure."""
    if hit_length % block_size or request_has_extra_keys(request):
        return None
    index = hit_length // block_size
    end = hit_length + block_size
    if end > request.num_tokens - 1 or lookahead >= block_size:
        return None
    hashes = request.block_hashes
    if index > len(hashes):
        return None
    parent = hashes[index - 1] if index else none_hash
    return index_of(block_pool).find(parent, tuple(request.all_token_ids[hit_length:end]))
