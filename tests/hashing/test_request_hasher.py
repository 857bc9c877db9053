"""The incremental request hasher: token-by-token == whole prompt, hash counts, no rehashing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.hashing import request_hasher
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, LoRARef, MultiModalItem
from speckv.hashing.formats import format_for
from speckv.hashing.functions import HASH_ALGOS, get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import RequestBlockHasher, hash_prompt, num_hashable_blocks
from tests.hashing.hashing_reference import plain_chain

ALGO_NAMES = sorted(HASH_ALGOS)


@st.composite
def scenarios(draw: st.DrawFn) -> tuple:
    block_size = draw(st.integers(1, 8))
    lookahead = draw(st.integers(0, 4))
    tokens = draw(st.lists(st.integers(0, 70_000), min_size=0, max_size=60))
    # arrival chunks: cut points in the token list
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=6)))
    kind = draw(st.sampled_from(["none", "mm", "salt", "lora"]))
    if kind == "mm":
        offset = draw(st.integers(0, 40))
        inputs = HashInputs(mm_items=(MultiModalItem("img", offset, draw(st.integers(1, 9))),))
    elif kind == "salt":
        inputs = HashInputs(cache_salt="salt")
    elif kind == "lora":
        inputs = HashInputs(lora=LoRARef("l", "/l"))
    else:
        inputs = NO_HASH_INPUTS
    algo_name = draw(st.sampled_from(ALGO_NAMES))
    return block_size, lookahead, tokens, cuts, inputs, algo_name


@settings(max_examples=60, deadline=None)
@given(scenarios())
def test_incremental_equals_whole_and_never_rehashes(scenario: tuple) -> None:
    block_size, lookahead, tokens, cuts, inputs, algo_name = scenario
    algo = get_hash_algo(algo_name)
    none_hash = make_none_hash(algo, seed="t")
    fmt = format_for(lookahead)
    hasher = RequestBlockHasher(algo, none_hash, block_size, fmt, inputs)
    seen: list[bytes] = []
    for end in [*cuts, len(tokens)]:
        added = hasher.update(tokens[:end])
        assert added == len(hasher.block_hashes) - len(seen)
        assert hasher.block_hashes[: len(seen)] == seen  # earlier entries unchanged
        seen = list(hasher.block_hashes)
    whole = hash_prompt(algo, none_hash, block_size, fmt, tokens, inputs)
    assert hasher.block_hashes == whole
    assert whole == plain_chain(algo, none_hash, block_size, fmt, tokens, inputs)
    assert len(whole) == max(0, (len(tokens) - lookahead) // block_size)


def test_token_by_token_equals_whole_prompt_fast_path_sizes() -> None:
    # long enough that the whole-prompt call takes the fast path, token by token the plain one
    algo = get_hash_algo("sha256")
    none_hash = make_none_hash(algo, seed="t")
    tokens = [(i * 7919) % 151_000 for i in range(3000)]
    for lookahead in (0, 1, 3):
        fmt = format_for(lookahead)
        hasher = RequestBlockHasher(algo, none_hash, 16, fmt)
        for end in range(1, len(tokens) + 1):
            hasher.update(tokens[:end])
        assert hasher.block_hashes == hash_prompt(algo, none_hash, 16, fmt, tokens)


def test_num_hashable_blocks() -> None:
    assert num_hashable_blocks(33, 16, 1) == 2
    assert num_hashable_blocks(32, 16, 1) == 1
    assert num_hashable_blocks(32, 16, 0) == 2
    assert num_hashable_blocks(3, 16, 4) == 0


def test_update_returns_zero_when_nothing_new() -> None:
    algo = get_hash_algo("sha256")
    hasher = RequestBlockHasher(algo, b"\0" * 32, 4, format_for(1))
    assert hasher.update([1, 2, 3, 4]) == 0  # lookahead token missing
    assert hasher.update([1, 2, 3, 4, 5]) == 1
    assert hasher.update([1, 2, 3, 4, 5]) == 0
    assert hasher.lookahead_tokens == 1


def test_bad_block_size() -> None:
    with pytest.raises(ValueError):
        RequestBlockHasher(get_hash_algo("sha256"), b"\0" * 32, 0, format_for(0))


def test_decode_steps_use_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    original = RequestBlockHasher._hash_fast

    def spy(self, token_ids, first, end):  # type: ignore[no-untyped-def]
        calls.append(end - first)
        return original(self, token_ids, first, end)

    monkeypatch.setattr(RequestBlockHasher, "_hash_fast", spy)
    monkeypatch.setattr(request_hasher, "_native_chain", None)  # the numpy path's rule
    algo = get_hash_algo("sha256")
    tokens = list(range(5000))
    hasher = RequestBlockHasher(algo, b"\0" * 32, 16, format_for(1))
    hasher.update(tokens[:4097])
    assert calls == [256]  # the prompt: one fast call
    for end in range(4098, 4200):
        hasher.update(tokens[:end])
    assert calls == [256]  # one block per decode step: plain
    assert request_hasher.MIN_FAST_TOKENS > 16 + 1
