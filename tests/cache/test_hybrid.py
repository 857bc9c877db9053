"""Hybrid models: alignment units, sliding-window and Mamba groups, retention, the tail fix."""

from __future__ import annotations

import random

import pytest

from speckv.bench.retention import run_scenario
from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.retention import RetentionPolicy, TailWidening
from speckv.cache.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec, parse_group_specs
from speckv.engine.request import Request
from speckv.measure.hit_length import measure_hit_length
from speckv.simulation import run_to_completion, toy_core


def build(specs, drafter="none", legacy=False, num_blocks=400, **kwargs):
    mode = resolve_hash_mode(drafter_policy(drafter), disable_lookahead_block_hashes=legacy)
    manager = KVCacheManager(specs, num_blocks, mode, **kwargs)
    return manager, manager.block_hashing("sha256", "0")


def prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(length)]


def test_alignment_unit_is_the_lcm_or_a_valid_configured_unit():
    manager, _ = build([FullAttentionSpec(16), MambaSpec(544)])
    assert (manager.alignment_tokens, manager.hash_block_size) == (544, 16)
    manager, _ = build([FullAttentionSpec(16), SlidingWindowSpec(16, 64)], alignment_tokens=32)
    assert manager.alignment_tokens == 32
    with pytest.raises(ValueError, match="multiple of every group's block size"):
        build([FullAttentionSpec(16), SlidingWindowSpec(32, 64)], alignment_tokens=48)


@pytest.mark.parametrize("interval,message", [
    (-32, "None, 0 or > 0"), (48, "not a multiple of the alignment unit 32"),
])
def test_invalid_retention_is_rejected(interval, message):
    with pytest.raises(ValueError, match=message):
        build([FullAttentionSpec(32), SlidingWindowSpec(16, 64)], retention_interval=interval)


def test_retention_needs_a_partial_group():
    with pytest.raises(ValueError, match="only full attention"):
        build([FullAttentionSpec(16)], retention_interval=0)


@pytest.mark.parametrize("bad", ["full", "swa:64", "mamba:x", "conv:4", "full:0", ""])
def test_bad_group_text(bad):
    with pytest.raises(ValueError):
        parse_group_specs(bad)


def test_user_documents_hybrid_example():
    groups = parse_group_specs("full:16,mamba:544")
    assert measure_hit_length(1367, 16, "none", groups=groups).hit_tokens == 1088
    assert measure_hit_length(1367, 16, "mtp", 1, "legacy", groups=groups).hit_tokens == 544
    assert measure_hit_length(1367, 16, "mtp", 1, "lookahead", groups=groups).hit_tokens == 1088


def _run(manager, hashing, tokens, max_tokens=2, num_spec=0):
    request = Request(f"r{random.random()}", tokens, hashing, max_tokens=max_tokens)
    run_to_completion(toy_core(manager, num_spec), [request])
    manager.check_integrity()
    return request


def _group_hashes(manager, request, group_id):
    """A group's block hashes: every stride-th hash of the request's chain."""
    group = manager.managers[group_id]
    stride = group.block_size // manager.hash_block_size
    return request.get_block_hashes(group.group.lookahead_tokens)[stride - 1::stride]


def _cached_block_indices(manager, request, group_id):
    hashes = _group_hashes(manager, request, group_id)
    return [index for index in range(len(hashes))
            if manager.pool.get_cached_block(hashes[index], group_id) is not None]


@pytest.mark.parametrize("interval,expected", [
    (None, list(range(10))),   # dense: every full block of [0, 41) (tokens beyond are decode)
    (0, [6, 7]),               # the prompt's boundary 32: its 2-block window tail
    (16, [2, 3, 6, 7]),        # checkpoints 16 and 32
])
def test_which_sliding_window_blocks_stay_cached(interval, expected):
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]  # window tail: 2 blocks
    manager, hashing = build(specs, retention_interval=interval, alignment_tokens=16)
    request = _run(manager, hashing, prompt(37), max_tokens=4)
    assert _cached_block_indices(manager, request, 1) == expected
    assert _cached_block_indices(manager, request, 0) == list(range(10))


def test_sliding_window_frees_blocks_behind_the_window_as_null_blocks():
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]
    manager, hashing = build(specs)
    request = Request("a", prompt(30), hashing, max_tokens=8)
    core = toy_core(manager)
    core.scheduler.add_request(request)
    core.step()
    core.step()  # the first step's prefill now lies behind the window
    swa_ids = manager.get_block_ids("a")[1]
    # at the second allocation 30 tokens were computed: position 30 reads keys from 23 on,
    # so blocks 0..4 stand as the null block (id 0)
    assert swa_ids[:5] == [0] * 5 and all(block_id != 0 for block_id in swa_ids[5:])
    assert all(block_id != 0 for block_id in manager.get_block_ids("a")[0])
    manager.check_integrity()


def test_sliding_window_hit_pads_with_null_blocks():
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]
    manager, hashing = build(specs)
    tokens = prompt(30)
    _run(manager, hashing, tokens)
    second = Request("b", tokens, hashing)
    hit = manager.get_computed_blocks(second)
    assert hit.num_computed_tokens == 28
    swa = hit.blocks[1]
    assert len(swa) == 7 and all(block.is_null for block in swa[:5])
    assert not any(block.is_null for block in swa[5:])


def test_mamba_hit_must_land_on_a_cached_checkpoint():
    specs = [FullAttentionSpec(4), MambaSpec(16)]
    manager, hashing = build(specs, retention_interval=0)  # keep only the prompt's boundary
    tokens = prompt(40)
    _run(manager, hashing, tokens)
    # the prompt boundary is 32; a new request sharing only 20 tokens cannot hit at 16
    other = Request("x", tokens[:20] + prompt(20, seed=9), hashing)
    assert manager.get_computed_blocks(other).num_computed_tokens == 0
    assert manager.get_computed_blocks(Request("y", tokens, hashing)).num_computed_tokens == 32


def test_mamba_groups_keep_legacy_hashes_in_lookahead_mode():
    manager, _ = build([FullAttentionSpec(4), MambaSpec(8)], drafter="eagle")
    assert [m.group.lookahead_tokens for m in manager.managers] == [1, 0]
    assert manager.lookahead_values == (0, 1)


def test_legacy_drop_happens_once_with_three_groups():
    """No spiral: after one drop the fixed point may only shorten for the groups' own
    reasons; here every group is valid one unit down, so exactly one unit is lost."""
    specs = [FullAttentionSpec(4), SlidingWindowSpec(8, 12), MambaSpec(16)]
    for legacy, expected in ((False, 48), (True, 32)):
        manager, hashing = build(specs, drafter="eagle", legacy=legacy)
        tokens = prompt(60)
        _run(manager, hashing, tokens, num_spec=2)
        hit = manager.get_computed_blocks(Request("z", tokens, hashing))
        assert hit.num_computed_tokens == expected
        assert [len(blocks) for blocks in hit.blocks] == [expected // 4, expected // 8,
                                                          expected // 16]


def test_retention_scenario_matches_seed_003():
    common = dict(prefix_len=16384, retention=8192, window=1024)
    no_fix = run_scenario("mtp", True, TailWidening.NONE, **common).cached_tokens
    one_block = run_scenario("mtp", True, TailWidening.ONE_BLOCK, **common).cached_tokens
    fixed = run_scenario("mtp", True, TailWidening.UNIT, **common).cached_tokens
    gemma = run_scenario("gemma4_mtp", True, TailWidening.UNIT, **common).cached_tokens
    lookahead = run_scenario("mtp", False, TailWidening.UNIT, **common).cached_tokens
    assert no_fix[1] == 8192 and one_block[1] == 8192  # falls back to the older checkpoint
    assert fixed[1] == 16352
    assert gemma[1] == 16384  # writes no draft KV: never drops
    assert lookahead[1:] == [16352, 16416, 16416]
    assert fixed[2:] == [16384, 16384]  # the drop still costs a unit where lookahead does not


def test_retention_policy_boundaries():
    policy = RetentionPolicy(32, 64)
    assert policy.boundaries(200, 100) == [64, 96, 128, 192]
    assert RetentionPolicy(32, 0).boundaries(200, 100) == [96]
    assert RetentionPolicy(32).boundaries(100, 10) == [32, 64, 96]


def test_a_hole_in_the_window_moves_the_sliding_window_hit_down():
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]  # a hit at h needs 2 blocks
    manager, hashing = build(specs)
    tokens = prompt(30)
    _run(manager, hashing, tokens)
    second = Request("b", tokens, hashing)
    assert manager.get_computed_blocks(second).num_computed_tokens == 28
    # drop the sliding-window block [20, 24): hits at 28 and 24 lose their window
    hashes = _group_hashes(manager, second, 1)
    from speckv.cache.block import make_cache_key

    assert manager.pool.evict_cached_blocks([make_cache_key(hashes[5], 1)]) == 1
    hit = manager.get_computed_blocks(second)
    assert hit.num_computed_tokens == 20
    assert not any(block.is_null for block in hit.blocks[1][3:5])
    manager.check_integrity()


def test_group_text_round_trips():
    from speckv.cache.specs import format_group_specs

    text = "full:16,swa:1024:16,mamba:544"
    assert format_group_specs(parse_group_specs(text)) == text


def test_released_blocks_are_noted_for_a_connector_only_when_asked():
    """A connector saves sliding-window blocks the manager released in this step's
    allocation: the manager notes the cached ones (index, id) until taken or dropped."""
    specs = [FullAttentionSpec(4), SlidingWindowSpec(4, 8)]
    for record in (False, True):
        manager, hashing = build(specs)
        if record:
            manager.record_released_blocks()
        request = Request("a", prompt(30), hashing, max_tokens=8)
        core = toy_core(manager)
        core.scheduler.add_request(request)
        core.step()
        before = list(manager.get_block_ids("a")[1])
        core.step()  # the second allocation releases blocks 0..4 behind the window
        released = manager.take_released_block_ids("a")
        if not record:
            assert released == ()
            continue
        assert released[0] == ()
        assert released[1] == tuple((index, before[index]) for index in range(5))
        assert manager.take_released_block_ids("a") == ()  # taken once
        manager.check_integrity()
