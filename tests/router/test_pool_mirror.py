"""The router's mirror of a vLLM engine's block pool: LRU eviction from the queue head, a
finished request's blocks freed last first (uncached ones to the head), hits taken out of the
queue, corrections from the engine's BlockRemoved events; and, against vLLM's own
`KVCacheManager` (the venv SPECKV_VLLM_VENV names), the same hit on every request of seeded
random interleavings."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from speckv.events.schema import AllBlocksCleared, BlockRemoved, KVEventBatch
from speckv.router.pool_mirror import PoolMirror, PoolShape
from tests.patience import WATCHDOG_S

B = 4  # tokens per block


def removed(*keys: int) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=list(keys), medium=None)])


def test_a_finished_request_is_evicted_tail_block_first_after_the_uncached_ones():
    mirror = PoolMirror(PoolShape(num_blocks=6, block_size=B))  # 5 usable blocks
    mirror.schedule("a", [11, 12], num_prompt_tokens=2 * B + 1, cached_tokens=0)  # 3 blocks
    assert mirror.num_free_blocks == 2
    mirror.finish("a", num_output_tokens=1)
    assert mirror.matched_blocks([11, 12]) == 2
    # two fresh blocks first (the never-used ones, then a's uncached tail), then a's 12
    mirror.schedule("b", [21, 22], num_prompt_tokens=2 * B + 1, cached_tokens=0)
    assert mirror.matched_blocks([11, 12]) == 2
    mirror.schedule("c", [31], num_prompt_tokens=B, cached_tokens=0)
    assert mirror.matched_blocks([11, 12]) == 1  # 12 went before 11: the tail block first
    assert mirror.num_free_blocks == 1


def test_a_hit_block_is_out_of_the_queue_while_its_request_runs():
    mirror = PoolMirror(PoolShape(num_blocks=5, block_size=B))  # 4 usable
    mirror.schedule("a", [11], num_prompt_tokens=B, cached_tokens=0)
    mirror.finish("a", num_output_tokens=1)
    mirror.schedule("b", [11, 12], num_prompt_tokens=2 * B + 1, cached_tokens=B)
    mirror.schedule("c", [31], num_prompt_tokens=B, cached_tokens=0)  # takes the last free
    assert mirror.matched_blocks([11, 12]) == 2  # 11 is held by b, not evictable
    assert mirror.num_free_blocks == 0


def test_an_eviction_the_mirror_did_not_predict_takes_the_place_of_the_one_it_did():
    mirror = PoolMirror(PoolShape(num_blocks=4, block_size=B))  # 3 usable
    for name, key in (("a", 11), ("b", 12), ("c", 13)):
        mirror.schedule(name, [key], num_prompt_tokens=B, cached_tokens=0)
    for name in "abc":
        mirror.finish(name, num_output_tokens=1)
    mirror.schedule("d", [14], num_prompt_tokens=B, cached_tokens=0)  # evicts 11 here
    assert mirror.matched_blocks([11]) == 0
    mirror.apply_batch(removed(12))  # the engine evicted 12 instead
    assert mirror.matched_blocks([11]) == 1 and mirror.matched_blocks([12]) == 0
    assert mirror.corrections == 1
    mirror.apply_batch(removed(14))  # held by d: dropped, nothing to swap in
    assert mirror.matched_blocks([14]) == 0 and mirror.corrections == 2
    mirror.apply_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert mirror.matched_blocks([11]) == mirror.matched_blocks([13]) == 0


def test_the_engines_clear_after_a_reset_through_the_router_keeps_what_was_routed_since():
    mirror = PoolMirror(PoolShape(num_blocks=8, block_size=B))
    mirror.schedule("a", [11], num_prompt_tokens=B, cached_tokens=0)
    mirror.clear(event_to_come=True)  # the router reset the engine
    assert mirror.matched_blocks([11]) == 0
    mirror.schedule("b", [21], num_prompt_tokens=B, cached_tokens=0)
    cleared = KVEventBatch(ts=0.0, events=[AllBlocksCleared()])
    mirror.apply_batch(cleared)  # the engine's event of that reset, after b was routed
    assert mirror.matched_blocks([21]) == 1
    mirror.apply_batch(cleared)  # a reset not through the router
    assert mirror.matched_blocks([21]) == 0


def test_an_eviction_stays_known_until_the_engine_confirms_it():
    mirror = PoolMirror(PoolShape(num_blocks=3, block_size=B))  # 2 usable
    mirror.schedule("a", [11], num_prompt_tokens=B, cached_tokens=0)
    mirror.finish("a", num_output_tokens=1)
    mirror.schedule("b", [21, 22], num_prompt_tokens=2 * B, cached_tokens=0)
    assert mirror.evicted(11)
    mirror.apply_batch(removed(11))
    assert not mirror.evicted(11) and mirror.corrections == 0


def test_a_hit_on_blocks_only_the_events_show_allocates_as_the_engine_does():
    mirror = PoolMirror(PoolShape(num_blocks=6, block_size=B))  # 5 usable
    published = {11, 12}.__contains__  # stored before the router started
    assert mirror.matched_blocks([11, 12, 13]) == 0
    assert mirror.matched_blocks([11, 12, 13], published) == 2
    mirror.schedule("a", [11, 12, 13], num_prompt_tokens=3 * B + 1, cached_tokens=2 * B)
    assert mirror.num_free_blocks == 5 - 2  # 13's block and the partial one, not 4
    assert mirror.matched_blocks([11, 12, 13], published) == 3  # 13 at its own block
    mirror.finish("a", num_output_tokens=1)
    assert mirror.num_free_blocks == 5


def test_a_predicted_eviction_confirmed_by_the_engine_is_no_correction():
    mirror = PoolMirror(PoolShape(num_blocks=3, block_size=B))
    mirror.schedule("a", [11], num_prompt_tokens=B, cached_tokens=0)
    mirror.finish("a", num_output_tokens=1)
    mirror.schedule("b", [12, 13], num_prompt_tokens=2 * B, cached_tokens=0)
    mirror.apply_batch(removed(11))
    assert mirror.corrections == 0 and mirror.matched_blocks([12, 13]) == 2


def test_a_failed_request_leaves_no_hash_the_engine_never_stored():
    mirror = PoolMirror(PoolShape(num_blocks=8, block_size=B))
    mirror.schedule("a", [11, 12], num_prompt_tokens=2 * B, cached_tokens=0)
    mirror.finish("a", None, confirmed=lambda key: key == 11)
    assert mirror.matched_blocks([11, 12]) == 1
    mirror.schedule("b", [11, 12], num_prompt_tokens=2 * B, cached_tokens=B)
    mirror.finish("b", 3)
    assert mirror.matched_blocks([11, 12]) == 2


def test_decoded_blocks_are_cached_under_keys_no_prompt_has():
    mirror = PoolMirror(PoolShape(num_blocks=6, block_size=B, lookahead_slots=1))
    mirror.schedule("a", [11], num_prompt_tokens=B + 2, cached_tokens=0)  # 2 blocks
    mirror.finish("a", num_output_tokens=2 * B)  # 14 tokens (+1 slot): 4 blocks, 3 full
    assert mirror.num_free_blocks == 5
    # the uncached last block went to the head, the two decoded ones to the tail before
    # the prompt's block (freed last to first); 3 tokens + 1 slot: one block each
    for name in "bcd":
        mirror.schedule(name, [], num_prompt_tokens=B - 1, cached_tokens=0)
    assert mirror.matched_blocks([11]) == 1  # the uncached, the never-used, a decoded one
    mirror.schedule("e", [], num_prompt_tokens=B - 1, cached_tokens=0)
    assert mirror.matched_blocks([11]) == 1  # the other decoded one
    mirror.schedule("f", [], num_prompt_tokens=B - 1, cached_tokens=0)
    assert mirror.matched_blocks([11]) == 0


def test_a_divergent_block_copied_for_a_hit_is_refreshed_not_held():
    mirror = PoolMirror(PoolShape(num_blocks=8, block_size=B))  # 7 usable
    mirror.schedule("a", [11, 12], num_prompt_tokens=2 * B, cached_tokens=0)
    mirror.schedule("x", [21], num_prompt_tokens=B, cached_tokens=0)
    mirror.finish("a", num_output_tokens=1)  # 12 then 11 to the tail
    mirror.finish("x", num_output_tokens=1)  # then 21
    # a prompt after 11 whose next block is 12's under another successor (L = 1): 11 hit,
    # 12 copied into a block of b's own (B - 1 tokens reused), 12 moved to the tail
    mirror.schedule("b", [11, 13], num_prompt_tokens=2 * B + 1, cached_tokens=2 * B - 1,
                    divergent_source=12)
    assert mirror.num_free_blocks == 7 - 3  # b holds 11 and 2 new blocks; 12 is free again
    mirror.schedule("c", [31, 32], num_prompt_tokens=2 * B, cached_tokens=0)  # never used
    assert mirror.matched_blocks([21]) == 1 and mirror.matched_blocks([11, 12]) == 2
    mirror.schedule("d", [41], num_prompt_tokens=B, cached_tokens=0)  # 21: 12 is behind it
    assert mirror.matched_blocks([21]) == 0 and mirror.matched_blocks([11, 12]) == 2


def test_a_prompt_block_hashed_only_once_output_follows_is_freed_as_cached():
    # lookahead hashes (L = 1): a prompt's last full block has no hash until its successor,
    # the first output token, exists; the engine caches it by the end, so it is freed to the
    # tail like any cached block, not to the head
    mirror = PoolMirror(PoolShape(num_blocks=5, block_size=B))  # 4 usable
    mirror.schedule("a", [11], num_prompt_tokens=2 * B, cached_tokens=0)  # 2 blocks, 1 key
    mirror.finish("a", num_output_tokens=1)
    mirror.schedule("b", [], num_prompt_tokens=2 * B, cached_tokens=0)  # the 2 never used
    mirror.schedule("c", [], num_prompt_tokens=B, cached_tokens=0)
    assert mirror.matched_blocks([11]) == 1  # c took a's unknown-keyed last block first


def test_the_shape_is_validated():
    with pytest.raises(ValueError, match="num_blocks >= 2"):
        PoolShape(num_blocks=1, block_size=B)


VENV = os.environ.get("SPECKV_VLLM_VENV")


@pytest.mark.vllm
@pytest.mark.skipif(not VENV or not (Path(VENV) / "bin" / "python").is_file(),
                    reason="set SPECKV_VLLM_VENV to a venv with vLLM 0.32 (CPU)")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mirror_predicts_vllms_own_pool_on_random_interleavings(seed):
    driver = Path(__file__).with_name("vllm_pool_driver.py")
    env = {**os.environ, "SPECKV_VLLM_PLUGIN": "0"}
    result = subprocess.run([str(Path(VENV) / "bin" / "python"), str(driver), str(seed)],
                            capture_output=True, text=True, env=env, timeout=WATCHDOG_S,
                            cwd=Path(__file__).parents[2])
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["scheduled"] > 100
    assert report["mismatches"] == [] and report["corrections"] == 0
