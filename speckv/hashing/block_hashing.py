"""BlockHashing: the recipe for a request's block hashers (algorithm, seed, unit, L values).

Owns nothing but that recipe. `KVCacheManager.block_hashing(algo, seed)` builds the one that
matches a manager (hash unit = gcd of its groups' block sizes, one chain per lookahead value
its groups use); each request then gets its own incremental hashers from it.
"""

from __future__ import annotations

from collections.abc import Iterable

from speckv.hashing.extra_keys import HashInputs
from speckv.hashing.formats import format_for
from speckv.hashing.functions import BlockHash, HashAlgo
from speckv.hashing.request_hasher import RequestBlockHasher


class BlockHashing:
    """Builds a request's hashers: one per lookahead value its cache groups use."""

    def __init__(self, algo: HashAlgo, none_hash: BlockHash, block_size: int,
                 lookahead_values: Iterable[int]) -> None:
        self.algo = algo
        self.none_hash = none_hash
        self.block_size = block_size  # tokens per hash (the manager's hash unit)
        self.lookahead_values = tuple(sorted(set(lookahead_values)))

    def hashers_for(self, inputs: HashInputs) -> dict[int, RequestBlockHasher]:
        return {
            lookahead: RequestBlockHasher(
                self.algo, self.none_hash, self.block_size, format_for(lookahead), inputs
            )
            for lookahead in self.lookahead_values
        }
