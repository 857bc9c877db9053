"""The KV events of blocks the pool caches: what a consumer needs to rebuild each hash.

Owns `record_stored`: one `BlockStored` per contiguous run of newly cached blocks (tokens,
lookahead tokens, extra keys, parent hash, the group's kind), written to the pool's sink.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from speckv.cache.events import BlockStored, KVEventSink
from speckv.cache.hit_check import CachingRequest
from speckv.hashing.extra_keys import untag

if TYPE_CHECKING:
    from speckv.cache.block_pool import GroupInfo


def record_stored(
    sink: KVEventSink,
    request: CachingRequest,
    block_hashes: Sequence[bytes],
    indices: list[int],
    stored_hashes: list[bytes],
    group: GroupInfo,
) -> None:
    """One `BlockStored` event per contiguous run of the cached block `indices` (a consumer
    chains parents), with each block's tokens, lookahead tokens and extra keys."""
    block_size, lookahead = group.block_size, group.lookahead_tokens
    tokens = request.all_token_ids
    inputs = request.hash_inputs
    # One event per contiguous run, so a consumer can chain parents.
    runs: list[list[int]] = []
    for index in indices:
        if runs and runs[-1][-1] == index - 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    position = 0
    for run in runs:
        token_ids: list[int] = []
        lookahead_ids: list[list[int]] = []
        extra: list = []
        for index in run:
            start = index * block_size
            end = start + block_size
            token_ids.extend(tokens[start:end])
            lookahead_ids.append(list(tokens[end : end + lookahead]))
            extra.append(untag(inputs.extra_keys(start, end + lookahead)))
        first = run[0]
        sink.record(
            BlockStored(
                block_hashes=stored_hashes[position : position + len(run)],
                parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                token_ids=token_ids,
                block_size=block_size,
                lora_name=request.lora_name,
                extra_keys=extra if any(e is not None for e in extra) else None,
                group_idx=group.group_id,
                lookahead_token_ids=lookahead_ids if lookahead > 0 else None,
                kv_cache_spec_kind=group.kind,
                kv_cache_spec_sliding_window=group.sliding_window,
            )
        )
        position += len(run)
