"""`speckv bench soak`: short runs stay clean over group mixes and drafters, and through real
KV tiers with injected load failures; a run whose cache serves stale draft KV, whose tier
stores a block before it is written, serves a failed load, drops draft KV or loads a block
into the wrong slots is caught."""

from __future__ import annotations

import pytest
import torch

from speckv.bench import soak
from speckv.cache.hash_mode import HashMode
from speckv.connectors.host_pool import HostBlockPool
from speckv.engine import scheduler as scheduler_module
from speckv.engine.kv_connector import SchedulerConnector


@pytest.mark.parametrize("groups,drafter,modules,legacy", [
    ("full:4", "eagle", 1, False),
    ("full:4", "mtp", 3, False),
    ("full:4", "eagle", 1, True),
    ("full:4,swa:9:4,mamba:16", "eagle", 1, False),
    ("full:2", "none", 1, False),
])
def test_short_soaks_are_clean(groups, drafter, modules, legacy):
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=1, groups=groups, drafter=drafter,
                                           num_modules=modules, legacy=legacy), progress=False)
    assert result.violation is None
    assert result.num_ops == 3000
    assert result.num_finished > 100 and result.num_aborted > 10
    assert result.num_hit_tokens_checked > 0


def test_a_hybrid_soak_over_per_group_pools_is_clean_and_preempts():
    # the state group's own pool is the tight one: preemptions come from it
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=3, groups="full:4,swa:9:4,mamba:16",
                                           group_blocks="48,30,8"), progress=False)
    assert result.violation is None and result.num_hit_tokens_checked > 0
    assert result.num_preemptions > 0
    with pytest.raises(ValueError, match="one count >= 4 per group"):
        soak.SoakConfig(groups="full:4,mamba:16", group_blocks="40")


def test_preemption_happens_under_pressure():
    result = soak.run_soak(soak.SoakConfig(num_ops=5000, seed=2, num_blocks=24),
                           progress=False)
    assert result.violation is None and result.num_preemptions > 0


def test_stale_draft_kv_is_a_violation(monkeypatch):
    # legacy hashes without the drop: a hit may carry draft KV from another successor token
    monkeypatch.setattr(soak, "resolve_hash_mode", lambda *a, **k: HashMode.for_lookahead(0))
    result = soak.run_soak(soak.SoakConfig(num_ops=20000, seed=0), progress=False)
    assert result.violation is not None and "draft KV" in result.violation
    assert result.num_ops < 20000


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--ops"):
        soak.SoakConfig(num_ops=0)
    with pytest.raises(ValueError, match="unknown drafter"):
        soak.SoakConfig(drafter="medusa")


@pytest.mark.parametrize("tiers,drafter,modules,legacy,fault_rate", [
    ("offload", "eagle", 1, False, 0.05),
    ("offload,disk", "mtp", 2, False, 0.05),
    ("disk", "eagle", 1, True, 0.0),
])
def test_short_soaks_through_real_tiers_are_clean(tiers, drafter, modules, legacy, fault_rate):
    result = soak.run_soak(soak.SoakConfig(num_ops=2000, seed=3, drafter=drafter,
                                           num_modules=modules, legacy=legacy,
                                           kv_connector=tiers, fault_rate=fault_rate),
                           progress=False)
    assert result.violation is None
    assert result.num_external_hit_tokens > 0 and result.num_tier_evictions > 0
    assert result.num_tier_stores_checked > 0 and result.num_tier_loads_checked > 0
    assert result.num_positions_checked > 0
    if fault_rate:
        assert result.num_load_failures > 0


def test_saving_a_same_step_hit_before_it_is_written_is_caught(monkeypatch):
    # a request's first step counted its local hit as written: the hit may name blocks
    # another request computes in that very step, so the tier stored garbage
    def build_metadata(self, scheduled, requests):
        return self.connector.build_connector_meta([
            self._blocks(requests[item.request_id], item.start) for item in scheduled])

    monkeypatch.setattr(SchedulerConnector, "build_metadata", build_metadata)
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=0, kv_connector="offload"),
                           progress=False)
    assert result.violation is not None and "store of block" in result.violation


def test_serving_a_failed_load_is_caught(monkeypatch):
    # the scheduler ignores load failures: the request goes on over garbage blocks
    monkeypatch.setattr(scheduler_module, "apply_load_failure", lambda *args: None)
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=0, kv_connector="offload",
                                           fault_rate=0.2), progress=False)
    assert result.violation is not None and "KV" in result.violation


def test_a_tier_that_keeps_only_target_kv_is_caught(monkeypatch):
    # SGLang HiCache's bug: the tier restores target KV but not the drafter's
    put = HostBlockPool.put
    monkeypatch.setattr(HostBlockPool, "put", lambda self, block, tensors: put(
        self, block, (tensors[0], torch.zeros_like(tensors[1]))))
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=0, kv_connector="offload"),
                           progress=False)
    assert result.violation is not None and "draft KV" in result.violation


@pytest.mark.parametrize("segment,what", [(0, "target KV"), (1, "draft KV")])
def test_a_tier_load_landing_one_slot_off_is_caught_at_the_hit(monkeypatch, segment, what):
    # the tier serves the right block (its load check passes) but the copy into the device
    # shifts one cache's slots by one: only the whole-request check of the hit can see it
    from speckv.connectors.layout import BlockWriter

    add = BlockWriter.add

    def shifted(self, block_id, block):
        block = tuple(torch.roll(t, 1, dims=2) if i == segment else t
                      for i, t in enumerate(block))
        add(self, block_id, block)

    monkeypatch.setattr(BlockWriter, "add", shifted)
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=0, drafter="mtp", num_modules=2,
                                           kv_connector="offload,disk"), progress=False)
    assert result.violation is not None and "HitMismatch" in result.violation
    assert what in result.violation


def test_tier_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown connector"):
        soak.SoakConfig(kv_connector="tape")
    with pytest.raises(ValueError, match="a full-attention group first"):
        soak.SoakConfig(kv_connector="offload", groups="mamba:16,full:4")
    with pytest.raises(ValueError, match="--fault-rate needs"):
        soak.SoakConfig(fault_rate=0.1)


def test_replayable_copies_replay_a_tier_soak_exactly():
    config = soak.SoakConfig(num_ops=1500, seed=4, drafter="mtp", num_modules=2,
                             kv_connector="offload,disk", fault_rate=0.1)
    first, second = soak.run_soak(config, progress=False), soak.run_soak(config, progress=False)
    assert first.violation is None
    counts = [{k: v for k, v in vars(r).items() if k != "elapsed_s"} for r in (first, second)]
    assert counts[0] == counts[1]
    assert first.num_external_hit_tokens > 0 and first.num_load_failures > 0


def test_the_staging_slot_race_is_found_and_replayed_from_its_seed(monkeypatch):
    """Seed 11 draws the interleaving that served another block's KV: the copy thread stores a
    block right after its save was queued and frees the staging slot, the next save of the
    same snapshot pass overwrites it, and this step's load of the first block reads the
    second. With the slot held for the load (the fix) the same seed is clean; without it
    the violation comes back at the same operation every time."""
    from speckv.connectors.tier_worker import TierWorkerSide

    config = soak.SoakConfig(num_ops=1500, seed=11, drafter="mtp", num_modules=2,
                             kv_connector="offload,disk", fault_rate=0.1)
    assert soak.run_soak(config, progress=False).violation is None
    monkeypatch.setattr(TierWorkerSide, "_hold", lambda self, slot: None)  # the old staging
    found = [soak.run_soak(config, progress=False).violation for _ in range(2)]
    assert found[0] is not None and "HitMismatch" in found[0]
    assert found[0] == found[1]


@pytest.mark.parametrize("copy_mode", ["threaded", "replayable"])
@pytest.mark.parametrize("seed", [21, 22, 23])
def test_tier_soaks_with_faults_are_clean_in_both_copy_modes(copy_mode, seed):
    result = soak.run_soak(soak.SoakConfig(num_ops=1500, seed=seed, drafter="mtp",
                                           num_modules=2, kv_connector="offload,disk",
                                           fault_rate=0.1, copy_mode=copy_mode),
                           progress=False)
    assert result.violation is None
    assert result.num_tier_loads_checked > 0 and result.num_load_failures > 0


def test_an_unknown_copy_mode_is_refused():
    with pytest.raises(ValueError, match="--copy-mode"):
        soak.SoakConfig(kv_connector="offload", copy_mode="async")


HYBRID = "full:4,swa:9:4,mamba:16"


@pytest.mark.parametrize("drafter,modules,legacy,seed", [
    ("eagle", 1, False, 1),
    ("mtp", 2, False, 2),
    ("eagle", 1, True, 3),
])
def test_hybrid_soaks_through_real_tiers_with_faults_are_clean(drafter, modules, legacy, seed):
    """Sliding-window tails and GDN states through offload and disk, loads failing at
    random: every hit (local or from a tier) and every computed position of every group
    reads what a cold run writes, every block a tier stores or serves is its header's."""
    result = soak.run_soak(soak.SoakConfig(num_ops=2500, seed=seed, groups=HYBRID,
                                           drafter=drafter, num_modules=modules, legacy=legacy,
                                           kv_connector="offload,disk", fault_rate=0.1),
                           progress=False)
    assert result.violation is None
    assert result.num_external_hit_tokens > 0 and result.num_load_failures > 0
    assert result.num_tier_stores_checked > 0 and result.num_tier_loads_checked > 0


def test_a_sibling_tier_saving_a_partly_loaded_window_is_caught(monkeypatch):
    # offload loads a hit's window tail; disk, which loaded nothing, must not store the
    # blocks before the tail (they hold nothing): without `sibling_loads` it does
    from speckv.connectors.group_tiers import GroupedTiers

    config = soak.SoakConfig(num_ops=2500, seed=1, groups=HYBRID, kv_connector="offload,disk",
                             fault_rate=0.1)
    assert soak.run_soak(config, progress=False).violation is None
    monkeypatch.setattr(GroupedTiers, "sibling_loads", lambda *args: None)
    found = soak.run_soak(config, progress=False).violation
    assert found is not None and "store of block" in found and "(group 1)" in found


def test_caching_the_blocks_a_partial_load_leaves_empty_is_caught(monkeypatch):
    # a tier hit loads only the window's tail: the manager must never cache the blocks
    # before it (they hold nothing), or a later local hit reads garbage
    config = soak.SoakConfig(num_ops=2000, seed=2, groups=HYBRID, kv_connector="offload,disk",
                             fault_rate=0.1)
    assert soak.run_soak(config, progress=False).violation is None
    from speckv.cache import single_type

    monkeypatch.setattr(single_type._PartialPrefixManager, "skip_caching_before",
                        lambda self, request_id, num_blocks: None)
    found = soak.run_soak(config, progress=False).violation
    assert found is not None and "sliding_window" in found
