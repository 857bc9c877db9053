"""Incremental block hashes of one request.

Owns a request's list of block hashes for one (block size, format) pair. As real tokens arrive
(the prompt, then each sampled token) `update` appends every hash that has become computable:

    block j = [s, e) with s = j * B, e = s + B is hashable once tokens[e + L - 1] is real
    num_hashable_blocks(num_tokens) = (num_tokens - L) // B

It never rehashes a block and never sees draft or in-flight tokens (the caller passes only the
real token list). Extra-key-free blocks of pickle algorithms go through the fast encoder.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs
from speckv.hashing.formats import BlockHashFormat
from speckv.hashing.functions import BlockHash, Encoding, HashAlgo
from speckv.hashing.pickle_fast import (
    MAX_FAST_PAYLOAD_BYTES,
    EncodedTokens,
    hash_run,
)


def num_hashable_blocks(num_tokens: int, block_size: int, lookahead_tokens: int) -> int:
    return max(0, (num_tokens - lookahead_tokens) // block_size)


class RequestBlockHasher:
    """Block hashes of one request's real tokens; `update` mutates `block_hashes` only."""

    __slots__ = ("_fast", "_format", "_layout", "algo", "block_hashes", "block_size", "inputs",
                 "none_hash")

    def __init__(
        self,
        algo: HashAlgo,
        none_hash: BlockHash,
        block_size: int,
        fmt: BlockHashFormat,
        inputs: HashInputs = NO_HASH_INPUTS,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.algo = algo
        self.none_hash = none_hash
        self.block_size = block_size
        self._format = fmt
        self.inputs = inputs
        self.block_hashes: list[BlockHash] = []
        self._layout = fmt.pickle_layout(block_size)
        # ~5 bytes per token id worst case
        self._fast = (
            algo.encoding is Encoding.PICKLE
            and 5 * (block_size + fmt.lookahead_tokens) + 64 < MAX_FAST_PAYLOAD_BYTES
            and len(none_hash) < 256
        )

    @property
    def lookahead_tokens(self) -> int:
        return self._format.lookahead_tokens

    @property
    def format(self) -> BlockHashFormat:
        return self._format

    def update(self, token_ids: Sequence[int]) -> int:
        """Append the hashes that `token_ids` (all real tokens so far) make computable.

        Returns the number of hashes appended.
        """
        block_size = self.block_size
        lookahead = self._format.lookahead_tokens
        first_block = len(self.block_hashes)
        end_block = num_hashable_blocks(len(token_ids), block_size, lookahead)
        if end_block <= first_block:
            return 0
        starts = range(first_block * block_size, end_block * block_size, block_size)
        if self._fast:
            self._hash_fast(token_ids, starts)
        else:
            self._hash_plain(token_ids, starts)
        return end_block - first_block

    def _parent(self) -> BlockHash:
        return self.block_hashes[-1] if self.block_hashes else self.none_hash

    def _hash_plain(self, token_ids: Sequence[int], starts: Sequence[int]) -> None:
        key, algo, inputs = self._format.key, self.algo, self.inputs
        parent = self._parent()
        for start in starts:
            parent = algo(key(parent, token_ids, start, start + self.block_size, inputs))
            self.block_hashes.append(parent)

    def _hash_fast(self, token_ids: Sequence[int], starts: range) -> None:
        block_size = self.block_size
        lookahead = self._format.lookahead_tokens
        inputs = self.inputs
        try:
            encoded = EncodedTokens(token_ids, starts[0], starts[-1] + block_size + lookahead)
        except OverflowError:
            self._hash_plain(token_ids, starts)
            return
        if inputs.is_empty:
            self.block_hashes.extend(
                hash_run(self.algo.digest, self._layout, encoded, self._parent(), starts,
                         block_size, lookahead)
            )
            return
        # Runs of key-free blocks go fast; blocks with extra keys go through plain pickle.
        run: list[int] = []
        for start in starts:
            if inputs.span_may_have_keys(start, start + block_size + lookahead):
                if run:
                    self._extend_fast(encoded, run)
                    run = []
                self._hash_plain(token_ids, (start,))
            else:
                run.append(start)
        if run:
            self._extend_fast(encoded, run)

    def _extend_fast(self, encoded: EncodedTokens, starts: list[int]) -> None:
        self.block_hashes.extend(
            hash_run(self.algo.digest, self._layout, encoded, self._parent(), starts,
                     self.block_size, self._format.lookahead_tokens)
        )


def hash_prompt(
    algo: HashAlgo,
    none_hash: BlockHash,
    block_size: int,
    fmt: BlockHashFormat,
    token_ids: Sequence[int],
    inputs: HashInputs = NO_HASH_INPUTS,
) -> list[BlockHash]:
    """All block hashes computable from `token_ids`. Pure."""
    hasher = RequestBlockHasher(algo, none_hash, block_size, fmt, inputs)
    hasher.update(token_ids)
    return hasher.block_hashes
