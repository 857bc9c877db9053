"""Hypothesis state machine over the real cache manager and a symbolic KV store.

Random interleavings of new requests (sharing prefixes), steps with drafts accepted or
rejected, preemption, finish, abort, and eviction pressure. After every step: pool integrity
(free + used = total, ref counts = holders, hash map consistent). On every hit: each hit block
holds the same target KV and draft KV a cold run of the hitting request would write, and the
tokens (and lookahead tokens) its hash was published with equal the request's own. (In legacy
mode only the target KV is promised; see `_check_hit`.)
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.events import BlockStored, KVEventSink
from speckv.engine.cache_sim import CacheSimulator, SymbolicKV
from speckv.engine.request import BlockHashing, Request
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.spec.policy import make_drafter_policy, resolve_hash_mode

PREFIXES = [[random.Random(seed).randrange(1, 50) for _ in range(24)] for seed in range(3)]


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(6, 40),
        drafter=st.sampled_from([("eagle", 1, False), ("mtp", 2, False), ("mtp", 3, False),
                                 ("eagle", 1, True), ("none", 1, False)]),
        num_spec_tokens=st.integers(0, 3),
    )
    def setup(self, block_size, num_blocks, drafter, num_spec_tokens):
        name, modules, legacy = drafter
        policy = make_drafter_policy(name, modules)
        self.mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=legacy)
        algo = get_hash_algo("sha256")
        self.hashing = BlockHashing(algo, make_none_hash(algo, "0"), block_size,
                                    [self.mode.lookahead_tokens])
        self.sink = KVEventSink()
        self.manager = KVCacheManager([FullAttentionSpec(block_size)], num_blocks, self.mode,
                                      event_sink=self.sink)
        self.block_size = block_size
        self.kv = SymbolicKV(num_blocks, block_size, policy.draft_kv_lookahead_tokens)
        self.sim = CacheSimulator(self.manager, num_spec_tokens if name != "none" else 0,
                                  vocab_size=50, kv=self.kv)
        self.running: list[Request] = []
        self.published: dict[bytes, tuple[list[int], list[int] | None]] = {}
        self.counter = 0

    def _absorb_events(self):
        for event in self.sink.take():
            if isinstance(event, BlockStored):
                size = event.block_size
                for index, block_hash in enumerate(event.block_hashes):
                    lookahead = (event.lookahead_token_ids[index]
                                 if event.lookahead_token_ids is not None else None)
                    self.published[block_hash] = (
                        event.token_ids[index * size:(index + 1) * size], lookahead)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), prefix_len=st.integers(1, 24),
          suffix=st.lists(st.integers(1, 49), max_size=6), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, prefix_len, suffix, max_tokens):
        self.counter += 1
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        request = Request(f"r{self.counter}", prompt, self.hashing, max_tokens=max_tokens)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100), num_accept=st.integers(0, 3))
    def step(self, pick, num_accept):
        request = self.running[pick % len(self.running)]
        if request.num_computed_tokens == 0:
            # the hit the step is about to take (lookup is pure)
            self._check_hit(request, self.manager.get_computed_blocks(request))
        outcome = self.sim.step(request, num_accept)
        self._absorb_events()
        if outcome.finished:
            self.running.remove(request)

    def _check_hit(self, request, hit):
        hit_tokens = hit.num_computed_tokens
        assert hit_tokens <= request.num_tokens - 1
        assert hit_tokens % self.block_size == 0
        block_ids = hit.block_ids[0]
        tokens = request.all_token_ids
        lookahead = self.mode.lookahead_tokens
        hashes = request.get_block_hashes(lookahead)
        for position in range(hit_tokens):
            target, draft = self.kv.read(block_ids, position)
            expected_target, expected_draft = self.kv.expected_at(tokens, position)
            assert target == expected_target, f"hit slot {position}: target KV differs"
            if not self.mode.drops_last_unit:
                # Legacy hashes + drop cannot promise this: a chain stitched from blocks of
                # different requests keeps the first copy's draft KV (only drafts suffer).
                assert draft == expected_draft, f"hit slot {position}: draft KV differs"
        for index in range(hit_tokens // self.block_size):
            published_tokens, published_lookahead = self.published[hashes[index]]
            end = (index + 1) * self.block_size
            assert published_tokens == tokens[index * self.block_size:end]
            if lookahead:
                assert published_lookahead == tokens[end:end + lookahead]

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def preempt(self, pick):
        request = self.running[pick % len(self.running)]
        if request.num_computed_tokens:
            self.sim.preempt(request)
            self._absorb_events()

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        request = self.running.pop(pick % len(self.running))
        self.sim.abort(request)
        self._absorb_events()

    @rule()
    def reset(self):
        if self.manager.reset_prefix_cache():
            self.published.clear()
        self._absorb_events()

    @invariant()
    def pool_is_sound(self):
        if hasattr(self, "manager"):
            self.manager.check_integrity()


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
