"""The fast pickle encoder produces exactly `pickle.dumps(key, protocol=5)` bytes."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.hashing import request_hasher
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, MultiModalItem
from speckv.hashing.formats import (
    ExpandedWindowFormat,
    LegacyFormat,
    LookaheadFormat,
    NestedFormat,
)
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.pickle_fast import PieceEncoder, chain_hash
from speckv.hashing.request_hasher import RequestBlockHasher
from tests.hashing.hashing_reference import plain_chain

FORMATS = [LegacyFormat(), LookaheadFormat(1), LookaheadFormat(2), LookaheadFormat(4),
           NestedFormat(), ExpandedWindowFormat()]
EDGE_IDS = [0, 1, 255, 256, 65535, 65536, 2**24, 2**31 - 1]
token_ids = st.one_of(st.sampled_from(EDGE_IDS), st.integers(0, 2**31 - 1))


@pytest.fixture(autouse=True)
def _always_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    # take the numpy fast path for every size, so small examples exercise it (the native
    # chain, when built, would take them first: tests/hashing/test_native_chain.py)
    monkeypatch.setattr(request_hasher, "_native_chain", None)
    monkeypatch.setattr(request_hasher, "MIN_FAST_TOKENS", 0)
    monkeypatch.setattr(request_hasher, "MAX_FAST_BLOCK_TOKENS", 10**6)


def encoded_pieces(fmt, block_size: int, tokens: list[int]) -> list[bytes]:
    encoder = PieceEncoder(fmt.pickle_layout(block_size), block_size, fmt.lookahead_tokens)
    num_blocks = (len(tokens) - fmt.lookahead_tokens) // block_size
    return [piece for chunk in encoder.encode_pieces(tokens, 0, num_blocks) for piece in chunk]


@settings(max_examples=80, deadline=None)
@given(fmt=st.sampled_from(FORMATS), block_size=st.integers(1, 20),
       tokens=st.lists(token_ids, min_size=25, max_size=120),
       parent_len=st.sampled_from([16, 32, 255]))
def test_pieces_are_pickle_bytes(fmt, block_size: int, tokens: list[int],
                                 parent_len: int) -> None:
    parent = bytes(range(parent_len))
    pieces = encoded_pieces(fmt, block_size, tokens)
    assert len(pieces) == (len(tokens) - fmt.lookahead_tokens) // block_size > 0
    for index, piece in enumerate(pieces):
        start = index * block_size
        expected = pickle.dumps(fmt.key(parent, tokens, start, start + block_size,
                                        NO_HASH_INPUTS), protocol=5)
        # piece = everything after PROTO, FRAME, SHORT_BINBYTES len and the parent bytes
        assert expected.endswith(piece)
        assert len(expected) == len(piece) + 13 + parent_len


@pytest.mark.parametrize("block_size", [1024, 4096])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda fmt: f"{fmt.name}{fmt.lookahead_tokens}")
def test_large_blocks(block_size: int, fmt) -> None:
    tokens = [EDGE_IDS[i % len(EDGE_IDS)] ^ (i % 3) for i in range(2 * block_size + 4)]
    algo = get_hash_algo("sha256")
    out: list[bytes] = []
    got = chain_hash(algo.digest, b"\x05" * 32, encoded_pieces(fmt, block_size, tokens), out,
                     PieceEncoder(fmt.pickle_layout(block_size), block_size,
                                  fmt.lookahead_tokens).max_piece_len)
    expected = plain_chain(algo, b"\x05" * 32, block_size, fmt, tokens)
    assert out == expected and got == expected[-1]


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(FORMATS), block_size=st.integers(1, 20),
       tokens=st.lists(token_ids, max_size=150), algo_name=st.sampled_from(["sha256", "xxhash"]),
       random_seed=st.booleans(), with_mm=st.booleans())
def test_hasher_fast_equals_plain(fmt, block_size: int, tokens: list[int], algo_name: str,
                                  random_seed: bool, with_mm: bool) -> None:
    algo = get_hash_algo(algo_name)
    # random seed: 32 bytes even for xxhash, whose digests are 16 (block 0 differs)
    none_hash = make_none_hash(algo, seed=None if random_seed else "s")
    inputs = (HashInputs(mm_items=(MultiModalItem("a", 7, 5), MultiModalItem("b", 40, 30)),
                         cache_salt="salt") if with_mm else NO_HASH_INPUTS)
    hasher = RequestBlockHasher(algo, none_hash, block_size, fmt, inputs)
    hasher.update(tokens)
    assert hasher.block_hashes == plain_chain(algo, none_hash, block_size, fmt, tokens, inputs)


@pytest.mark.parametrize("bad", [2**31, 2**40, -1, -(2**31)])
def test_out_of_range_ids_fall_back_to_pickle(bad: int) -> None:
    algo = get_hash_algo("sha256")
    tokens = [5] * 40 + [bad] + [70_000] * 40
    for fmt in FORMATS:
        hasher = RequestBlockHasher(algo, b"\x02" * 32, 4, fmt)
        hasher.update(tokens)
        assert hasher.block_hashes == plain_chain(algo, b"\x02" * 32, 4, fmt, tokens)


def test_long_parent_falls_back_for_block_zero() -> None:
    algo = get_hash_algo("sha256")
    tokens = list(range(64))
    hasher = RequestBlockHasher(algo, b"\x03" * 300, 4, LookaheadFormat(1))
    hasher.update(tokens)
    assert hasher.block_hashes == plain_chain(algo, b"\x03" * 300, 4, LookaheadFormat(1),
                                              tokens)


def test_chunk_boundaries(monkeypatch: pytest.MonkeyPatch) -> None:
    from speckv.hashing import pickle_fast

    monkeypatch.setattr(pickle_fast, "CHUNK_TOKENS", 40)  # many small chunks
    monkeypatch.setattr(request_hasher, "_encoders", {})  # encoders read it when built
    algo = get_hash_algo("sha256")
    tokens = [(i * 104729) % 200_000 for i in range(500)]
    inputs = HashInputs(mm_items=(MultiModalItem("a", 30, 50), MultiModalItem("b", 200, 3)))
    for fmt in FORMATS:
        hasher = RequestBlockHasher(algo, b"\x04" * 32, 3, fmt, inputs)
        hasher.update(tokens)
        assert hasher.block_hashes == plain_chain(algo, b"\x04" * 32, 3, fmt, tokens, inputs)
