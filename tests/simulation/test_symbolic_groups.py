"""The toy runner checks every KV cache group of a hybrid layout: sliding-window KV inside the
window and Mamba / GDN states at the hit boundary, not only group 0."""

from __future__ import annotations

import random

import pytest

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from speckv.engine.request import Request
from speckv.simulation import HitMismatch, SymbolicKV, run_to_completion, toy_core

SPECS = [FullAttentionSpec(4), SlidingWindowSpec(4, 9), MambaSpec(16)]


def hybrid_core(drafter="eagle", num_spec=2):
    policy = drafter_policy(drafter)
    manager = KVCacheManager(SPECS, 120, resolve_hash_mode(policy))
    core = toy_core(manager, num_spec, vocab_size=50,
                    kv=SymbolicKV(120, 4, policy.draft_kv_lookahead_tokens))
    return core, manager.block_hashing("sha256", "0")


def prompt(length, seed=0):
    rng = random.Random(seed)
    return [rng.randrange(1, 50) for _ in range(length)]


@pytest.mark.parametrize("drafter", ["eagle", "mtp"])
def test_hybrid_hits_are_checked_in_every_group(drafter):
    core, hashing = hybrid_core(drafter)
    shared = prompt(40)
    run_to_completion(core, [Request("a", shared, hashing, max_tokens=6)])
    run_to_completion(core, [Request("b", shared + [7, 8], hashing, max_tokens=6)])
    assert core.runner.num_hits_checked == 32  # two units of 16: full, window and state agree


def _corrupt(store_index, mutate):
    core, hashing = hybrid_core()
    shared = prompt(40)
    run_to_completion(core, [Request("a", shared, hashing, max_tokens=6)])
    mutate(core.runner.groups.stores[store_index])
    return core, hashing, shared


def test_a_wrong_state_checkpoint_is_caught():
    def wrong_states(store):
        store.states = [None if s is None else (*s[:-1], s[-1] + 1) for s in store.states]

    core, hashing, shared = _corrupt(2, wrong_states)
    with pytest.raises(HitMismatch, match=r"group 2 \(mamba\)"):
        run_to_completion(core, [Request("b", shared + [7, 8], hashing, max_tokens=6)])


@pytest.mark.parametrize("position,caught", [(31, True), (24, True), (23, False)])
def test_sliding_window_kv_is_checked_inside_the_window_only(position, caught):
    # a hit at 32 with W = 9 reads positions 24..31; older ones are never read again
    core, hashing = hybrid_core()
    shared = prompt(40)
    run_to_completion(core, [Request("a", shared, hashing, max_tokens=6)])
    request = Request("b", shared + [7, 8], hashing, max_tokens=6)
    hit = core.scheduler.manager.get_computed_blocks(request)  # pure: nothing taken
    assert hit.num_computed_tokens == 32
    window = core.runner.groups.stores[1]
    block = hit.blocks[1][position // 4]
    if not block.is_null:
        window.target[block.block_id * 4 + position % 4] = -1
    if caught:
        with pytest.raises(HitMismatch, match=r"group 1 \(sliding_window\)"):
            run_to_completion(core, [request])
    else:
        assert block.is_null or position < 24
        run_to_completion(core, [request])
