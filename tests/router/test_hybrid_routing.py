"""The router on hybrid engines: a contract with sliding-window and Mamba / GDN groups is read,
every group's events (Mamba checkpoints over a coarser block included) verify, and the
predicted hit equals the one the engine's cache manager serves, prompt by prompt, while the
cache fills, evicts, drops the last unit and keeps retention boundaries only."""

from __future__ import annotations

import random

import pytest

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.events import KVEventSink
from speckv.cache.specs import parse_group_specs
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.events.schema import to_wire_batch
from speckv.router.contract import ContractError, parse_contract
from speckv.router.index import RouterIndex
from speckv.simulation import SymbolicKV, toy_core
from tests.router.test_contract import URL, contract_body


def hybrid_contract(manager):
    mode = manager.hash_mode
    groups = [{"kind": m.group.kind, "block_size": m.group.block_size,
               "sliding_window": m.group.sliding_window,
               "lookahead_tokens": m.group.lookahead_tokens} for m in manager.managers]
    return parse_contract("a", URL, contract_body(
        block_size=manager.hash_block_size, alignment_tokens=manager.alignment_tokens,
        kv_groups=groups,
        hash_mode={"label": mode.label, "lookahead_tokens": mode.lookahead_tokens,
                   "drops_last_unit": mode.drops_last_unit, "reason": ""}))


def predicted(index, contract, prompt):
    rule = contract.hit_rule
    chains = {L: index.prompt_hashes("a", prompt, _no_inputs(), lookahead_tokens=L)
              for L in rule.lookahead_values}
    return rule.hybrid_cached_tokens(chains, lambda g, h: index.holds("a", g, h), len(prompt))


def _no_inputs():
    from speckv.hashing.extra_keys import NO_HASH_INPUTS

    return NO_HASH_INPUTS


@pytest.mark.parametrize("groups,drafter,legacy,retention", [
    ("full:4,swa:9:4,mamba:16", "eagle", False, None),
    ("full:4,swa:9:4,mamba:16", "mtp", False, 32),
    ("full:4,mamba:8", "eagle", True, None),
    ("full:4,swa:6:4", "none", False, 0),
])
def test_predicted_hybrid_hits_equal_the_served_ones(groups, drafter, legacy, retention):
    policy = drafter_policy(drafter, 2 if drafter == "mtp" else 1)
    mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=legacy)
    sink = KVEventSink()
    specs = parse_group_specs(groups)
    manager = KVCacheManager(specs, 90, mode, event_sink=sink, retention_interval=retention)
    hashing = manager.block_hashing("sha256", "0")
    contract = hybrid_contract(manager)
    assert contract.hit_rule.is_hybrid
    index = RouterIndex({"a": contract.hashing})
    num_spec = 2 if drafter != "none" else 0
    core = toy_core(manager, num_spec, vocab_size=50,
                    kv=SymbolicKV(90, 4, policy.draft_kv_lookahead_tokens),
                    check_draft_kv=not mode.drops_last_unit)
    rng = random.Random(0)
    prefixes = [[rng.randrange(1, 50) for _ in range(70)] for _ in range(3)]
    num_nonzero = 0
    for step in range(120):
        prefix = prefixes[rng.randrange(3)]
        prompt = prefix[:rng.randrange(1, 70)] + [rng.randrange(1, 50)
                                                  for _ in range(rng.randrange(3))]
        request = Request(f"r{step}", prompt, hashing, max_tokens=rng.randrange(1, 6))
        index.apply_batch("a", to_wire_batch(sink.take()))
        served = manager.get_computed_blocks(request).num_computed_tokens
        assert predicted(index, contract, prompt) == served, (step, len(prompt))
        num_nonzero += served > 0
        core.scheduler.add_request(request)
        while core.scheduler.has_unfinished_requests():
            for output in core.step():
                assert output.finish_reason is not FinishReason.ERROR
    stats = index.stats()["a"]
    assert stats["mismatched_blocks"] == stats["unverifiable_blocks"] == 0
    assert stats["verified_blocks"] == stats["stored_blocks"] > 0
    assert num_nonzero >= 20  # the comparison covered real hits, not only misses


def test_a_hybrid_group_the_router_cannot_predict_is_refused():
    body = contract_body(alignment_tokens=16, kv_groups=[
        {"kind": "full_attention", "block_size": 4, "lookahead_tokens": 1},
        {"kind": "mamba", "block_size": 16, "lookahead_tokens": 1}])
    with pytest.raises(ContractError, match="group 1 \\(mamba\\) lookahead 1 != 0"):
        parse_contract("a", URL, body)
    body["kv_groups"][1] = {"kind": "cross_attention", "block_size": 4}
    with pytest.raises(ContractError, match="kind 'cross_attention'"):
        parse_contract("a", URL, body)
    body["kv_groups"][1] = {"kind": "mamba", "block_size": 6, "lookahead_tokens": 0}
    with pytest.raises(ContractError, match="not a multiple of the hash unit 4"):
        parse_contract("a", URL, body)
