"""The whole-request checks of `PagedSymbolicKV` and the whole-block check of a tier's blocks
give the verdict and the message of the slot-by-slot readings they replace, on random writes
and random corruptions (one slot's K or V, the target or the draft KV, any value)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.connectors.metadata import BlockDescriptor
from speckv.simulation import PagedSymbolicKV, SymbolicKV
from speckv.simulation.tiers import _first_violation, block_violation

NUM_BLOCKS, BLOCK_SIZE = 12, 4


@st.composite
def written_kv(draw: st.DrawFn) -> tuple:
    """A request's block table, its tokens, and writes over it as the toy runner makes them
    (forward passes over tokens + drafts, the drafter's rewrites), into both stores."""
    depth = draw(st.integers(0, 3))
    tokens = draw(st.lists(st.integers(0, 49), min_size=1, max_size=NUM_BLOCKS * BLOCK_SIZE))
    num_table = -(-len(tokens) // BLOCK_SIZE)
    table = draw(st.permutations(range(NUM_BLOCKS)))[:num_table]
    paged = PagedSymbolicKV(NUM_BLOCKS, BLOCK_SIZE, depth)
    reference = SymbolicKV(NUM_BLOCKS, BLOCK_SIZE, depth)
    for _ in range(draw(st.integers(0, 6))):
        end = draw(st.integers(0, len(tokens)))
        start = draw(st.integers(0, end))
        draft_start = draw(st.integers(0, end))
        sequence = tokens[:end] + draw(st.lists(st.integers(0, 49), max_size=4))
        for kv in (paged, reference):
            kv.write(table, sequence, start, end, draft_start)
    return paged, reference, table, tokens


@settings(max_examples=300, deadline=None)
@given(written_kv(), st.data())
def test_writes_and_checks_match_the_slot_by_slot_reading(case, data):
    paged, reference, table, tokens = case
    for position in range(len(table) * BLOCK_SIZE):
        assert paged.read(table, position) == reference.read(table, position)
    if data.draw(st.booleans()):  # one slot's K or V goes wrong, in the target or draft KV
        slot = paged.slot(table, data.draw(st.integers(0, len(tokens) - 1)))
        cache = data.draw(st.sampled_from([paged._target, paged._draft]))
        index = (data.draw(st.integers(0, 1)), slot)
        if cache.ndim == 3:
            index += (data.draw(st.integers(0, cache.shape[2] - 1)),)
        cache[index] = data.draw(st.sampled_from([0.0, 1.0, 7.0, 50.0]))
    num_positions = data.draw(st.integers(0, len(tokens)))
    num_draft = data.draw(st.integers(0, num_positions))
    # the reading position by position: every target position first, then the draft KV
    want = (SymbolicKV.mismatch(paged, table, tokens, num_positions, 0)
            or SymbolicKV.mismatch(paged, table, tokens, 0, num_draft))
    assert paged.mismatch(table, tokens, num_positions, num_draft) == want


def test_a_written_request_checks_clean_and_one_wrong_slot_is_named():
    paged = PagedSymbolicKV(NUM_BLOCKS, BLOCK_SIZE, 2)
    table, tokens = [5, 2, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    paged.write(table, tokens, 0, len(tokens), 0)
    assert paged.mismatch(table, tokens, 10, 8) is None
    paged._draft[1, paged.slot(table, 6), 2] = 1.0  # V of position 6's second draft token
    assert paged.mismatch(table, tokens, 10, 6) is None  # not among the positions checked
    assert paged.mismatch(table, tokens, 10, 7) == (
        "position 6: draft KV of 'torn', a cold run (6, 5)")
    paged._target[0, paged.slot(table, 9)] = 0.0
    assert paged.mismatch(table, tokens, 10, 7) == (
        "position 9: target KV of 'torn', a cold run 3")


@st.composite
def stored_blocks(draw: st.DrawFn) -> tuple:
    """A block's header and the tensors a `PagedSymbolicKV` holds for it, maybe corrupted."""
    depth = draw(st.integers(0, 3))
    lookahead = draw(st.integers(0, depth))
    tokens = draw(st.lists(st.integers(0, 49), min_size=BLOCK_SIZE + lookahead,
                           max_size=BLOCK_SIZE + lookahead))
    kv = PagedSymbolicKV(2, BLOCK_SIZE, depth)
    kv.write([1], tokens, 0, BLOCK_SIZE, 0)
    block = BlockDescriptor(b"h" * 32, b"", 0, tuple(tokens[:BLOCK_SIZE]),
                            tuple(tokens[BLOCK_SIZE:]))
    tensors = tuple(cache.storage[:, :, 1].clone() for cache in (kv.target_cache,
                                                                 kv.draft_cache))
    if draw(st.booleans()):
        which = draw(st.integers(0, 1))
        flat = tensors[which].view(-1)
        flat[draw(st.integers(0, flat.numel() - 1))] = draw(st.sampled_from([0.0, 3.0, 2.5]))
    return block, tensors, depth, draw(st.booleans())


@settings(max_examples=300, deadline=None)
@given(stored_blocks())
def test_the_whole_block_check_matches_the_slot_by_slot_reading(case):
    block, tensors, depth, check_draft = case
    got = block_violation(block, tensors, depth, check_draft)
    assert got == _first_violation(block, tensors, depth, check_draft)


def test_a_block_one_slot_off_is_named():
    kv = PagedSymbolicKV(2, BLOCK_SIZE, 1)
    tokens = [7, 8, 9, 10, 11]
    kv.write([1], tokens, 0, BLOCK_SIZE, 0)
    block = BlockDescriptor(b"h" * 32, b"", 0, tuple(tokens[:4]), (11,))
    target, draft = (cache.storage[:, :, 1].clone() for cache in (kv.target_cache,
                                                                  kv.draft_cache))
    assert block_violation(block, (target, draft), 1) is None
    assert block_violation(block, (target, torch.roll(draft, 1, dims=2)), 1) == (
        "position 0: draft KV of (11,), its header says (8,)")
    assert block_violation(block, (torch.roll(target, 1, dims=2), draft), 1) == (
        "position 0: target KV of 10, its header says 7")
