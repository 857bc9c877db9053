"""The copy thread's interleavings, run at chosen points: the staging-slot race and replays.

A tier stores snapshots on a copy thread; under a `CopySchedule` the same stores run at the
points the schedule picks, on the engine thread, so one exact interleaving can be pinned down
(a scripted schedule) or drawn from a seed and replayed (a seeded one).
"""

from __future__ import annotations

import pytest

from speckv.connectors import OffloadConnector, RequestBlocks
from speckv.connectors.copy_schedule import (
    CopyPoint,
    ScriptedCopySchedule,
    SeededCopySchedule,
)
from speckv.simulation.tiers import tiers_of
from tests.connectors.connector_helpers import Driver, KVWorld, Req, bit_equal, tier_gib
from tests.patience import WATCHDOG_S


def _driver(schedule, num_tier_blocks: int = 16) -> Driver:
    world = KVWorld()
    connector = OffloadConnector(tier_gib(world, num_tier_blocks), max_pending_blocks=4)
    for tier in tiers_of(connector):
        tier.run_copies_on(schedule)
    return Driver(connector, world)


def test_a_store_settled_between_two_saves_of_one_step_does_not_free_a_slot_a_load_reads():
    """Request A exits (its blocks listed for the next step's snapshot), so does C, and B,
    with A's prompt, loads A's blocks in that same step from the snapshot. The copy thread
    stores A's first block right after A's save was queued, before C's save takes a staging
    slot: that slot must stay A's until B's load has read it. (The old staging freed it at
    once, C's snapshot overwrote it, and B's hit read C's KV.)"""
    schedule = ScriptedCopySchedule({(CopyPoint.AFTER_QUEUE, 0): 1})
    driver = _driver(schedule)
    world = driver.world
    try:
        tokens_a = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        a = Req(tokens_a)
        _, a_ids = driver.admit(a)
        world.write_cold_kv(a_ids)
        c = Req([40, 41, 42, 43, 44, 45, 46, 47, 48])
        _, c_ids = driver.admit(c)
        world.write_cold_kv(c_ids)
        cold_a = world.blocks(a_ids[:2])
        driver.step([RequestBlocks(a, a_ids, 0), RequestBlocks(c, c_ids, 0)])  # first step
        driver.finish(a, a_ids, 8)
        driver.finish(c, c_ids, 8)
        b = Req(tokens_a)
        hit, b_ids = driver.admit(b)
        assert hit == 8  # A's two blocks, still pending
        world.zero(b_ids)
        driver.step([])
        assert not driver.outputs[-1].load_failures
        assert bit_equal(world.blocks(b_ids[:2]), cold_a)
        assert driver.connector.flush(timeout_s=WATCHDOG_S)
    finally:
        driver.close()


def test_a_load_reads_blocks_in_flight_while_the_copy_thread_settles_them():
    """B loads A's blocks while they are still queued: the first from its staging slot, and
    then the copy thread settles both, so the second comes from the tier itself."""
    schedule = ScriptedCopySchedule({(CopyPoint.BEFORE_FETCH, 1): 2})
    driver = _driver(schedule)
    world = driver.world
    try:
        a = Req([5, 6, 7, 8, 9, 10, 11, 12, 13])
        _, a_ids = driver.admit(a)
        world.write_cold_kv(a_ids)
        cold_a = world.blocks(a_ids[:2])
        driver.step([RequestBlocks(a, a_ids, 0)])  # its first step: nothing written before
        driver.step([RequestBlocks(a, a_ids, 8)])  # queued, nothing stored yet
        b = Req(list(a.all_token_ids))
        hit, b_ids = driver.admit(b)
        assert hit == 8
        world.zero(b_ids)
        driver.step([])
        assert not driver.outputs[-1].load_failures
        assert bit_equal(world.blocks(b_ids[:2]), cold_a)
        assert driver.connector.stats()["offload"].saved_blocks == 2
        driver.finish(a, a_ids, 8)
        assert driver.connector.flush(timeout_s=WATCHDOG_S)
    finally:
        driver.close()


@pytest.mark.parametrize("eagerness", [0.2, 0.5])
def test_a_seeded_schedule_replays_the_same_interleaving(eagerness):
    def run(seed: int) -> list[tuple]:
        schedule = SeededCopySchedule(seed, eagerness)
        driver = _driver(schedule, num_tier_blocks=3)
        world = driver.world
        trace = []
        try:
            for round_index in range(6):
                request = Req([round_index % 3 + 1] * 4 + list(range(9)))
                hit, ids = driver.admit(request)
                world.write_cold_kv(ids)
                driver.step([RequestBlocks(request, ids, 12)])
                driver.finish(request, ids, 12)
                stats = driver.connector.stats()["offload"]
                trace.append((hit, stats.saved_blocks, stats.evicted_blocks,
                              stats.save_dropped_queue_full))
                world.free(ids)
        finally:
            driver.close()
        return trace + [(schedule.num_points, schedule.num_copies)]

    assert run(7) == run(7)
    assert any(run(7) != run(seed) for seed in range(8, 14))
