"""The lookahead capability rule for every combination, and the engine hash mode from it."""

from __future__ import annotations

import pytest

from speckv.cache.drafter_policy import drafter_policy
from speckv.connectors import (
    ConnectorMode,
    DiskConnector,
    KVGroupSupport,
    MultiConnector,
    NoLookaheadOffloadConnector,
    OffloadConnector,
    kv_group_blocker,
    lookahead_blocker,
    supports_lookahead,
)
from speckv.connectors.capability import EVERY_GROUP, SINGLE_FULL_ATTENTION
from speckv.engine.speculative import resolve_connector_hash_mode


def _disk(tmp_path):
    return DiskConnector(tmp_path, 1.0, model_fingerprint="m", hash_algo="sha256",
                         hash_seed="0")


def _build(spec: str, tmp_path):
    """'o' offload, 'd' disk, 'n' no-lookahead offload; '[...]' a multi-connector."""
    stack: list[list] = [[]]
    for char in spec:
        if char == "[":
            stack.append([])
        elif char == "]":
            children = stack.pop()
            stack[-1].append(MultiConnector(children, name=f"multi{len(stack)}{len(children)}"))
        else:
            stack[-1].append({"o": lambda: OffloadConnector(1.0),
                              "d": lambda: _disk(tmp_path),
                              "n": lambda: NoLookaheadOffloadConnector(1.0)}[char]())
    (connector,) = stack[0]
    return connector


@pytest.mark.parametrize(("spec", "allowed"), [
    ("o", True),
    ("d", True),
    ("n", False),
    ("[]", False),  # an empty multi-connector
    ("[o]", True),
    ("[d]", True),
    ("[n]", False),
    ("[od]", True),
    ("[do]", True),
    ("[on]", False),
    ("[no]", False),
    ("[dn]", False),
    ("[odn]", False),
    ("[[od]]", True),
    ("[[o]d]", True),
    ("[[n]o]", False),
    ("[[]o]", False),  # a nested empty multi-connector
    ("[o[d[o]]]", True),
    ("[o[d[n]]]", False),
])
def test_the_capability_rule(spec, allowed, tmp_path):
    connector = _build(spec, tmp_path)
    assert supports_lookahead(connector) is allowed
    assert connector.supports_lookahead_block_hashes is allowed
    assert (lookahead_blocker(connector) is None) is allowed


def test_no_connector_puts_no_restriction():
    assert supports_lookahead(None)


@pytest.mark.parametrize(("drafter", "modules", "spec", "label", "reason_part"), [
    ("eagle", 1, "o", "lookahead L=1", "eagle draft KV"),
    ("eagle3", 1, "[od]", "lookahead L=1", "eagle3 draft KV"),
    ("mtp", 2, "[od]", "lookahead L=2", "mtp draft KV"),
    ("eagle", 1, "n", "legacy+drop", "'offload-nolookahead' does not support"),
    ("mtp", 3, "[on]", "legacy+drop", "'offload-nolookahead' does not support"),
    ("eagle", 1, "[]", "legacy+drop", "has no connectors"),
    ("none", 1, "n", "legacy", "no draft KV to cover"),  # nothing to drop without draft KV
    ("ngram", 1, "[]", "legacy", "writes no draft KV"),
])
def test_the_engine_hash_mode(drafter, modules, spec, label, reason_part, tmp_path):
    mode = resolve_connector_hash_mode(drafter_policy(drafter, modules),
                                       connector=_build(spec, tmp_path))
    assert mode.label == label
    assert reason_part in mode.reason


def test_the_settings_still_win():
    eagle = drafter_policy("eagle")
    mode = resolve_connector_hash_mode(eagle, disable_lookahead_block_hashes=True,
                                       connector=OffloadConnector(1.0))
    assert mode.label == "legacy+drop" and "disable_lookahead_block_hashes" in mode.reason
    mode = resolve_connector_hash_mode(eagle, enable_prefix_caching=False,
                                       connector=NoLookaheadOffloadConnector(1.0))
    assert mode.label == "legacy" and "prefix caching is off" in mode.reason
    assert resolve_connector_hash_mode(eagle).label == "lookahead L=1"


def test_the_connector_mode_follows_the_hash_mode():
    eagle = drafter_policy("mtp", 2)
    lookahead = ConnectorMode.from_hash_mode(resolve_connector_hash_mode(eagle), 16)
    assert (lookahead.lookahead_tokens, lookahead.drops_last_block) == (2, False)
    legacy = ConnectorMode.from_hash_mode(
        resolve_connector_hash_mode(eagle, connector=NoLookaheadOffloadConnector(1.0)), 16)
    assert (legacy.lookahead_tokens, legacy.drops_last_block) == (0, True)
    with pytest.raises(ValueError, match="exclusive"):
        ConnectorMode(1, True, 16)


class _HybridTier:
    """A connector declaring that it carries every group kind (what a hybrid tier opts in to)."""

    name = "hybrid-tier"
    kv_group_support = KVGroupSupport(
        frozenset({"full_attention", "sliding_window", "mamba"}), multiple_groups=True)


class _OneGroupTier:
    """A connector that keeps the default: one full-attention group."""

    name = "one-group"
    kv_group_support = SINGLE_FULL_ATTENTION


@pytest.mark.parametrize(("kinds", "reason"), [
    (["full_attention"], None),
    (["full_attention", "mamba"], "'one-group' carries one KV cache group; this model has 2"),
    (["sliding_window"], "'one-group' does not carry sliding_window KV cache groups"),
])
def test_kv_group_capability_names_the_connector_that_cannot_carry_a_group(kinds, reason):
    assert kv_group_blocker(None, kinds) is None
    offload = _OneGroupTier()
    blocker = kv_group_blocker(offload, kinds)
    assert (blocker is None) == (reason is None) and (reason is None or reason in blocker)
    # a multi-connector is as capable as its least capable child
    multi = MultiConnector([offload])
    assert kv_group_blocker(multi, kinds) == blocker
    hybrid = MultiConnector.__new__(MultiConnector)
    hybrid.children = (_HybridTier(),)
    assert kv_group_blocker(hybrid, kinds) is None
    hybrid.children = (_HybridTier(), offload)
    assert kv_group_blocker(hybrid, kinds) == blocker


def test_request_blocks_carry_every_groups_table():
    from speckv.connectors import RequestBlocks

    one = RequestBlocks(object(), [1, 2], 8)
    assert one.groups == ([1, 2],) and one.released(1) == ()
    table = [1, 2]
    two = RequestBlocks(object(), table, 8, (table, [0, 5]), ((), ((0, 4),)))
    assert two.groups[1] == [0, 5] and two.released(1) == ((0, 4),)
    with pytest.raises(ValueError, match="group_block_ids"):
        RequestBlocks(object(), [1, 2], 8, ([3], [0, 5]))


@pytest.mark.parametrize("kinds", [["full_attention", "mamba"],
                                   ["full_attention", "sliding_window"],
                                   ["full_attention", "sliding_window", "mamba"]])
def test_the_tiers_carry_every_group_of_a_hybrid_model(kinds, tmp_path):
    for tier in (OffloadConnector(1.0), _disk(tmp_path), NoLookaheadOffloadConnector(1.0),
                 MultiConnector([OffloadConnector(1.0), _disk(tmp_path)], name="m")):
        assert tier.kv_group_support == EVERY_GROUP
        assert kv_group_blocker(tier, kinds) is None
    multi = MultiConnector([OffloadConnector(1.0), _OneGroupTier()])
    assert multi.kv_group_support == SINGLE_FULL_ATTENTION
    assert "'one-group' carries one KV cache group" in kv_group_blocker(multi, kinds)
