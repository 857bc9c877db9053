"""The native chain (`speckv.hashing._chainhash`) hashes exactly like plain `pickle.dumps`.

Skipped where the optional extension is not built (`python3 setup.py build_ext --inplace`, or
`pip install -e .`); the numpy path it replaces is tested in test_pickle_fast.py either way.
"""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.hashing import request_hasher
from speckv.hashing.extra_keys import HashInputs, MultiModalItem
from speckv.hashing.formats import (
    ExpandedWindowFormat,
    LegacyFormat,
    LookaheadFormat,
    NestedFormat,
)
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import RequestBlockHasher, hash_prompt
from tests.hashing.hashing_reference import plain_chain

native = pytest.importorskip("speckv.hashing._chainhash")

FORMATS = [LegacyFormat(), LookaheadFormat(1), LookaheadFormat(2), LookaheadFormat(4),
           NestedFormat(), ExpandedWindowFormat()]
EDGE_IDS = [0, 1, 255, 256, 65535, 65536, 2**24, 2**31 - 1]
token_ids = st.one_of(st.sampled_from(EDGE_IDS), st.integers(0, 2**31 - 1))


def test_requests_use_the_native_chain() -> None:
    hasher = RequestBlockHasher(get_hash_algo("sha256"), b"\0" * 32, 16, LookaheadFormat(1))
    assert request_hasher.native_available() and hasher._native is not None


@settings(max_examples=120, deadline=None)
@given(fmt=st.sampled_from(FORMATS), block_size=st.integers(1, 40),
       tokens=st.lists(token_ids, min_size=0, max_size=200),
       algo_name=st.sampled_from(["sha256", "xxhash"]),
       parent_len=st.sampled_from([16, 32, 255]))
def test_native_equals_plain_pickle(fmt, block_size: int, tokens: list[int], algo_name: str,
                                    parent_len: int) -> None:
    algo = get_hash_algo(algo_name)
    none_hash = bytes(range(parent_len))
    expected = plain_chain(algo, none_hash, block_size, fmt, tokens)
    assert hash_prompt(algo, none_hash, block_size, fmt, tokens) == expected
    assert hash_prompt(algo, none_hash, block_size, fmt, tuple(tokens)) == expected


@settings(max_examples=60, deadline=None)
@given(block_size=st.integers(1, 8), lookahead=st.integers(0, 3),
       tokens=st.lists(token_ids, min_size=0, max_size=80),
       cuts=st.lists(st.integers(0, 80), max_size=8))
def test_decode_steps_and_chunks_equal_the_whole_prompt(block_size: int, lookahead: int,
                                                       tokens: list[int], cuts: list[int]) -> None:
    algo = get_hash_algo("sha256")
    none_hash = make_none_hash(algo, "0")
    fmt = LookaheadFormat(lookahead) if lookahead else LegacyFormat()
    hasher = RequestBlockHasher(algo, none_hash, block_size, fmt)
    for end in sorted(cut for cut in cuts if cut <= len(tokens)):
        hasher.update(tokens[:end])
    for end in range(len(tokens) + 1):  # then token by token, like decode
        hasher.update(tokens[:end])
    assert hasher.block_hashes == plain_chain(algo, none_hash, block_size, fmt, tokens)


@pytest.mark.parametrize("odd", [True, False, -1, 2**31, 2**40, 3.0])
def test_ids_pickle_writes_another_way_fall_back_to_plain(odd) -> None:
    algo = get_hash_algo("sha256")
    tokens = [5] * 40 + [odd] + [70_000] * 40
    for fmt in (LegacyFormat(), LookaheadFormat(1)):
        expected = plain_chain(algo, b"\1" * 32, 4, fmt, tokens)
        assert hash_prompt(algo, b"\1" * 32, 4, fmt, tokens) == expected


def test_multimodal_keys_between_native_runs() -> None:
    algo = get_hash_algo("sha256")
    tokens = list(range(1000, 3000))
    inputs = HashInputs(mm_items=(MultiModalItem("a", 100, 50), MultiModalItem("b", 1500, 7)))
    for fmt in (LegacyFormat(), LookaheadFormat(1), LookaheadFormat(3)):
        expected = plain_chain(algo, b"\2" * 32, 16, fmt, tokens, inputs)
        assert hash_prompt(algo, b"\2" * 32, 16, fmt, tokens, inputs) == expected


def test_direct_call_checks_its_arguments() -> None:
    layout = LegacyFormat().pickle_layout(2)
    args = [b"\x94" + layout.open, layout.mid, layout.close + b"\x87\x94."]
    out: list[bytes] = []
    with pytest.raises(ValueError, match="too short"):
        native.chain_hash_blocks([1, 2, 3], 0, 2, 2, 0, *args, b"p", hashlib.sha256, True, out)
    with pytest.raises(TypeError, match="list or a tuple"):
        native.chain_hash_blocks(iter([1, 2]), 0, 1, 2, 0, *args, b"p", hashlib.sha256, True, out)
    with pytest.raises(TypeError, match="digest must return bytes"):
        native.chain_hash_blocks([1, 2], 0, 1, 2, 0, *args, b"p", lambda data: 7, False, out)
    with pytest.raises(ValueError, match="shorter than 256"):
        native.chain_hash_blocks([1, 2], 0, 1, 2, 0, *args, b"p" * 256, hashlib.sha256, True,
                                 out)
    assert out == []
    last = native.chain_hash_blocks([1, 2, 3, 4], 0, 2, 2, 0, *args, b"p", hashlib.sha256, True,
                                    out)
    first = hashlib.sha256(pickle.dumps((b"p", (1, 2), None), protocol=5)).digest()
    assert out == [first, hashlib.sha256(pickle.dumps((first, (3, 4), None), protocol=5))
                   .digest()]
    assert last == out[-1]

