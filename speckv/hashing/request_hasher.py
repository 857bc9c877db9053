"""Incremental block hashes of one request.

Owns a request's list of block hashes for one (block size, format) pair. As real tokens arrive
(the prompt, then each sampled token) `update` appends every hash that has become computable:

    block j = [s, e) with s = j * B, e = s + B is hashable once tokens[e + L - 1] is real
    num_hashable_blocks(num_tokens) = (num_tokens - L) // B

It never rehashes a block and never sees draft or in-flight tokens (the caller passes only the
real token list). Extra-key-free blocks of pickle algorithms go through the fast encoder.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence

import numpy as np

from speckv.hashing import functions as _functions
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs
from speckv.hashing.formats import BlockHashFormat
from speckv.hashing.functions import BlockHash, Encoding, HashAlgo
from speckv.hashing.pickle_fast import (
    MEMOIZE_BYTES,
    TUPLE3_MEMO_STOP_BYTES,
    PieceEncoder,
    chain_hash,
    fast_path_fits,
)

try:  # the optional native chain (setup.py builds it; absent: the numpy path, same hashes)
    from speckv.hashing._chainhash import chain_hash_blocks as _native_chain
except ImportError:  # pragma: no cover - depends on the build
    _native_chain = None

# Below this many tokens in one update the plain per-block path is cheaper than the fast
# encoder's fixed numpy cost (~40 us); decode steps (one block at a time) always take it.
MIN_FAST_TOKENS = 1024
# Above this many tokens per block (B + L) the C pickler's per-token cost beats the numpy
# encoder's and the per-block Python overhead no longer matters: the plain path is faster
# (measured: on par at 256 + 1, plain 4-8% faster at 512 and 1024).
MAX_FAST_BLOCK_TOKENS = 320
# Key-free runs shorter than this go through the plain path with the keyed blocks around them:
# the fast encoder's per-chunk and per-run costs only pay off over longer runs (measured with
# a 512-token image every 1,024 tokens: B=128 leaves runs of 3 blocks, B=16 runs of 31).
MIN_FAST_RUN_BLOCKS = 8
# SHORT_BINBYTES holds parents shorter than this; longer ones pickle differently.
_MAX_FAST_PARENT_BYTES = 256


def num_hashable_blocks(num_tokens: int, block_size: int, lookahead_tokens: int) -> int:
    return max(0, (num_tokens - lookahead_tokens) // block_size)


def _keyed_block_ranges(
    inputs: HashInputs, block_size: int, lookahead: int, first_block: int, end_block: int
) -> list[tuple[int, int]] | None:
    """Sorted, disjoint `[a, b)` ranges of blocks in `[first_block, end_block)` whose span
    `[s, e + L)` may have extra keys (as `HashInputs.span_may_have_keys`); None when all may."""
    if inputs.lora is not None or inputs.prompt_embeds is not None:
        return None
    ranges: list[tuple[int, int]] = []
    if inputs.cache_salt is not None:
        ranges.append((0, 1))
    for item in inputs.mm_items:  # sorted by offset, disjoint
        # block j overlaps [offset, end) iff j * B < end and offset < j * B + B + L
        first = max(0, (item.offset - block_size - lookahead) // block_size + 1)
        end = -(-item.end // block_size)
        ranges.append((first, end))
    merged: list[tuple[int, int]] = []
    for first, end in sorted(ranges):
        first, end = max(first, first_block), min(end, end_block)
        if first >= end:
            continue
        if merged and first <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((first, end))
    return merged


def _plain_block_ranges(keyed: list[tuple[int, int]], first_block: int, end_block: int
                        ) -> list[tuple[int, int]]:
    """`keyed` plus the key-free runs shorter than MIN_FAST_RUN_BLOCKS, merged and sorted."""
    plain: list[tuple[int, int]] = []
    previous_end = first_block
    for first, end in [*keyed, (end_block, end_block)]:
        gap_is_short = 0 < first - previous_end < MIN_FAST_RUN_BLOCKS
        start = previous_end if gap_is_short else first
        if plain and start <= plain[-1][1]:
            plain[-1] = (plain[-1][0], max(end, plain[-1][1]))
        elif start < end:
            plain.append((start, end))
        previous_end = max(previous_end, end)
    return plain


def native_available() -> bool:
    """Whether the native chain (`speckv.hashing._chainhash`) is built and enabled."""
    return _native_chain is not None


class _NativeChain:
    """Arguments of the native chain for one (format, block size, algorithm)."""

    __slots__ = ("call_digest", "digest", "mid", "prefix", "suffix")

    def __init__(self, fmt: BlockHashFormat, block_size: int, algo: HashAlgo) -> None:
        layout = fmt.pickle_layout(block_size)
        self.prefix = MEMOIZE_BYTES + layout.open
        self.mid = layout.mid
        self.suffix = layout.close + TUPLE3_MEMO_STOP_BYTES
        if algo.digest is _functions._sha256_digest:
            # the C constructor, then .digest(): same bytes, no Python wrapper per block
            self.digest, self.call_digest = hashlib.sha256, True
        else:
            self.digest, self.call_digest = algo.digest, False


class RequestBlockHasher:
    """Block hashes of one request's real tokens; `update` mutates `block_hashes` only."""

    __slots__ = ("_encoder", "_format", "_native", "algo", "block_hashes", "block_size",
                 "inputs", "none_hash")

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
        fast = (
            algo.encoding is Encoding.PICKLE
            and block_size + fmt.lookahead_tokens <= MAX_FAST_BLOCK_TOKENS
            and fast_path_fits(block_size, fmt.lookahead_tokens)
            and inputs.lora is None
            and inputs.prompt_embeds is None
        )
        self._encoder = _encoder_for(fmt, block_size) if fast else None
        # the native chain has no per-call cost worth avoiding: it takes every pickle block
        # the numpy encoder could (any size up to one pickle frame), decode steps included
        native = (
            _native_chain is not None
            and algo.encoding is Encoding.PICKLE
            and fast_path_fits(block_size, fmt.lookahead_tokens)
            and inputs.lora is None
            and inputs.prompt_embeds is None
        )
        self._native = _NativeChain(fmt, block_size, algo) if native else None

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
        if self._native is not None and type(token_ids) in (list, tuple):
            self._hash_native(token_ids, first_block, end_block)
        elif (
            self._encoder is not None
            and (end_block - first_block) * (block_size + lookahead) >= MIN_FAST_TOKENS
        ):
            self._hash_fast(token_ids, first_block, end_block)
        else:
            self._hash_plain(token_ids, first_block, end_block)
        return end_block - first_block

    def hash_with_successors(self, token_ids: Sequence[int], index: int,
                             successors: Sequence[int]) -> BlockHash:
        """The hash block `index` would have if the L tokens after it were `successors` (its
        parent from this chain). Pure: the reference path, one block; `token_ids` must reach
        the block's end. Block reuse at divergence points checks a cached block with it."""
        lookahead = self._format.lookahead_tokens
        if len(successors) != lookahead:
            raise ValueError(f"{len(successors)} successor tokens for L = {lookahead}")
        if not 0 <= index <= len(self.block_hashes):
            raise ValueError(f"block {index}: its parent's hash does not exist yet")
        start = index * self.block_size
        end = start + self.block_size
        if len(token_ids) < end:
            raise ValueError(f"block {index} needs {end} tokens, got {len(token_ids)}")
        parent = self.block_hashes[index - 1] if index else self.none_hash
        window = _WithSuccessors(token_ids, end, successors)
        return self.algo(self._format.key(parent, window, start, end, self.inputs))

    def _parent(self) -> BlockHash:
        return self.block_hashes[-1] if self.block_hashes else self.none_hash

    def _hash_plain(self, token_ids: Sequence[int], first_block: int, end_block: int) -> None:
        """One `algo(key)` per block: the reference path (extra keys, CBOR, decode steps)."""
        key, inputs, block_size = self._format.key, self.inputs, self.block_size
        parent = self._parent()
        hashes = self.block_hashes
        algo = self.algo
        if algo.encoding is Encoding.PICKLE and algo.digest is _functions._sha256_digest:
            # same bytes as algo(obj); skips two Python-level wrappers per block
            dumps, sha256, protocol = pickle.dumps, hashlib.sha256, pickle.HIGHEST_PROTOCOL
            for start in range(first_block * block_size, end_block * block_size, block_size):
                obj = key(parent, token_ids, start, start + block_size, inputs)
                parent = sha256(dumps(obj, protocol=protocol)).digest()
                hashes.append(parent)
            return
        for start in range(first_block * block_size, end_block * block_size, block_size):
            parent = algo(key(parent, token_ids, start, start + block_size, inputs))
            hashes.append(parent)

    def _hash_native(self, token_ids: list[int] | tuple[int, ...], first_block: int,
                     end_block: int) -> None:
        """Key-free runs through the native chain; blocks with extra keys the plain way."""
        native = self._native
        assert native is not None and _native_chain is not None
        block_size, lookahead = self.block_size, self._format.lookahead_tokens
        if len(self._parent()) >= _MAX_FAST_PARENT_BYTES:
            self._hash_plain(token_ids, first_block, first_block + 1)
            first_block += 1
        keyed = (
            [] if self.inputs.is_empty
            else _keyed_block_ranges(self.inputs, block_size, lookahead, first_block, end_block)
        )
        assert keyed is not None  # lora / prompt embeds never get the native chain
        hashes = self.block_hashes
        block = first_block
        for keyed_first, keyed_end in [*keyed, (end_block, end_block)]:
            if block < keyed_first:
                try:
                    _native_chain(token_ids, block * block_size, keyed_first - block, block_size,
                                  lookahead, native.prefix, native.mid, native.suffix,
                                  self._parent(), native.digest, native.call_digest, hashes)
                except OverflowError:
                    # an id pickle writes another way (bool, >= 2**31, ...): plain from there
                    self._hash_plain(token_ids, len(hashes), keyed_first)
            if keyed_first < keyed_end:
                self._hash_plain(token_ids, keyed_first, keyed_end)
            block = keyed_end

    def _hash_fast(self, token_ids: Sequence[int], first_block: int, end_block: int) -> None:
        encoder = self._encoder
        assert encoder is not None
        block_size, lookahead = self.block_size, self._format.lookahead_tokens
        hashes = self.block_hashes
        if len(self._parent()) >= _MAX_FAST_PARENT_BYTES:
            self._hash_plain(token_ids, first_block, first_block + 1)
            first_block += 1
            if first_block >= end_block:
                return
        keyed = (
            [] if self.inputs.is_empty
            else _keyed_block_ranges(self.inputs, block_size, lookahead, first_block, end_block)
        )
        assert keyed is not None  # lora / prompt embeds never get an encoder
        if keyed:
            keyed = _plain_block_ranges(keyed, first_block, end_block)
        keep = None  # encode only the key-free blocks (multimodal: about half of them)
        if keyed:
            keep = np.ones(end_block - first_block, dtype=bool)
            for first, end in keyed:
                keep[first - first_block : end - first_block] = False
        digest, max_piece_len = self.algo.digest, encoder.max_piece_len
        keyed_index = 0
        block = first_block
        try:
            for pieces in encoder.encode_pieces(token_ids, first_block * block_size,
                                                end_block - first_block, keep):
                chunk_end = min(block + encoder.blocks_per_chunk, end_block)
                used = 0  # pieces of this chunk consumed (key-free blocks only)
                while block < chunk_end:
                    while keyed_index < len(keyed) and keyed[keyed_index][1] <= block:
                        keyed_index += 1
                    if keyed_index < len(keyed) and keyed[keyed_index][0] <= block:
                        stop = min(keyed[keyed_index][1], chunk_end)
                        self._hash_plain(token_ids, block, stop)
                    else:
                        stop = chunk_end if keyed_index >= len(keyed) else min(
                            keyed[keyed_index][0], chunk_end)
                        run = pieces[used : used + stop - block]
                        used += stop - block
                        chain_hash(digest, self._parent(), run, hashes, max_piece_len)
                    block = stop
        except OverflowError:
            # an id outside BININT's range in this chunk: pickle it the plain way
            self._hash_plain(token_ids, len(hashes), end_block)


class _WithSuccessors(Sequence[int]):
    """`token_ids[:end]` followed by `successors`, without copying the prefix."""

    __slots__ = ("_end", "_successors", "_tokens")

    def __init__(self, token_ids: Sequence[int], end: int, successors: Sequence[int]) -> None:
        self._tokens, self._end, self._successors = token_ids, end, tuple(successors)

    def __len__(self) -> int:
        return self._end + len(self._successors)

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1 and stop <= self._end:
                return list(self._tokens[start:stop])
            return [self[i] for i in range(start, stop, step)]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._tokens[index] if index < self._end else self._successors[index - self._end]


_encoders: dict[tuple[BlockHashFormat, int], PieceEncoder] = {}


def _encoder_for(fmt: BlockHashFormat, block_size: int) -> PieceEncoder:
    """Shared, immutable encoders (formats are frozen dataclasses, so hashable)."""
    key = (fmt, block_size)
    try:
        encoder = _encoders.get(key)
    except TypeError:  # an unhashable custom format: no sharing
        return PieceEncoder(fmt.pickle_layout(block_size), block_size, fmt.lookahead_tokens)
    if encoder is None:
        if len(_encoders) > 64:  # many shapes in one process (tests): don't grow forever
            _encoders.clear()
        encoder = _encoders[key] = PieceEncoder(
            fmt.pickle_layout(block_size), block_size, fmt.lookahead_tokens
        )
    return encoder


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
