"""Routing policies on engine views: the kv cost follows the cached prefix within the load
cap, spills past it, equal engines take turns; round-robin and least-loaded."""

from __future__ import annotations

from collections import Counter

import pytest

from speckv.router.policy import EngineView, Policy, ScoringConfig, kv_cost


def views(*specs):
    return [EngineView(name, cached, load, kv) for name, cached, load, kv in specs]


def test_kv_follows_the_cached_prefix():
    policy = Policy("kv")
    decision = policy.choose(views(("a", 0, 0, 0.0), ("b", 96, 1, 0.1)), 128)
    assert (decision.engine, decision.reason) == ("b", "prefix")
    assert decision.costs["b"] == kv_cost(EngineView("b", 96, 1, 0.1), 128, ScoringConfig())


def test_a_hot_prefix_spills_past_the_load_cap():
    policy = Policy("kv", ScoringConfig(max_imbalance=2))
    # b holds the prefix but has 3 more requests than a: over the cap
    decision = policy.choose(views(("a", 0, 0, 0.0), ("b", 120, 3, 0.0)), 128)
    assert (decision.engine, decision.reason) == ("a", "spill")
    decision = policy.choose(views(("a", 0, 0, 0.0), ("b", 120, 2, 0.0)), 128)
    assert (decision.engine, decision.reason) == ("b", "prefix")


def test_load_outweighs_a_short_hit():
    policy = Policy("kv", ScoringConfig(request_load_tokens=64))
    # 8 cached tokens do not pay for two more queued requests
    decision = policy.choose(views(("a", 8, 2, 0.0), ("b", 0, 0, 0.0)), 64)
    assert (decision.engine, decision.reason) == ("b", "load")


def test_equal_engines_take_turns():
    policy = Policy("kv")
    picks = Counter(policy.choose(views(("a", 0, 0, 0.0), ("b", 0, 0, 0.0)), 50).engine
                    for _ in range(10))
    assert picks == {"a": 5, "b": 5}
    # a decision without a tie does not take a turn: cold requests between hits alternate
    cold, hot = views(("a", 0, 0, 0.0), ("b", 0, 0, 0.0)), views(("a", 40, 0, 0), ("b", 0, 0, 0))
    picks = [(policy.choose(cold, 50).engine, policy.choose(hot, 50).engine)[0]
             for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_round_robin_least_loaded_and_edge_cases():
    rr = Policy("round-robin")
    assert [rr.choose(views(("a", 9, 5, 0), ("b", 0, 0, 0)), 9).engine for _ in range(4)] == \
        ["a", "b", "a", "b"]
    ll = Policy("least-loaded")
    assert ll.choose(views(("a", 9, 2, 0), ("b", 0, 1, 0.9), ("c", 0, 1, 0.1)), 9).engine == "c"
    assert Policy("kv").choose([], 9) is None
    assert Policy("kv").choose(views(("a", 0, 9, 1.0)), 9).reason == "only-engine"
    with pytest.raises(ValueError, match="--policy"):
        Policy("random")
    with pytest.raises(ValueError, match="--max-imbalance"):
        ScoringConfig(max_imbalance=-1)
