"""Legacy and lookahead block hashes against golden tuples built by hand, and the formats'
separation (legacy != lookahead, L=1 != L=2, expanded window == legacy with block size B+1)."""

from __future__ import annotations

import hashlib
import pickle

import pytest

from speckv.hashing.block_hash import hash_block_tokens, hash_lookahead_block
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, LoRARef
from speckv.hashing.formats import (
    ExpandedWindowFormat,
    LegacyFormat,
    LookaheadFormat,
    NestedFormat,
    format_for,
)
from speckv.hashing.functions import get_hash_algo
from speckv.hashing.request_hasher import hash_prompt

SHA = get_hash_algo("sha256")
NONE_HASH = b"\x07" * 32
TOKENS = list(range(100, 140))


def h(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def test_legacy_matches_vllm_hash_block_tokens_shape() -> None:
    block0 = h((NONE_HASH, (100, 101, 102, 103), None))
    block1 = h((block0, (104, 105, 106, 107), None))
    assert hash_block_tokens(SHA, NONE_HASH, TOKENS[0:4]) == block0
    assert hash_prompt(SHA, NONE_HASH, 4, LegacyFormat(), TOKENS[:9])[:2] == [block0, block1]


@pytest.mark.parametrize("lookahead", [1, 2, 4])
def test_lookahead_matches_golden_tuple(lookahead: int) -> None:
    tail0 = (None, *TOKENS[4 : 4 + lookahead])
    block0 = h((NONE_HASH, (100, 101, 102, 103), tail0))
    tail1 = (None, *TOKENS[8 : 8 + lookahead])
    block1 = h((block0, (104, 105, 106, 107), tail1))
    got = hash_prompt(SHA, NONE_HASH, 4, format_for(lookahead), TOKENS[: 8 + lookahead])
    assert got == [block0, block1]
    assert hash_lookahead_block(SHA, NONE_HASH, TOKENS[0:4], TOKENS[4 : 4 + lookahead]) == block0


def test_lookahead_golden_with_extra_keys_spanning_the_lookahead() -> None:
    lora = HashInputs(lora=LoRARef("adapter", "/p"))
    expected = h((NONE_HASH, (100, 101, 102, 103), ((("lora", "adapter", "/p"),), 104)))
    assert hash_prompt(SHA, NONE_HASH, 4, format_for(1), TOKENS[:5], lora) == [expected]


def test_lookahead_needs_a_token() -> None:
    with pytest.raises(ValueError):
        hash_lookahead_block(SHA, NONE_HASH, TOKENS[0:4], [])
    with pytest.raises(ValueError):
        LookaheadFormat(0)
    with pytest.raises(ValueError):
        format_for(-1)


def test_legacy_differs_from_lookahead_and_l1_from_l2() -> None:
    legacy = hash_prompt(SHA, NONE_HASH, 4, format_for(0), TOKENS[:10])
    look1 = hash_prompt(SHA, NONE_HASH, 4, format_for(1), TOKENS[:10])
    look2 = hash_prompt(SHA, NONE_HASH, 4, format_for(2), TOKENS[:10])
    assert legacy[0] != look1[0] != look2[0] != legacy[0]


def test_expanded_window_collides_with_legacy_of_block_size_plus_one() -> None:
    # expanded hashes tokens[s:e+1] with E(s, e+1): the legacy hash of a block of B + 1
    expanded = ExpandedWindowFormat().key(NONE_HASH, TOKENS, 0, 4, NO_HASH_INPUTS)
    legacy_b5 = LegacyFormat().key(NONE_HASH, TOKENS, 0, 5, NO_HASH_INPUTS)
    assert SHA(expanded) == SHA(legacy_b5)
    adopted = LookaheadFormat(1).key(NONE_HASH, TOKENS, 0, 4, NO_HASH_INPUTS)
    assert SHA(adopted) != SHA(legacy_b5)


def test_nested_format_golden() -> None:
    expected = h((NONE_HASH, (100, 101, 102, 103), (None, 104, None)))
    assert hash_prompt(SHA, NONE_HASH, 4, NestedFormat(), TOKENS[:5]) == [expected]


def test_cbor_lookahead_golden() -> None:
    import cbor2

    algo = get_hash_algo("sha256_cbor")
    expected = hashlib.sha256(
        cbor2.dumps((NONE_HASH, (100, 101, 102, 103), (None, 104)), canonical=True)
    ).digest()
    assert hash_prompt(algo, NONE_HASH, 4, format_for(1), TOKENS[:5]) == [expected]
