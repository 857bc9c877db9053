"""Divergent block reuse in the cache manager: which block a hit copies, when it may, and who
holds what (the pool's ref counts, checked after every call)."""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager, MambaSpec, SlidingWindowSpec
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode

B = 4


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(length)]


def _compute(world, prompt, step_done: bool = True):
    """Prefill `prompt` as one request, sample one token, finish; then (optionally) end the
    step as the scheduler does."""
    request = world.request(prompt)
    hit = world.manager.get_computed_blocks(request)
    allocation = world.manager.allocate_slots(
        request, request.num_tokens - hit.num_computed_tokens, hit)
    assert allocation is not None
    request.num_computed_tokens = request.num_tokens
    request.append_output_token_ids([1])
    world.manager.finish(request)
    if step_done:
        world.manager.step_executed()
    world.manager.check_integrity()
    return request, hit, allocation


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
@pytest.mark.parametrize("modules", [1, 3])
def test_a_sibling_copies_the_block_and_recomputes_its_last_l_positions(
        world_factory, algo, modules):
    world = world_factory(block_size=B, drafter="mtp", num_modules=modules, algo=algo)
    shared = _prompt(3 * B)
    first, _, _ = _compute(world, shared + [11, 12, 13, 14])
    sibling = world.request(shared + [21, 22, 23, 24])
    hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == 3 * B - modules
    assert len(hit.blocks[0]) == 2
    (source,) = hit.copy_sources
    assert source.block_hash == first.get_block_hashes(modules)[2]
    allocation = world.manager.allocate_slots(sibling, sibling.num_tokens - 3 * B + modules, hit)
    (copy,) = allocation.copies
    own = world.manager.get_block_ids(sibling.request_id)[0]
    assert (copy.src_block_id, copy.dst_block_id) == (source.block_id, own[2])
    assert source.ref_cnt == 1  # held for the runner's copy
    world.manager.check_integrity()
    world.manager.step_executed()
    assert source.ref_cnt == 0
    world.manager.check_integrity()
    # the copy is cached under the sibling's own hash: a third request with its successors
    # hits it as a whole block
    sibling.num_computed_tokens = sibling.num_tokens
    sibling.append_output_token_ids([1])
    world.manager.finish(sibling)
    world.manager.step_executed()
    third = world.request(shared + [21, 22, 23, 24, 25])
    third_hit = world.manager.get_computed_blocks(third)
    assert third_hit.num_computed_tokens >= 3 * B
    assert third_hit.blocks[0][2].block_id == own[2]


def test_blocks_cached_this_step_are_not_copied(world_factory):
    """A copy reads its source before the step's forward: a block computed in the same step
    cannot be one."""
    world = world_factory(block_size=B)
    shared = _prompt(2 * B)
    _compute(world, shared + [11, 12], step_done=False)
    sibling = world.request(shared + [21, 22])
    hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == B and hit.copy_next_step
    world.manager.step_executed()
    hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == 2 * B - 1 and not hit.copy_next_step


def test_a_hash_cached_again_this_step_is_not_a_copy_source(world_factory):
    """The index names a hash; evicted and computed again in this step, it names a block
    whose KV is not written yet (found by `speckv bench soak`)."""
    from speckv.cache.block import make_cache_key

    world = world_factory(block_size=B)
    shared = _prompt(2 * B)
    first, _, _ = _compute(world, shared + [11, 12])
    evicted = first.get_block_hashes(1)[1]
    assert world.manager.pool.evict_cached_blocks([make_cache_key(evicted, 0)]) == 1
    # one step: a request computes the same block again, a sibling diverges after it
    again = world.request(shared + [11, 12])
    hit = world.manager.get_computed_blocks(again)
    assert hit.num_computed_tokens == B
    world.manager.allocate_slots(again, again.num_tokens - B, hit)
    assert world.manager.pool.get_cached_block(evicted, 0) is not None  # a new block
    sibling = world.request(shared + [21, 22])
    hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == B and not hit.copy_sources and hit.copy_next_step
    world.manager.check_integrity()


def test_a_sibling_arriving_with_its_source_waits_one_step_for_the_copy(world_factory):
    from speckv.simulation import SymbolicKV, run_to_completion, toy_core

    world = world_factory(block_size=B)
    core = toy_core(world.manager, 2, vocab_size=50, kv=SymbolicKV(64, B, 1))
    shared = _prompt(3 * B)
    first, sibling = world.request(shared + [1, 2, 3]), world.request(shared + [4, 5, 6])
    run_to_completion(core, [first, sibling])
    assert (first.num_cached_tokens, sibling.num_cached_tokens) == (0, 3 * B - 1)
    assert core.runner.num_block_copies == 1  # and the toy runner checked its KV
    world.manager.check_integrity()


@pytest.mark.parametrize("same_step", [False, True])
def test_a_sibling_finds_its_block_behind_a_later_block_holding_other_tokens(
        world_factory, same_step):
    """Three requests after one chain: a's block 2, then b's (the same first token, so the
    same parent hash, then other tokens), then c with a's tokens under another successor.
    The block cached last after that chain is b's; c must still find a's (cached, or computed
    in this step: then it copies it next step)."""
    world = world_factory(block_size=B)
    shared, tokens = _prompt(2 * B), _prompt(B, 1)
    first, _, _ = _compute(world, shared + tokens + [11, 12], step_done=not same_step)
    _compute(world, shared + tokens[:1] + _prompt(B - 1, 2) + [13, 14],
             step_done=not same_step)
    sibling = world.request(shared + tokens + [21, 22])
    hit = world.manager.get_computed_blocks(sibling)
    if same_step:
        assert hit.num_computed_tokens == 2 * B and hit.copy_next_step
        world.manager.step_executed()
        hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == 3 * B - 1 and not hit.copy_next_step
    (source,) = hit.copy_sources
    assert source.block_hash == first.get_block_hashes(1)[2]


def test_a_first_block_is_found_behind_a_later_first_block(world_factory):
    """The same at a chain's first block: b's first block (other tokens) was cached after
    a's; c shares a's and diverges right after it."""
    world = world_factory(block_size=B)
    tokens = _prompt(B, 1)
    first, _, _ = _compute(world, tokens + [11, 12])
    _compute(world, _prompt(B, 2) + [13, 14])
    hit = world.manager.get_computed_blocks(world.request(tokens + [21, 22]))
    assert hit.num_computed_tokens == B - 1
    assert hit.copy_sources[0].block_hash == first.get_block_hashes(1)[0]


def test_no_copy_when_the_block_differs_or_was_evicted(world_factory):
    world = world_factory(block_size=B, num_blocks=8)
    shared = _prompt(2 * B)
    _compute(world, shared + [11, 12])
    # the last shared block differs in its last token: nothing to copy
    other = world.request(shared[:-1] + [99, 21, 22])
    assert world.manager.get_computed_blocks(other).num_computed_tokens == B
    # evict everything: the successor index still names the block, the hash map does not
    for seed in range(1, 4):
        _compute(world, _prompt(5 * B, seed))
    sibling = world.request(shared + [21, 22])
    hit = world.manager.get_computed_blocks(sibling)
    assert hit.num_computed_tokens == 0 and not hit.copy_sources


def test_a_free_before_the_step_ends_releases_the_source(world_factory):
    world = world_factory(block_size=B)
    shared = _prompt(2 * B)
    _compute(world, shared + [11, 12])
    sibling = world.request(shared + [21, 22])
    hit = world.manager.get_computed_blocks(sibling)
    world.manager.allocate_slots(sibling, sibling.num_tokens - hit.num_computed_tokens, hit)
    assert hit.copy_sources[0].ref_cnt == 1
    world.manager.free(sibling)  # e.g. aborted
    assert hit.copy_sources[0].ref_cnt == 0
    world.manager.check_integrity()
    world.manager.step_executed()
    world.manager.check_integrity()


def test_the_successor_index_stays_bounded(world_factory):
    world = world_factory(block_size=B, num_blocks=16)
    pool = world.manager.pool
    first_block = _prompt(B + 1)  # and its successor
    for seed in range(60):  # each lookup hits the first block and folds the runs noted
        _compute(world, first_block + _prompt(3 * B, seed))
        assert pool._num_run_blocks <= 2 * pool.num_blocks
        for index in pool._by_content.values():
            assert len(index) <= 2 * pool.num_blocks + 4 * B
    assert pool._by_content, "the lookups past the first block read the index"


@pytest.mark.parametrize("specs,reason", [
    ([FullAttentionSpec(B), SlidingWindowSpec(B, 2 * B)], "sliding window"),
    ([FullAttentionSpec(B), MambaSpec(2 * B)], "mamba"),
    ([FullAttentionSpec(1)], "B <= L"),
])
def test_reuse_is_off_where_it_does_not_apply(specs, reason):
    mode = resolve_hash_mode(drafter_policy("eagle"))
    assert mode.reuses_divergent_blocks
    assert not KVCacheManager(specs, 32, mode).reuses_divergent_blocks, reason
    legacy = resolve_hash_mode(drafter_policy("eagle"), disable_lookahead_block_hashes=True)
    assert not KVCacheManager([FullAttentionSpec(B)], 32, legacy).reuses_divergent_blocks
    off = resolve_hash_mode(drafter_policy("eagle"), reuse_divergent_blocks=False)
    assert not KVCacheManager([FullAttentionSpec(B)], 32, off).reuses_divergent_blocks


def test_a_scheduler_with_a_connector_refuses_reuse(world_factory):
    from speckv.engine.scheduler import Scheduler

    world = world_factory(block_size=B)
    with pytest.raises(ValueError, match="KV connector"):
        Scheduler(world.manager, 64, 4, 0, connector=object())  # type: ignore[arg-type]
