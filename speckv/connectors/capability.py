"""The lookahead capability rule: may this engine use lookahead block hashes with its connector?

Owns the rule the engine applies once at start-up:
- no connector: no restriction;
- a connector: only if it declares `supports_lookahead_block_hashes`;
- a multi-connector: only if it has at least one child and every child (recursively) does.

When the rule says no, the whole engine (local cache included) uses legacy hashes with the
last-block drop, and every connector follows the drop in its own lookup and store
(`rules.py`). The engine turns this rule and its drafter into its `HashMode`
(`speckv.engine.speculative.resolve_connector_hash_mode`), naming the connector at fault in the
reason it prints at start-up.
"""

from __future__ import annotations

from typing import Any


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
