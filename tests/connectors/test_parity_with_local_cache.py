"""A tier serves exactly the hit the local prefix cache would: same length under lookahead
hashes, legacy hashes with the drop, and k-token lookahead, for random prompts that share
prefixes and successors with what was stored."""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.connectors import ConnectorMode, OffloadConnector, RequestBlocks
from tests.connectors.connector_helpers import BLOCK_SIZE, Driver, KVWorld, Req
from tests.patience import WATCHDOG_S

B = BLOCK_SIZE


class ManagedReq(Req):
    """The test request, plus what the local cache manager reads."""

    def __init__(self, tokens, **kwargs) -> None:
        super().__init__(tokens, **kwargs)
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.spec_token_ids: list[int] = []


@pytest.mark.parametrize(("drafter", "modules", "legacy"), [
    ("eagle", 1, False),
    ("eagle", 1, True),
    ("mtp", 2, False),
    ("mtp", 3, True),
])
@pytest.mark.parametrize("seed", range(4))
def test_the_tier_hit_equals_the_local_hit(drafter, modules, legacy, seed):
    rng = random.Random(seed)
    # the hash mode a connector gets: no divergent block reuse
    hash_mode = resolve_hash_mode(drafter_policy(drafter, modules),
                                  disable_lookahead_block_hashes=legacy,
                                  reuse_divergent_blocks=False)
    manager = KVCacheManager([FullAttentionSpec(B)], 512, hash_mode)
    world = KVWorld(num_blocks=512)
    connector = OffloadConnector(0.05)
    driver = Driver(connector, world, hash_mode.lookahead_tokens, hash_mode.drops_last_unit)
    assert driver.mode == ConnectorMode.from_hash_mode(hash_mode, B)

    stored: list[list[int]] = []
    for _ in range(6):  # cold runs: cached locally and stored in the tier alike
        if stored and rng.random() < 0.6:
            base = rng.choice(stored)
            prompt = base[: rng.randrange(1, len(base) + 1)]
        else:
            prompt = []
        prompt = prompt + [rng.randrange(20) for _ in range(rng.randrange(1, 4 * B))]
        sampled = [rng.randrange(20) for _ in range(rng.randrange(1, 4))]
        local = ManagedReq(prompt)
        assert manager.allocate_slots(local, len(prompt)) is not None
        local.num_computed_tokens = len(prompt)
        local.append(sampled[:1])
        for token in sampled[1:]:  # decode steps: compute the last token, sample the next
            assert manager.allocate_slots(local, 1) is not None
            local.num_computed_tokens += 1
            local.append([token])
        manager.finish(local)

        tiered = Req(prompt)
        _, ids = driver.admit(tiered)
        driver.step([RequestBlocks(tiered, ids, 0)])
        tiered.append(sampled)
        driver.finish(tiered, ids, tiered.num_tokens - 1)
        world.free(ids)
        stored.append(prompt + sampled)
    assert connector.flush(timeout_s=WATCHDOG_S)
    manager.check_integrity()

    hits = []
    for _ in range(20):  # lookups: each prefix of something stored, maybe diverging after
        base = rng.choice(stored)
        prompt = base[: rng.randrange(1, len(base) + 1)]
        if rng.random() < 0.5:
            prompt = prompt + [rng.randrange(20) for _ in range(rng.randrange(1, 2 * B))]
        local_hit = manager.get_computed_blocks(ManagedReq(prompt)).num_computed_tokens
        tier_hit = connector.get_num_new_matched_tokens(Req(prompt), 0).num_tokens
        assert tier_hit == local_hit, (prompt, hash_mode.label)
        hits.append(tier_hit)
    assert any(hits) and not all(hit == hits[0] for hit in hits)
    connector.shutdown()
