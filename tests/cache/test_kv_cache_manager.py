"""KV cache manager (one full-attention group): hit lengths, lookahead misses, allocation,
finish-time caching, preemption, verification of fast hashes."""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import DRAFTER_NAMES
from speckv.cache.events import BlockStored
from speckv.cache.hash_mode import HashMode
from speckv.engine.request import Request
from speckv.measure.hit_length import expected_hit_tokens, measure_hit_length
from speckv.simulation import HitMismatch, SymbolicKV, run_to_completion, toy_core


def _prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(length)]


DRAFTERS = [(name, 1) for name in DRAFTER_NAMES if name != "mtp"] + [("mtp", 1), ("mtp", 2),
                                                                       ("mtp", 4)]


@pytest.mark.parametrize("drafter,modules", DRAFTERS)
@pytest.mark.parametrize("mode", ["lookahead", "lookahead-no-reuse", "legacy"])
@pytest.mark.parametrize("prompt_len", [1, 3, 4, 5, 8, 9, 10, 12, 13, 31])
@pytest.mark.parametrize("diverge", [False, True])
def test_hit_length_table(drafter, modules, mode, prompt_len, diverge):
    result = measure_hit_length(prompt_len, 4, drafter, modules, mode, diverge=diverge)
    assert result.hit_tokens == result.expected_tokens


@pytest.mark.parametrize("prompt_len,block_size,expected", [
    # (N, B): lookahead hits floor((N - 1) / B) * B, legacy drop one block less
    (17, 16, (16, 0)), (32, 16, (16, 0)), (33, 16, (32, 16)), (1367, 544, (1088, 544)),
    (16, 16, (0, 0)), (2, 1, (1, 0)),
])
def test_eagle_hits_match_no_spec_decode(prompt_len, block_size, expected):
    lookahead = measure_hit_length(prompt_len, block_size, "eagle", mode="lookahead")
    legacy = measure_hit_length(prompt_len, block_size, "eagle", mode="legacy")
    no_spec = measure_hit_length(prompt_len, block_size, "none")
    assert (lookahead.hit_tokens, legacy.hit_tokens) == expected
    assert lookahead.hit_tokens == no_spec.hit_tokens


@pytest.mark.parametrize("modules", [2, 3, 4])
def test_k_module_mtp_needs_k_tokens_after_each_block(modules):
    for prompt_len in range(1, 30):
        result = measure_hit_length(prompt_len, 4, "mtp", modules, "lookahead-no-reuse")
        assert result.hit_tokens == max(0, (prompt_len - modules) // 4 * 4)


@pytest.mark.parametrize("drafter,modules", [("eagle", 1), ("mtp", 2), ("mtp", 3)])
@pytest.mark.parametrize("diverge", [False, True])
def test_block_reuse_hits_no_spec_minus_at_most_l_tokens(drafter, modules, diverge):
    # blocks of 8 > L: the block after the lookahead hit is copied, its last L positions
    # recomputed, wherever the no-speculation hit is longer
    for prompt_len in range(1, 40):
        no_spec = measure_hit_length(prompt_len, 8, "none", diverge=diverge).hit_tokens
        reuse = measure_hit_length(prompt_len, 8, drafter, modules, "lookahead",
                                   diverge=diverge).hit_tokens
        plain = measure_hit_length(prompt_len, 8, drafter, modules, "lookahead-no-reuse",
                                   diverge=diverge).hit_tokens
        assert no_spec - modules <= reuse <= no_spec
        assert reuse == (no_spec if plain == no_spec else no_spec - modules)
        if diverge and prompt_len % 8 == 0:  # diverging right at a boundary
            assert plain == no_spec - 8 and reuse == no_spec - modules


def test_expected_formula_never_negative():
    assert expected_hit_tokens(3, 4, HashMode.legacy_drop()) == 0


@pytest.mark.parametrize("reuse", [False, True])
def test_block_cached_with_another_lookahead_token_is_a_miss(world_factory, reuse):
    world = world_factory(block_size=4, reuse=reuse)
    shared = _prompt(8)
    first = world.request(shared + [111, 5, 6])  # block [4, 8) followed by 111
    run_to_completion(toy_core(world.manager, 2), [first])
    # Same 8 tokens, different token after block 1: block 1's draft KV would differ.
    second = world.request(shared + [222, 5, 6])
    hit = world.manager.get_computed_blocks(second)
    # its hash misses; with reuse the block is copied and only its last position recomputed
    assert hit.num_computed_tokens == (7 if reuse else 4)
    assert [block.block_hash for block in hit.copy_sources] == (
        [first.get_block_hashes(1)[1]] if reuse else [])
    third = world.request(shared + [111, 9, 9])
    assert world.manager.get_computed_blocks(third).num_computed_tokens == 8
    world.manager.check_integrity()


def test_legacy_hashes_ignore_the_successor_token(world_factory):
    world = world_factory(block_size=4, legacy=True)
    shared = _prompt(8)
    run_to_completion(toy_core(world.manager, 2), [world.request(shared + [111, 5, 6])])
    second = world.request(shared + [222, 5, 6])
    # blocks 0 and 1 match by hash; the drop gives back block 1
    assert world.manager.get_computed_blocks(second).num_computed_tokens == 4


def test_allocation_failure_leaves_no_trace(world_factory):
    world = world_factory(block_size=4, num_blocks=6)  # 5 usable blocks
    prompt = _prompt(9)
    run_to_completion(toy_core(world.manager), [world.request(prompt, max_tokens=2)])
    free_before = world.manager.get_num_free_blocks()
    cached_before = dict(world.manager.pool.cached_blocks)
    big = world.request(prompt + _prompt(30, seed=1))
    hit = world.manager.get_computed_blocks(big)
    assert hit.num_computed_tokens == 8
    assert world.manager.allocate_slots(big, big.num_tokens - 8, hit) is None
    assert world.manager.get_num_free_blocks() == free_before
    assert world.manager.pool.cached_blocks == cached_before
    assert all(block.ref_cnt == 0 for block in hit.blocks[0])
    assert world.manager.get_block_ids(big.request_id) == ([],)
    world.manager.check_integrity()


def test_finish_caches_the_block_the_last_token_completed(world_factory):
    world = world_factory(block_size=4, events=True)
    prompt = _prompt(7)
    request = world.request(prompt, max_tokens=2)
    manager = world.manager
    manager.allocate_slots(request, 7)
    request.num_computed_tokens = 7
    request.append_output_token_ids([50])  # token 7 fills block [4, 8); its hash waits for token 8
    manager.allocate_slots(request, 1)
    request.num_computed_tokens = 8
    request.append_output_token_ids([51])  # token 8 is the lookahead of block [4, 8)
    assert len(request.get_block_hashes(1)) == 2
    assert manager.managers[0].num_cached_blocks[request.request_id] == 1
    manager.finish(request)
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [1, 1]
    assert stored[1].lookahead_token_ids == [[51]]
    assert stored[1].token_ids == [*prompt[4:7], 50]
    again = world.request([*prompt, 50, 51, 52])
    assert manager.get_computed_blocks(again).num_computed_tokens == 8
    manager.check_integrity()


def test_drafts_are_never_cached(world_factory):
    world = world_factory(block_size=4)
    manager = world.manager
    request = world.request(_prompt(5))
    manager.allocate_slots(request, 5)
    request.num_computed_tokens = 5
    request.append_output_token_ids([9])
    request.spec_token_ids = [1, 2, 3]  # drafts would fill block [4, 8) and more
    manager.allocate_slots(request, 1 + 3, num_draft_slots=3)
    request.num_computed_tokens += 4
    assert manager.managers[0].num_cached_blocks[request.request_id] == 1
    request.apply_verification(3, [1, 7])  # draft 1 accepted, bonus 7
    assert request.all_token_ids[-2:] == [1, 7]
    assert request.num_computed_tokens == 7
    manager.check_integrity()


def test_fast_hash_hits_are_verified_by_content(world_factory, monkeypatch):
    world = world_factory(block_size=4, algo="xxhash")
    prompt = _prompt(9)
    run_to_completion(toy_core(world.manager, 2), [world.request(prompt)])
    assert world.manager.get_computed_blocks(world.request(prompt)).num_computed_tokens == 8
    # Forge a collision: a different request claims the same hashes.
    other = world.request(_prompt(9, seed=5))
    forged = world.request(prompt).get_block_hashes(1)
    monkeypatch.setattr(other, "get_block_hashes", lambda lookahead: forged)
    assert world.manager.get_computed_blocks(other).num_computed_tokens == 0


def test_reset_prefix_cache_forgets_hits(world_factory):
    world = world_factory(block_size=4)
    prompt = _prompt(9)
    run_to_completion(toy_core(world.manager), [world.request(prompt)])
    assert world.manager.reset_prefix_cache()
    assert world.manager.get_computed_blocks(world.request(prompt)).num_computed_tokens == 0
    world.manager.check_integrity()


@pytest.mark.parametrize("hash_mode,stale", [(HashMode.for_lookahead(1), False),
                                             (HashMode.for_lookahead(0), True)])
def test_symbolic_draft_kv_of_a_hit_matches_a_cold_run(hash_mode, stale):
    """Lookahead hashes: the hit's draft KV is what a cold run writes (the toy runner checks
    every hit slot). Negative control: legacy hashes with the drop turned off serve a last
    block whose draft KV came from another successor token."""
    manager = KVCacheManager([FullAttentionSpec(4)], 32, hash_mode)
    hashing = manager.block_hashing("sha256", "0")
    core = toy_core(manager, 2, kv=SymbolicKV(32, 4, draft_depth=1))
    shared = _prompt(8)
    run_to_completion(core, [Request("a", shared + [7, 7, 7], hashing, max_tokens=4)])
    second = Request("b", shared + [9, 9, 9], hashing, max_tokens=4)
    assert manager.get_computed_blocks(second).num_computed_tokens == (8 if stale else 4)
    if stale:
        with pytest.raises(HitMismatch, match="draft KV"):
            run_to_completion(core, [second])
    else:
        run_to_completion(core, [second])
        assert core.runner.num_hits_checked == 4


def test_external_tokens_are_allocated_but_cached_only_by_the_next_allocation(world_factory):
    """A connector's external range counts as computed, but no hash names it until the load
    had its step: a failed load must never leave a hash naming garbage."""
    world = world_factory(block_size=4, num_blocks=32)
    manager = world.manager
    request = world.request(_prompt(22, seed=3))
    allocation = manager.allocate_slots(request, 2, None, 0, num_external_tokens=20)
    assert allocation is not None and len(allocation.new_block_ids[0]) == 6
    request.num_computed_tokens = 22
    probe = world.request(_prompt(22, seed=3))
    assert manager.get_computed_blocks(probe).num_computed_tokens == 0  # nothing cached yet
    # the next step: the external range (and what the step computed) is cached
    assert manager.allocate_slots(request, 0, None, 1) is not None
    assert manager.get_computed_blocks(probe).num_computed_tokens == 20
    manager.check_integrity()


def test_a_rolled_back_external_range_is_never_cached(world_factory):
    world = world_factory(block_size=4, num_blocks=32)
    manager = world.manager
    request = world.request(_prompt(22, seed=4))
    assert manager.allocate_slots(request, 2, None, 0, num_external_tokens=20) is not None
    request.num_computed_tokens = 8  # the load failed at token 8: blocks 2-4 hold garbage
    manager.finish(request)
    probe = world.request(_prompt(22, seed=4))
    assert manager.get_computed_blocks(probe).num_computed_tokens == 8
    with pytest.raises(ValueError, match="num_external_tokens"):
        manager.allocate_slots(probe, 1, None, 0, num_external_tokens=-4)
    manager.check_integrity()
