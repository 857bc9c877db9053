"""Hypothesis state machine: the real scheduler and cache manager over real KV tiers.

The toy runner (`speckv.simulation`) keeps its symbolic KV in real paged tensors that the real
connector (CPU pool, disk directory, or both) stores on its copy thread, evicts (tiny tiers) and
loads back, with load failures injected at random. Random interleavings of new requests
(sharing prefixes), steps with drafts accepted or rejected, chunked prefill, preemption under
block pressure, aborts, local prefix-cache resets, tier resets and settling the copy thread.
The stores run either on the real copy thread or, replayably, at points a schedule seeded by
hypothesis picks (between lookups, pins, the saves of one snapshot pass, fetches): there the
interleaving is part of the drawn example, so hypothesis explores and shrinks it.
Checked:
- after every step: pool integrity; every scheduled request's computed positions hold what a
  cold run writes (target KV, and draft KV where lookahead hashes promise it);
- on every hit (local or from a tier): each hit slot holds the KV a cold run would write;
- every block a tier stores or serves holds the KV its header (hash, tokens, lookahead) names.
"""

from __future__ import annotations

import random
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy
from speckv.cache.specs import MambaSpec, SlidingWindowSpec
from speckv.connectors import ConnectorConfig, TierIdentity, make_connector
from speckv.connectors.host_pool import GIB
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.engine.speculative import resolve_connector_hash_mode
from speckv.simulation import PagedSymbolicKV, instrument_tiers, toy_core
from tests.patience import WATCHDOG_S

PREFIXES = [[random.Random(seed).randrange(1, 50) for _ in range(24)] for seed in range(3)]


class _TierRules(RuleBasedStateMachine):
    """The rules and invariants; each machine below draws its own set-up."""

    def _build(self, tiers, specs, num_blocks, tier_blocks, drafter, num_spec_tokens,
               fault_rate, token_budget, max_num_seqs, seed, copy_seed):
        name, modules, legacy = drafter
        policy = drafter_policy(name, modules)
        depth = policy.draft_kv_lookahead_tokens
        block_size = specs[0].block_size
        self.kv = PagedSymbolicKV(num_blocks, block_size, depth)
        self.directory = tempfile.mkdtemp(prefix="speckv-tier-machine-")
        block_bytes = 4 * (self.kv.target_cache.storage[:, :, 0].numel()
                           + self.kv.draft_cache.storage[:, :, 0].numel())
        # a hybrid layout splits the capacity over its groups' lanes (by bytes per token)
        size_gib = (tier_blocks + 0.5) * block_bytes * len(specs) / GIB
        config = ConnectorConfig.parse(tiers, offload_gib=size_gib, offload_dir=self.directory,
                                       disk_gib=size_gib, max_pending_blocks=8)
        self.connector = make_connector(config, TierIdentity("machine", "sha256", "0"))
        # copy_seed None: the real copy thread; else a replayable seeded copy schedule
        self.stores = instrument_tiers(self.connector, depth, fault_rate=fault_rate, seed=seed,
                                       copy_seed=copy_seed)
        self.mode = resolve_connector_hash_mode(policy, connector=self.connector,
                                                disable_lookahead_block_hashes=legacy)
        self.manager = KVCacheManager(specs, num_blocks, self.mode)
        self.hashing = self.manager.block_hashing("sha256", "0")
        num_spec = num_spec_tokens if depth else 0
        self.core = toy_core(
            self.manager, num_spec, vocab_size=50, kv=self.kv,
            check_draft_kv=not self.mode.drops_last_unit,
            max_num_batched_tokens=max(token_budget, 1 + num_spec), max_num_seqs=max_num_seqs,
            connector=self.connector, check_computed_kv=True,
        )
        self.counter = 0
        self.prompts: list[list[int]] = []

    def teardown(self):
        if hasattr(self, "connector"):
            self.connector.shutdown()
            shutil.rmtree(self.directory, ignore_errors=True)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), prefix_len=st.integers(1, 24),
          suffix=st.lists(st.integers(1, 49), max_size=6), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, prefix_len, suffix, max_tokens):
        self._add(PREFIXES[prefix][:prefix_len] + suffix, max_tokens)

    @precondition(lambda self: self.prompts)
    @rule(pick=st.integers(0, 100), max_tokens=st.integers(1, 6))
    def repeat_request(self, pick, max_tokens):
        """An earlier prompt again: what the tiers hold is for this."""
        self._add(self.prompts[pick % len(self.prompts)], max_tokens)

    def _add(self, prompt, max_tokens):
        self.counter += 1
        self.prompts.append(prompt)
        self.core.scheduler.add_request(
            Request(f"r{self.counter}", prompt, self.hashing, max_tokens=max_tokens))

    # No precondition on unfinished requests here or on `abort`: whether requests are still
    # running depends on the tiers' copy thread, and hypothesis needs the rules it may draw to
    # depend only on the drawn data. With nothing to run, both rules do nothing.
    @rule(num_accept=st.integers(0, 3), num_steps=st.integers(1, 6))
    def step(self, num_accept, num_steps):
        if not self.core.scheduler.has_unfinished_requests():
            return
        self.core.runner.num_accept = num_accept
        cut_before = self.core.runner.num_cut
        for _ in range(num_steps):
            if not self.core.scheduler.has_unfinished_requests():
                break
            for output in self.core.step():
                if output.num_external_cached_tokens:
                    note_event("a hit came from a tier")
                if output.num_preemptions:
                    note_event("a request was preempted")
            self.sound()  # after every step, not only after the rule
        if self.core.runner.num_cut > cut_before:
            note_event("a load failed and was recomputed")

    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = sorted(self.core.scheduler.requests)
        if not ids:
            return
        self.core.scheduler.finish_requests([ids[pick % len(ids)]], FinishReason.ABORT)

    @rule(tiers_too=st.sampled_from([False, False, False, True]))
    def reset(self, tiers_too):
        self.manager.reset_prefix_cache()
        if tiers_too:
            self.connector.reset_cache()

    @rule()
    def settle(self):
        assert self.connector.flush(timeout_s=WATCHDOG_S)

    @invariant()
    def sound(self):
        if hasattr(self, "manager"):
            self.manager.check_integrity()
            for store in self.stores:
                assert not store.violations, store.violations[0]


DRAFTERS = st.sampled_from([("eagle", 1, False), ("mtp", 2, False), ("eagle", 1, True),
                            ("none", 1, False)])
TIERS = st.sampled_from(["offload", "disk", "offload,disk", "offload-nolookahead"])
# what both machines draw besides the layout: tier size, drafter, faults, batching, seeds
RUN_STRATEGIES = dict(
    tier_blocks=st.integers(2, 40),
    drafter=DRAFTERS,
    num_spec_tokens=st.integers(0, 3),
    fault_rate=st.sampled_from([0.0, 0.5]),
    token_budget=st.sampled_from([5, 8, 16, 1024]),
    max_num_seqs=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    copy_seed=st.none() | st.integers(0, 2**16),
)


class TierMachine(_TierRules):
    @initialize(
        tiers=TIERS,
        block_size=st.sampled_from([2, 3, 4]),
        num_blocks=st.integers(8, 24),
        **RUN_STRATEGIES,
    )
    def setup(self, tiers, block_size, num_blocks, **kwargs):
        self._build(tiers, [FullAttentionSpec(block_size)], num_blocks, **kwargs)


class HybridTierMachine(_TierRules):
    """The same over hybrid layouts: a sliding window (its tail), a Mamba / GDN state (its
    checkpoints), or both, beside full attention; every group's symbolic KV in tensors the
    tiers' lanes copy, and every group checked on every hit and after every step."""

    @initialize(
        tiers=TIERS,
        block_size=st.sampled_from([2, 4]),
        layout=st.sampled_from(["swa", "mamba", "swa,mamba"]),
        window=st.integers(2, 9),
        unit_blocks=st.sampled_from([1, 2, 3]),
        num_blocks=st.integers(12, 30),
        **RUN_STRATEGIES,
    )
    def setup(self, tiers, block_size, layout, window, unit_blocks, num_blocks, **kwargs):
        specs = [FullAttentionSpec(block_size)]
        if "swa" in layout:
            specs.append(SlidingWindowSpec(block_size, window))
        if "mamba" in layout:
            specs.append(MambaSpec(block_size * unit_blocks))
        self._build(tiers, specs, num_blocks * len(specs), **kwargs)


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(
    max_examples=100, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestHybridTierMachine = HybridTierMachine.TestCase
TestHybridTierMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
