"""Hypothesis state machine: the real scheduler and cache manager over a fake remote engine.

The toy runner keeps its symbolic KV in real paged tensors. `FakeRemoteConnector` sends every
finished request's blocks to a shared dict with `delay_free` (its blocks stay held for a drawn
number of steps) and loads what the dict holds beyond the local hit asynchronously
(WAITING_FOR_REMOTE_KVS, landing a drawn number of steps later), with load failures injected at
random under either failure policy. Random interleavings of new and repeated requests (shared
prefixes), steps with drafts accepted or rejected, chunked prefill, preemption under block
pressure, aborts (also while a load runs) and local prefix-cache resets.
Checked after every step: pool integrity; no block a transfer still reads or writes is free;
every hit slot (local or loaded) and every computed position holds what a cold run writes.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import event as note_event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request, RequestStatus
from speckv.engine.speculative import resolve_connector_hash_mode
from speckv.simulation import PagedSymbolicKV, toy_core
from tests.doubles.remote import FakeRemoteConnector, RemoteBlocks

PREFIXES = [[random.Random(seed).randrange(1, 50) for _ in range(24)] for seed in range(3)]


class RemoteMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([2, 3, 4]),
        num_blocks=st.integers(10, 24),
        drafter=st.sampled_from([("eagle", 1, False), ("mtp", 2, False), ("eagle", 1, True)]),
        num_spec_tokens=st.integers(0, 3),
        max_load_steps=st.integers(0, 4),
        send_steps=st.integers(0, 4),
        fail_rate=st.sampled_from([0.0, 0.3]),
        policy=st.sampled_from(["recompute", "fail"]),
        token_budget=st.sampled_from([5, 8, 1024]),
        max_num_seqs=st.integers(1, 4),
        seed=st.integers(0, 2**16),
    )
    def setup(self, block_size, num_blocks, drafter, num_spec_tokens, max_load_steps,
              send_steps, fail_rate, policy, token_budget, max_num_seqs, seed):
        name, modules, legacy = drafter
        drafting = drafter_policy(name, modules)
        depth = drafting.draft_kv_lookahead_tokens
        self.kv = PagedSymbolicKV(num_blocks, block_size, depth)
        self.connector = FakeRemoteConnector(
            RemoteBlocks(), seed=seed, max_load_steps=max_load_steps, send_on_finish=True,
            send_steps=send_steps, fail_rate=fail_rate)
        self.mode = resolve_connector_hash_mode(drafting, connector=self.connector,
                                                disable_lookahead_block_hashes=legacy)
        self.manager = KVCacheManager([FullAttentionSpec(block_size)], num_blocks, self.mode)
        self.hashing = self.manager.block_hashing("sha256", "0")
        num_spec = num_spec_tokens if depth else 0
        self.core = toy_core(
            self.manager, num_spec, vocab_size=50, kv=self.kv,
            check_draft_kv=not self.mode.drops_last_unit,
            max_num_batched_tokens=max(token_budget, 1 + num_spec), max_num_seqs=max_num_seqs,
            connector=self.connector, check_computed_kv=True, load_failure_policy=policy,
        )
        self.counter = 0
        self.prompts: list[list[int]] = []

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), prefix_len=st.integers(1, 24),
          suffix=st.lists(st.integers(1, 49), max_size=6), max_tokens=st.integers(1, 6))
    def add_request(self, prefix, prefix_len, suffix, max_tokens):
        self._add(PREFIXES[prefix][:prefix_len] + suffix, max_tokens)

    @rule(pick=st.integers(0, 100), max_tokens=st.integers(1, 6))
    def repeat_request(self, pick, max_tokens):
        """An earlier prompt again: what the remote side holds is for this."""
        if self.prompts:
            self._add(self.prompts[pick % len(self.prompts)], max_tokens)

    def _add(self, prompt, max_tokens):
        self.counter += 1
        self.prompts.append(prompt)
        self.core.scheduler.add_request(
            Request(f"r{self.counter}", prompt, self.hashing, max_tokens=max_tokens))

    @rule(num_accept=st.integers(0, 3), num_steps=st.integers(1, 6))
    def step(self, num_accept, num_steps):
        self.core.runner.num_accept = num_accept
        for _ in range(num_steps):
            if not self.core.scheduler.has_unfinished_requests():
                break
            for output in self.core.step():
                if output.num_external_cached_tokens:
                    note_event("a hit was loaded asynchronously")
                if output.error:
                    note_event("a failed load ended its request")
            if any(request.status is RequestStatus.WAITING_FOR_REMOTE_KVS
                   for request in self.core.scheduler.requests.values()):
                note_event("a step ran while a load was in flight")
            if self.core.scheduler.num_held_requests:
                note_event("a step ran while finished blocks were held")
            self.sound()  # after every step, not only after the rule

    @rule(pick=st.integers(0, 100))
    def abort(self, pick):
        ids = sorted(self.core.scheduler.requests)
        if not ids:
            return
        request_id = ids[pick % len(ids)]
        if request_id in self.connector.receiving:
            note_event("an abort while its load ran")
        self.core.scheduler.finish_requests([request_id], FinishReason.ABORT)

    @rule()
    def reset(self):
        self.manager.reset_prefix_cache()

    @rule()
    def drain(self):
        """Step until everything finished and every transfer settled: all blocks free."""
        self.core.runner.num_accept = 1
        for _ in range(400):
            if not self.core.scheduler.has_unfinished_requests():
                break
            self.core.step()
            self.sound()
        assert not self.core.scheduler.has_unfinished_requests()
        assert self.core.scheduler.num_held_requests == 0
        assert self.manager.get_num_free_blocks() == self.manager.pool.num_blocks - 1

    @invariant()
    def sound(self):
        if not hasattr(self, "manager"):
            return
        self.manager.check_integrity()
        pool = self.manager.pool
        for block_id in self.connector.sending_block_ids():
            assert pool.blocks[block_id].ref_cnt > 0, f"block {block_id} freed while sent"
        for request_id in self.connector.receiving:
            for block_id in self.manager.get_block_ids(request_id)[0]:
                assert pool.blocks[block_id].ref_cnt > 0, f"block {block_id} freed while loaded"


TestRemoteMachine = RemoteMachine.TestCase
TestRemoteMachine.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
