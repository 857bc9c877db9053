"""The router's prediction on an engine that reuses divergent blocks (lookahead hashes, an EAGLE
drafter), against the real cache manager and scheduler: the predicted hit equals the served one
prompt by prompt, when two cached blocks after one parent share their first L tokens and differ
later (the engine's index is keyed by content), and for a request routed while the block it
copies is still in flight (its KV events not yet in: the routed prompt's blocks are pending)."""

from __future__ import annotations

import random

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.events import KVEventSink
from speckv.cache.specs import parse_group_specs
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.events.schema import to_wire_batch
from speckv.router.contract import parse_contract
from speckv.router.fleet import EngineLink, EngineSpec, Fleet
from speckv.router.tokenizer import TokenizerCache
from speckv.simulation import SymbolicKV, toy_core
from tests.router.test_contract import URL, contract_body

B = 4


def engine_and_fleet():
    """A real cache manager + scheduler (blocks of 4, EAGLE, reuse on) and a fleet whose one
    engine has its contract."""
    policy = drafter_policy("eagle", 1)
    mode = resolve_hash_mode(policy)
    assert mode.reuses_divergent_blocks and mode.lookahead_tokens == 1
    sink = KVEventSink()
    manager = KVCacheManager(parse_group_specs(f"full:{B}"), 48, mode, event_sink=sink)
    core = toy_core(manager, 2, vocab_size=50,
                    kv=SymbolicKV(48, B, policy.draft_kv_lookahead_tokens))
    link = EngineLink(EngineSpec("a", URL), parse_contract(
        "a", URL, contract_body(divergent_block_reuse=True)))
    assert link.contract.hit_rule.reuses_divergent_blocks
    return manager, sink, core, Fleet([link], TokenizerCache()), link


def run_to_end(core, request) -> None:
    core.scheduler.add_request(request)
    while core.scheduler.has_unfinished_requests():
        for output in core.step():
            assert output.finish_reason is not FinishReason.ERROR


def test_predicted_hits_equal_served_ones_with_divergent_block_reuse():
    manager, sink, core, fleet, link = engine_and_fleet()
    hashing = manager.block_hashing("sha256", "0")
    rng = random.Random(3)
    # few distinct tokens: blocks after one parent often share their first token (the
    # successor that names the parent) and differ later
    prefixes = [[rng.randrange(1, 4) for _ in range(40)] for _ in range(3)]
    num_reused = num_nonzero = 0
    for step in range(150):
        prefix = prefixes[rng.randrange(3)]
        cut = rng.randrange(2, 40)
        prompt = prefix[:cut] + [rng.randrange(1, 4) for _ in range(rng.randrange(1, 9))]
        fleet.apply(link, 0, step, to_wire_batch(sink.take()))
        request = Request(f"r{step}", prompt, hashing, max_tokens=rng.randrange(1, 4))
        served = manager.get_computed_blocks(request).num_computed_tokens
        plan = fleet.plan(prompt, ["a"])["a"]
        assert (plan.published_cached_tokens, plan.predicted_cached_tokens) == \
            (served, served), (step, prompt)
        num_nonzero += served > 0
        num_reused += served % B == B - 1  # a copied block: U - L of it
        run_to_end(core, request)
    assert link.apply_errors == 0
    stats = fleet.index.stats()["a"]
    assert stats["mismatched_blocks"] == 0 and stats["verified_blocks"] > 0
    assert num_reused >= 10 and num_nonzero >= 60  # real copies and real hits were compared


def test_a_block_in_flight_is_predicted_as_copied():
    """Request A is routed and computed, its events not yet in; B shares A's blocks and its
    block j's tokens but not the successor that names block j: the engine copies A's block j,
    and the router, counting A's routed blocks as pending, predicts that copy."""
    manager, sink, core, fleet, link = engine_and_fleet()
    hashing = manager.block_hashing("sha256", "0")
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]  # 3 blocks
    first, second = shared + [20, 21, 22], shared + [30, 31, 32]
    plan = fleet.plan(first, ["a"])["a"]
    assert plan.predicted_cached_tokens == 0
    fleet.routed("a", plan)
    run_to_end(core, Request("A", first, hashing, max_tokens=2))
    request = Request("B", second, hashing, max_tokens=2)
    served = manager.get_computed_blocks(request).num_computed_tokens
    # blocks 0-1 hit by hash; block 2 (successor 20 vs 30) is copied: 8 + 4 - 1
    assert served == 11
    later = fleet.plan(second, ["a"])["a"]
    assert (later.published_cached_tokens, later.predicted_cached_tokens) == (0, served)
    fleet.finished("a", plan, 1)
    fleet.apply(link, 0, 0, to_wire_batch(sink.take()))  # the events arrive: now confirmed
    later = fleet.plan(second, ["a"])["a"]
    assert (later.published_cached_tokens, later.predicted_cached_tokens) == (served, served)
    assert fleet.index.state["a"].pending_successors == {}
