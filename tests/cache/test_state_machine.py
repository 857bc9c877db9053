"""Hypothesis state machine over the real scheduler, the cache manager and a symbolic KV store.

The real `Scheduler` runs through `EngineCore` with the toy runner (`speckv.simulation`), so the
lifecycle under test is the engine's own. Random interleavings of new requests (sharing
prefixes), steps with drafts accepted or rejected, chunked prefill under a small token budget,
preemption under block pressure, aborts (waiting, running, mid-speculation) and prefix-cache
resets, over hybrid group mixes (full attention, sliding window, Mamba) and retention
settings. Checked:
- after every step: pool integrity (free + used = total, ref counts = holders, hash map);
- at every hit lookup: the hit equals a brute-force oracle's longest length valid for every
  group, and the tokens (and lookahead tokens) each hit block's hash was published with equal
  the request's own;
- on every hit taken: each hit slot holds the target KV and draft KV a cold run of the hitting
  request would write (the toy runner raises `HitMismatch`). In legacy mode only the target KV
  is promised: a chain stitched from two requests' blocks keeps the first copy's draft KV.
- divergent block reuse (lookahead hashes on full-attention groups, on or off per example): a
  hit that copies a block is the oracle's hit plus B - L tokens, its source block was
  published with the request's own tokens, and the copy (carried out by the toy runner in the
  symbolic KV) passes the same hit-slot check; sources are held until the step ran, under
  evictions, preemptions, aborts and resets.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.events import BlockStored, KVEventSink
from speckv.cache.specs import MambaSpec, SlidingWindowSpec
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.simulation import SymbolicKV, toy_core

GROUP_MIXES = {
    "full": lambda b: [FullAttentionSpec(b)],
    "full+swa": lambda b: [FullAttentionSpec(b), SlidingWindowSpec(b, 2 * b + 1)],
    "full+swa+mamba": lambda b: [FullAttentionSpec(b), SlidingWindowSpec(2 * b, 3 * b),
                                 MambaSpec(4 * b)],
    "full+mamba": lambda b: [FullAttentionSpec(b), MambaSpec(2 * b)],
}

PREFIXES = [[random.Random(seed).randrange(1, 50) for _ in range(24)] for seed in range(3)]


class SchedulerCacheMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 3, 4]),
        num_blocks=st.integers(6, 40),
        drafter=st.sampled_from([("eagle", 1, False), ("mtp", 2, False), ("mtp", 3, False),
                                 ("eagle", 1, True), ("none", 1, False)]),
        num_spec_tokens=st.integers(0, 3),
        mix=st.sampled_from(sorted(GROUP_MIXES)),
        retention_units=st.sampled_from([None, 0, 1, 2]),
        token_budget=st.sampled_from([5, 8, 16, 1024]),
        max_num_seqs=st.integers(1, 4),
        reuse=st.booleans(),
        pool_shares=st.none() | st.lists(st.integers(1, 4), min_size=3, max_size=3),
    )
    def setup(self, block_size, num_blocks, drafter, num_spec_tokens, mix, retention_units,
              token_budget, max_num_seqs, reuse, pool_shares):
        self._build(block_size, num_blocks, drafter, num_spec_tokens, mix, retention_units,
                    token_budget, max_num_seqs, reuse, pool_shares)

    def _build(self, block_size, num_blocks, drafter, num_spec_tokens, mix, retention_units,
               token_budget, max_num_seqs, reuse, pool_shares=None):
        name, modules, legacy = drafter
        policy = drafter_policy(name, modules)
        self.mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=legacy,
                                      reuse_divergent_blocks=reuse)
        specs = GROUP_MIXES[mix](block_size)
        unit = specs[-1].block_size if mix != "full+swa" else block_size
        retention = None if mix == "full" or retention_units is None else retention_units * unit
        self.sink = KVEventSink()
        # one pool shared by every group, or (`pool_shares`) a pool per group of its own size
        pools = (len(specs) * num_blocks if pool_shares is None
                 else [max(2, num_blocks * share // 2) for share in pool_shares[:len(specs)]])
        self.manager = KVCacheManager(specs, pools, self.mode,
                                      event_sink=self.sink, retention_interval=retention)
        self.hashing = self.manager.block_hashing("sha256", "0")
        self.block_size = block_size
        num_spec = num_spec_tokens if name != "none" else 0
        self.core = toy_core(
            self.manager, num_spec, vocab_size=50,
            kv=SymbolicKV(self.manager.pools[0].num_blocks, block_size,
                          policy.draft_kv_lookahead_tokens),
            check_draft_kv=not self.mode.drops_last_unit,
            max_num_batched_tokens=max(token_budget, 1 + num_spec), max_num_seqs=max_num_seqs,
        )
        self.published: dict[tuple[bytes, int], tuple[list[int], list[int] | None]] = {}
        self.counter = 0
        lookup = self.manager.get_computed_blocks

        def checked_lookup(request):
            hit = lookup(request)
            self._absorb_events()
            self._check_hit(request, hit)
            return hit

        # a spy on the scheduler's lookups: the oracle is evaluated at the moment of each one
        self.manager.get_computed_blocks = checked_lookup

    def _absorb_events(self):
        for event in self.sink.take():
            if isinstance(event, BlockStored):
                size = event.block_size
                for index, block_hash in enumerate(event.block_hashes):
                    lookahead = (event.lookahead_token_ids[index]
                                 if event.lookahead_token_ids is not None else None)
                    self.published[(block_hash, event.group_idx)] = (
                        event.token_ids[index * size:(index + 1) * size], lookahead)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), prefix_len=st.integers(1, 24),
          suffix=st.lists(st.integers(1, 49), max_size=6), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, prefix_len, suffix, max_tokens):
        self.counter += 1
        prompt = PREFIXES[prefix][:prefix_len] + suffix
        self.core.scheduler.add_request(
            Request(f"r{self.counter}", prompt, self.hashing, max_tokens=max_tokens))

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), num_blocks=st.integers(1, 12),
          suffix=st.lists(st.integers(1, 49), min_size=2, max_size=6),
          max_tokens=st.integers(1, 6))
    def add_request_diverging_at_a_boundary(self, prefix, num_blocks, suffix, max_tokens):
        """A shared prefix of whole blocks, then its own tail: where blocks get reused."""
        self.add_request(prefix, min(24, num_blocks * self.block_size), suffix, max_tokens)

    @precondition(lambda self: self.core.scheduler.has_unfinished_requests())
    @rule(num_accept=st.integers(0, 3))
    def step(self, num_accept):
        self.core.runner.num_accept = num_accept
        hits_before = self.core.runner.num_hits_checked
        for output in self.core.step():
            assert output.finish_reason in (None, FinishReason.LENGTH, FinishReason.ERROR)
            if output.num_preemptions:
                note_event("a request was preempted")
            if output.num_accepted_tokens:
                note_event("drafts accepted")
        if self.core.runner.num_hits_checked > hits_before:
            note_event("a hit was taken and checked")
        if self.core.runner.num_block_copies:
            note_event("a divergent block was copied")
        self._absorb_events()

    @precondition(lambda self: self.core.scheduler.has_unfinished_requests())
    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = sorted(self.core.scheduler.requests)
        self.core.scheduler.finish_requests([ids[pick % len(ids)]], FinishReason.ABORT)
        self._absorb_events()

    @rule()
    def reset(self):
        if self.manager.reset_prefix_cache():
            self.published.clear()
        self._absorb_events()

    def _check_hit(self, request, hit):
        hit_tokens = hit.num_computed_tokens
        assert hit_tokens <= request.num_tokens - 1
        tokens = request.all_token_ids
        lookahead = self.mode.lookahead_tokens
        oracle = self._oracle_hit(request)
        if hit.copy_sources:
            # the block after the oracle's hit, copied: only its last L positions recomputed
            assert self.manager.reuses_divergent_blocks
            assert hit_tokens == oracle + self.block_size - lookahead
            start, end = oracle, oracle + self.block_size
            assert end <= request.num_tokens - 1
            for source in hit.copy_sources:
                published_tokens, published_lookahead = self.published[(source.block_hash, 0)]
                assert published_tokens == tokens[start:end]
                assert published_lookahead != tokens[end:end + lookahead]
            hit_tokens = oracle
        assert hit_tokens % self.manager.alignment_tokens == 0
        assert hit_tokens == oracle, "hit is not the longest valid one"
        for manager, blocks in zip(self.manager.managers, hit.blocks):
            assert len(blocks) == hit_tokens // manager.block_size
        hashes = request.get_block_hashes(lookahead)
        for index in range(hit_tokens // self.block_size):
            published_tokens, published_lookahead = self.published[(hashes[index], 0)]
            end = (index + 1) * self.block_size
            assert published_tokens == tokens[index * self.block_size:end]
            if lookahead:
                assert published_lookahead == tokens[end:end + lookahead]

    def _valid_for_group(self, request, manager, length):
        """Brute force: does this group hold what a hit at `length` needs?"""
        stride = manager.block_size // self.manager.hash_block_size
        chain = request.get_block_hashes(manager.group.lookahead_tokens)
        hashes = chain[stride - 1::stride]
        num_blocks = length // manager.block_size
        if num_blocks > len(hashes):
            return False
        if isinstance(manager.spec, SlidingWindowSpec):
            needed = range(max(0, num_blocks - manager.spec.num_window_blocks), num_blocks)
        elif isinstance(manager.spec, MambaSpec):
            needed = range(num_blocks - 1, num_blocks) if num_blocks else range(0)
        else:
            needed = range(num_blocks)
        group_id = manager.group.group_id
        return all(self.manager.pools[group_id].get_cached_block(hashes[i], group_id) is not None
                   for i in needed)

    def _oracle_hit(self, request):
        unit = self.manager.alignment_tokens

        def longest_valid(limit):
            for length in range(max(0, limit) // unit * unit, -1, -unit):
                if all(self._valid_for_group(request, m, length) for m in self.manager.managers):
                    return length
            return 0

        best = longest_valid(request.num_tokens - 1)
        if self.mode.drops_last_unit and best > 0:
            best = longest_valid(best - unit)
        return best

    @invariant()
    def pool_is_sound(self):
        if hasattr(self, "manager"):
            self.manager.check_integrity()


class DivergentReuseMachine(SchedulerCacheMachine):
    """The same machine on one full-attention group with lookahead hashes and block reuse:
    where divergent block copies happen most (with evictions, preemptions, aborts, resets)."""

    @initialize(
        block_size=st.sampled_from([2, 3, 4]),
        num_blocks=st.integers(6, 40),
        drafter=st.sampled_from([("eagle", 1, False), ("mtp", 2, False)]),
        num_spec_tokens=st.integers(0, 3),
        token_budget=st.sampled_from([5, 8, 16, 1024]),
        max_num_seqs=st.integers(1, 4),
    )
    def setup(self, block_size, num_blocks, drafter, num_spec_tokens, token_budget,
              max_num_seqs):
        self._build(block_size, num_blocks, drafter, num_spec_tokens, "full", None,
                    token_budget, max_num_seqs, True)


TestSchedulerCacheMachine = SchedulerCacheMachine.TestCase
TestSchedulerCacheMachine.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestDivergentReuseMachine = DivergentReuseMachine.TestCase
TestDivergentReuseMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
