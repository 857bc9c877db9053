"""The plain reference chain (`algo(fmt.key(...))`) that the hashing tests compare against."""

from __future__ import annotations

from collections.abc import Sequence

from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs
from speckv.hashing.formats import BlockHashFormat
from speckv.hashing.functions import BlockHash, HashAlgo


def plain_chain(algo: HashAlgo, none_hash: BlockHash, block_size: int, fmt: BlockHashFormat,
                token_ids: Sequence[int], inputs: HashInputs = NO_HASH_INPUTS
                ) -> list[BlockHash]:
    """Every block through plain `pickle.dumps` / CBOR: the definition the fast path matches."""
    hashes: list[BlockHash] = []
    parent = none_hash
    num_blocks = max(0, (len(token_ids) - fmt.lookahead_tokens) // block_size)
    for start in range(0, num_blocks * block_size, block_size):
        parent = algo(fmt.key(parent, token_ids, start, start + block_size, inputs))
        hashes.append(parent)
    return hashes
