"""The CPU tier through the connector interface, on real paged caches (target + drafter)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from speckv.cache.events import BlockRemoved, BlockStored
from speckv.connectors import (
    MEDIUM_CPU,
    ConnectorMetadata,
    NoLookaheadOffloadConnector,
    OffloadConnector,
    RequestBlocks,
)
from speckv.connectors.rules import describe_block
from speckv.connectors.store import PutOutcome
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    DEVICES,
    Driver,
    KVWorld,
    Req,
    bit_equal,
    store_request,
    tier_gib,
)
from tests.patience import WATCHDOG_S

B = BLOCK_SIZE


def _driver(world, blocks=64, lookahead=1, drop=False, connector_type=OffloadConnector, **kw):
    return Driver(connector_type(tier_gib(world, blocks), **kw), world, lookahead, drop)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_bit_exact_for_target_and_draft(dtype, device):
    world = KVWorld(dtype=dtype, device=device)
    driver = _driver(world)
    prompt = list(range(100, 100 + 4 * B + 1))  # 4 whole blocks + 1 token
    _, first_ids, cold = store_request(driver, prompt)
    world.free(first_ids)

    again = Req(prompt)
    hit, ids = driver.admit(again)
    assert hit == 4 * B  # floor((N - 1) / B) blocks, nothing dropped
    world.zero(ids)
    _, output = driver.step([RequestBlocks(again, ids, 0)])
    assert output.finished_loads == {again.request_id} and not output.load_failures
    assert bit_equal(world.blocks(ids[:4]), cold[:4])
    stats = driver.connector.stats()["offload"]
    assert stats.loaded_blocks == 4 and stats.saved_blocks == 4 and stats.medium == MEDIUM_CPU
    driver.close()


@pytest.mark.parametrize(("lookahead", "drop", "expected_blocks"), [
    (1, False, 5),  # EAGLE-style with lookahead hashes: floor((N - 1) / B), as no spec decode
    (0, True, 4),   # legacy hashes + drop: one block less, as the local cache
    (2, False, 4),  # MTP k=2: floor((N - 2) / B)
])
def test_hit_length_follows_the_hash_mode(lookahead, drop, expected_blocks):
    world = KVWorld()
    driver = _driver(world, lookahead=lookahead, drop=drop)
    prompt = list(range(5 * B + 1))
    store_request(driver, prompt + [7, 8], written=len(prompt) + 1)
    hit, _ = driver.admit(Req(prompt))  # N = 5B + 1
    assert hit == expected_blocks * B
    driver.close()


def test_mtp_k2_hit_needs_two_tokens_after_the_block():
    world = KVWorld()
    driver = _driver(world, lookahead=2)
    prompt = list(range(4 * B + 1))
    store_request(driver, prompt + [1, 2], written=4 * B + 2)
    # N = 4B + 1: block 3 ends at 4B, its lookahead needs tokens 4B and 4B + 1 (missing)
    hit, _ = driver.admit(Req(prompt))
    assert hit == 3 * B
    driver.close()


def test_a_stale_successor_is_never_served():
    world = KVWorld()
    driver = _driver(world)
    shared = list(range(3 * B))
    store_request(driver, shared + [111, 5, 6])  # block 2's successor is 111
    other = Req(shared + [222, 5, 6])  # same three blocks, another successor
    hit, _ = driver.admit(other)
    assert hit == 2 * B  # block 2 misses: its lookahead hash names 111, not 222
    driver.close()


def test_a_block_under_the_right_key_with_the_wrong_content_fails_the_load():
    """What a collision of a fast non-cryptographic hash would look like: the header check
    refuses the block and the load reports it failed; it never reaches the caches."""
    world = KVWorld()
    driver = _driver(world)
    probe = Req(list(range(2 * B + 1)))
    impostor = Req([9] * (2 * B + 1))
    wanted = describe_block(probe, probe.get_block_hashes(1), 0, driver.mode)
    other = describe_block(impostor, impostor.get_block_hashes(1), 0, driver.mode)
    forged = replace(other, block_hash=wanted.block_hash)  # same key, other content
    cold = tuple(torch.randn(s.block_shape) for s in driver.connector.store.layout.segments)
    assert driver.connector.store.put(forged, cold).outcome is PutOutcome.STORED
    hit, ids = driver.admit(probe)
    assert hit == B
    world.zero(ids)
    _, output = driver.step()
    (failure,) = output.load_failures
    assert failure.first_failed_token == 0 and failure.block_ids == (ids[0],)
    assert "block_mismatch" in failure.reason
    assert torch.count_nonzero(world.target.storage[:, :, ids[0]]) == 0
    driver.close()


def test_a_request_that_comes_straight_back_hits_its_unflushed_saves():
    """Saves listed at finish are snapshotted at the start of the next worker phase, before
    loads: even a freed block handed to the returning request in the same step is read
    intact first."""
    world = KVWorld()
    driver = _driver(world)
    prompt = list(range(3 * B + 1))
    first = Req(prompt)
    _, ids = driver.admit(first)
    world.write_cold_kv(ids)
    cold = world.blocks(ids)
    driver.step([RequestBlocks(first, ids, 0)])  # nothing written yet: no saves
    first.append([42])
    driver.finish(first, ids, 3 * B + 1)  # lists blocks 0..2 for the next step
    world.free(ids)

    again = Req(prompt)
    reused = world.allocate(4)
    assert sorted(reused) == sorted(ids)
    # the freed blocks come back in another order: block 0 is loaded into the block that
    # held block 2, which is itself still to be saved in this step
    again_ids = [ids[2], ids[1], ids[0], ids[3]]
    hit, _ = driver.admit(again, block_ids=again_ids)
    assert hit == 3 * B
    _, output = driver.step([RequestBlocks(again, again_ids, 0)])
    assert not output.load_failures
    assert bit_equal(world.blocks(again_ids[:3]), [cold[i] for i in range(3)])
    driver.close()


def test_the_block_the_last_token_completed_is_stored_at_finish():
    world = KVWorld()
    driver = _driver(world)
    request = Req(list(range(2 * B)))  # N = 2B: block 1 has no successor yet
    _, ids = driver.admit(request)
    world.write_cold_kv(ids)
    meta, _ = driver.step([RequestBlocks(request, ids, 0)])
    assert meta.saves == ()
    request.append([77])  # the sampled token completes block 1's lookahead
    meta, _ = driver.step([RequestBlocks(request, ids, 2 * B)])
    assert [len(save.blocks) for save in meta.saves] == [2]
    request.append([78])
    driver.finish(request, ids, 2 * B + 1)
    assert driver.connector.flush(timeout_s=WATCHDOG_S)
    stats = driver.connector.stats()["offload"]
    assert stats.saved_blocks == 2
    driver.close()


def test_legacy_drop_never_stores_a_block_without_its_successor():
    world = KVWorld()
    driver = _driver(world, lookahead=0, drop=True)
    request = Req(list(range(3 * B)))  # block 2 is hashed (legacy) but has no successor
    _, ids = driver.admit(request)
    world.write_cold_kv(ids)
    meta, _ = driver.step([RequestBlocks(request, ids, 0)])  # the prefill step
    assert meta.saves == ()
    meta, _ = driver.step([RequestBlocks(request, ids, 3 * B)])
    assert [block.token_ids[0] for block in meta.saves[0].blocks] == [0, B]
    request.append([9])
    meta, _ = driver.step([RequestBlocks(request, ids, 3 * B)])
    assert [block.token_ids[0] for block in meta.saves[0].blocks] == [2 * B]
    assert all(block.lookahead_token_ids == () for block in meta.saves[0].blocks)
    driver.close()


def test_stores_cover_only_hashed_blocks():
    world = KVWorld()
    driver = _driver(world, lookahead=2)
    request = Req(list(range(3 * B + 1)))  # L=2: block 2 needs tokens 3B, 3B+1
    _, ids = driver.admit(request)
    driver.step([RequestBlocks(request, ids, 0)])
    meta, _ = driver.step([RequestBlocks(request, ids, 3 * B + 1)])
    assert len(request.get_block_hashes(2)) == 2
    assert sum(len(save.blocks) for save in meta.saves) == 2
    driver.close()


def test_a_full_tier_evicts_least_recently_used_and_publishes_events():
    world = KVWorld()
    driver = _driver(world, blocks=4)
    store_request(driver, list(range(4 * B + 1)))
    events = driver.connector.take_events()
    assert [type(e) for e in events] == [BlockStored] * 4
    assert all(e.medium == MEDIUM_CPU and e.lookahead_token_ids for e in events)
    assert events[1].parent_block_hash == events[0].block_hashes[0]
    store_request(driver, list(range(500, 500 + 2 * B + 1)))
    removed = [e for e in driver.connector.take_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 2
    assert removed[0].block_hashes[0] == events[0].block_hashes[0]  # the oldest went first
    stats = driver.connector.stats()["offload"]
    assert stats.evicted_blocks == 2 and stats.resident_blocks == 4
    driver.close()


def test_a_full_tier_never_evicts_blocks_being_loaded():
    world = KVWorld()
    driver = _driver(world, blocks=4)
    prompt = list(range(4 * B + 1))
    _, _, cold = store_request(driver, prompt)
    other = Req(list(range(900, 900 + 2 * B + 1)))
    _, other_ids = driver.admit(other)
    world.write_cold_kv(other_ids)
    driver.step([RequestBlocks(other, other_ids, 0)])  # its prefill step
    reader = Req(prompt)
    hit, ids = driver.admit(reader)  # pins the four blocks until they are loaded
    assert hit == 4 * B
    # the other request's saves land while the load is planned: the tier is full of pinned
    # blocks, so they are dropped, not the blocks being loaded
    driver.finish(other, other_ids, 2 * B)
    assert driver.connector.flush(timeout_s=WATCHDOG_S)
    world.zero(ids)
    _, output = driver.step([RequestBlocks(reader, ids, 0)])
    assert not output.load_failures
    assert bit_equal(world.blocks(ids[:4]), cold[:4])
    assert driver.connector.stats()["offload"].save_dropped_no_room == 2
    driver.close()


def test_a_load_that_fails_midway_reports_the_failed_blocks():
    """Blocks evicted between the lookup and the allocation: the load serves the blocks it
    still has and reports the rest, which the engine recomputes."""
    world = KVWorld()
    driver = _driver(world, blocks=4)
    prompt = list(range(4 * B + 1))
    _, _, cold = store_request(driver, prompt)
    # a request reading blocks 0 and 1 makes them the most recently used
    head = Req(prompt[: 2 * B + 1])
    hit, head_ids = driver.admit(head)
    assert hit == 2 * B
    driver.step([RequestBlocks(head, head_ids, 0)])
    reader = Req(prompt)
    assert driver.connector.get_num_new_matched_tokens(reader, 0).num_tokens == 4 * B
    store_request(driver, list(range(700, 700 + 2 * B + 1)))  # evicts blocks 2 and 3
    ids = world.allocate(5)
    world.zero(ids)
    driver.connector.update_state_after_alloc(reader, ids, 0, 4 * B)
    _, output = driver.step([RequestBlocks(reader, ids, 0)])
    (failure,) = output.load_failures
    assert failure.request_id == reader.request_id
    assert failure.first_failed_token == 2 * B
    assert failure.block_ids == tuple(ids[2:4])
    assert output.failed_block_ids == frozenset(ids[2:4])
    assert bit_equal(world.blocks(ids[:2]), cold[:2])
    assert torch.count_nonzero(world.target.storage[:, :, ids[2:4]]) == 0
    assert driver.connector.stats()["offload"].load_failed_blocks == 2
    driver.close()


def test_stores_dropped_by_a_full_queue_are_counted():
    world = KVWorld()
    driver = _driver(world, max_pending_blocks=2)
    prompt = list(range(5 * B + 1))
    store_request(driver, prompt)
    stats = driver.connector.stats()["offload"]
    assert stats.save_dropped_queue_full == 3 and stats.saved_blocks == 2
    hit, _ = driver.admit(Req(prompt))
    assert hit == 2 * B  # only what was stored is offered
    driver.close()


def test_a_preempted_request_releases_its_planned_load():
    world = KVWorld()
    driver = _driver(world, blocks=2)
    prompt = list(range(2 * B + 1))
    store_request(driver, prompt)
    reader = Req(prompt)
    hit, ids = driver.admit(reader)
    assert hit == 2 * B
    driver.connector.request_preempted(RequestBlocks(reader, ids, 0))
    meta, _ = driver.step()
    assert isinstance(meta, ConnectorMetadata) and meta.loads == ()
    store_request(driver, list(range(300, 300 + 2 * B + 1)))  # the unpinned blocks can go
    assert driver.connector.stats()["offload"].evicted_blocks == 2
    driver.close()


def test_reset_cache_forgets_the_tier():
    world = KVWorld()
    driver = _driver(world)
    prompt = list(range(3 * B + 1))
    store_request(driver, prompt)
    assert driver.connector.reset_cache()
    assert driver.admit(Req(prompt))[0] == 0
    removed = [e for e in driver.connector.take_events() if isinstance(e, BlockRemoved)]
    assert sum(len(e.block_hashes) for e in removed) == 3
    driver.close()


def test_without_the_capability_the_tier_follows_the_drop():
    world = KVWorld()
    connector = NoLookaheadOffloadConnector(tier_gib(world, 16))
    assert connector.supports_lookahead_block_hashes is False
    driver = Driver(connector, world, lookahead_tokens=0, drops_last_block=True)
    prompt = list(range(4 * B + 1))
    store_request(driver, prompt + [5, 6], written=4 * B + 2)
    hit, _ = driver.admit(Req(prompt))
    assert hit == 3 * B  # stored 0..3, a run of 4, the last one dropped: as the local cache
    driver.close()


def test_the_local_hit_is_where_the_scan_starts():
    world = KVWorld()
    driver = _driver(world)
    prompt = list(range(4 * B + 1))
    store_request(driver, prompt)
    hit, ids = driver.admit(Req(prompt), local_hit_tokens=2 * B)
    assert hit == 2 * B
    meta, _ = driver.step()
    (load,) = meta.loads
    assert load.first_token == 2 * B and load.device_block_ids == tuple(ids[2:4])
    with pytest.raises(ValueError, match="whole number"):
        driver.connector.get_num_new_matched_tokens(Req(prompt), 3)
    driver.close()


def test_every_built_step_must_be_started():
    world = KVWorld()
    driver = _driver(world)
    driver.connector.build_connector_meta([])
    with pytest.raises(RuntimeError, match="never passed to start_load_kv"):
        driver.connector.build_connector_meta([])
    driver.close()


def test_too_small_a_tier_is_refused_with_the_flag_name():
    world = KVWorld()
    with pytest.raises(ValueError, match="--kv-offload-gib"):
        Driver(OffloadConnector(1e-9), world)
