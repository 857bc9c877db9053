"""The connector capability rules: lookahead block hashes, and the KV cache groups it carries.

Owns the rule the engine applies once at start-up:
- no connector: no restriction;
- a connector: only if it declares `supports_lookahead_block_hashes`;
- a multi-connector: only if it has at least one child and every child (recursively) does.

When the rule says no, the whole engine (local cache included) uses legacy hashes with the
last-block drop, and every connector follows the drop in its own lookup and store
(`rules.py`). The engine turns this rule and its drafter into its `HashMode`
(`speckv.engine.speculative.resolve_connector_hash_mode`), naming the connector at fault in the
reason it prints at start-up.

The KV cache groups: a hit a tier serves must be one every group of the model can serve
(full attention, sliding window, Mamba / GDN state), so a connector says which groups it
carries (`KVConnector.kv_group_support`: the kinds, and whether it carries several groups at
once). `kv_group_blocker` names the first connector (children of a multi-connector included)
that cannot carry a model's groups; the engine refuses such a connector at start-up with that
reason, never serving a silently shorter or wrong hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KVGroupSupport:
    """The KV cache groups a connector can store and load."""

    kinds: frozenset[str] = frozenset({"full_attention"})
    multiple_groups: bool = False  # several groups at once (a hybrid model)


SINGLE_FULL_ATTENTION = KVGroupSupport()
EVERY_GROUP = KVGroupSupport(frozenset({"full_attention", "sliding_window", "mamba"}), True)


def _children(connector: Any) -> tuple[Any, ...] | None:
    children = getattr(connector, "children", None)
    return tuple(children) if children is not None else None


def lookahead_blocker(connector: Any | None) -> str | None:
    """Why `connector` rules out lookahead hashes (None: it does not)."""
    if connector is None:
        return None
    children = _children(connector)
    name = getattr(connector, "name", type(connector).__name__)
    if children is not None:
        if not children:
            return f"the multi-connector {name!r} has no connectors"
        for child in children:
            reason = lookahead_blocker(child)
            if reason is not None:
                return reason
        return None
    if not connector.supports_lookahead_block_hashes:
        return f"the KV connector {name!r} does not support lookahead block hashes"
    return None


def supports_lookahead(connector: Any | None) -> bool:
    """The capability rule; `connector` is any object with `supports_lookahead_block_hashes`
    (and `children` for a multi-connector), or None."""
    return lookahead_blocker(connector) is None


def kv_group_blocker(connector: Any | None, group_kinds: Sequence[str]) -> str | None:
    """Why `connector` cannot carry a model whose KV cache groups are `group_kinds` (one kind
    per group, e.g. ["full_attention", "mamba"]); None: it can (or there is no connector)."""
    if connector is None:
        return None
    children = _children(connector)
    if children is not None:
        for child in children:
            reason = kv_group_blocker(child, group_kinds)
            if reason is not None:
                return reason
        return None
    name = getattr(connector, "name", type(connector).__name__)
    support: KVGroupSupport = getattr(connector, "kv_group_support", SINGLE_FULL_ATTENTION)
    if len(group_kinds) > 1 and not support.multiple_groups:
        return (f"the KV connector {name!r} carries one KV cache group; this model has "
                f"{len(group_kinds)} ({', '.join(group_kinds)})")
    missing = sorted(set(group_kinds) - support.kinds)
    if missing:
        return (f"the KV connector {name!r} does not carry {', '.join(missing)} KV cache "
                f"groups (it carries {', '.join(sorted(support.kinds))})")
    return None
