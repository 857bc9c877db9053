"""Builders shared by the cache tests: tiny managers, hashing and requests."""

from __future__ import annotations

import itertools

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.block_pool import hit_check_for
from speckv.cache.events import KVEventSink
from speckv.engine.request import BlockHashing, Request
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.spec.policy import make_drafter_policy, resolve_hash_mode

_ids = itertools.count()


class CacheWorld:
    """One manager plus the hashing its requests use."""

    def __init__(self, block_size=4, num_blocks=64, drafter="eagle", mtp_modules=1,
                 legacy=False, algo="sha256", events=False):
        self.hash_mode = resolve_hash_mode(make_drafter_policy(drafter, mtp_modules),
                                           disable_lookahead_block_hashes=legacy)
        hash_algo = get_hash_algo(algo)
        self.sink = KVEventSink() if events else None
        self.manager = KVCacheManager(
            [FullAttentionSpec(block_size)], num_blocks, self.hash_mode,
            hit_check=hit_check_for(hash_algo),
            event_sink=self.sink,
        )
        self.hashing = BlockHashing(hash_algo, make_none_hash(hash_algo, "0"),
                                    self.manager.hash_block_size, self.manager.lookahead_values)
        self.block_size = block_size

    def request(self, prompt, max_tokens=8, **kwargs) -> Request:
        return Request(f"r{next(_ids)}", prompt, self.hashing, max_tokens=max_tokens, **kwargs)


@pytest.fixture
def world_factory():
    return CacheWorld
