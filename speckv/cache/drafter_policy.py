"""Drafter policies: one table from drafter name to what its draft KV depends on.

Owns `DRAFTER_LOOKAHEAD`, the single table of drafters, and `resolve_hash_mode`, which turns a
drafter's policy, the prefix-caching setting, `disable_lookahead_block_hashes` and the KV
connector's capability into the one `HashMode` the cache follows.
It lives in the cache layer, beside `HashMode`, because the engine and the vLLM plugin
(`speckv.integrations.vllm`, which imports no engine layer) both decide the hash mode here.

A drafter writes its draft KV at position `p` either from tokens after `p` (EAGLE-style: L
tokens, one per module) or not at all from later tokens (L = 0). That one number decides both
the lookahead hashes (L successors hashed) and the legacy behaviour (drop the last unit iff
L > 0):

| drafter                          | draft KV at p from          | L with lookahead | legacy      |
|----------------------------------|-----------------------------|------------------|-------------|
| none, ngram, draft_model         | nothing after p             | 0                | no drop     |
| eagle, eagle3, mtp (1 module)    | token p + 1                 | 1                | drop a unit |
| mtp (k modules)                  | tokens up to p + k          | k                | drop a unit |
| dflash, dspark                   | target hidden states only   | 0                | no drop     |
| gemma4_mtp (writes no draft KV)  | nothing (reads target KV)   | 0                | no drop     |

`draft_model` is a separate small LM (its KV is plain causal over the same tokens), not an
EAGLE/MTP head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from speckv.cache.hash_mode import HashMode

# Lookahead tokens per draft module (mtp: per module, times its module count).
DRAFTER_LOOKAHEAD: dict[str, int] = {
    "none": 0,
    "ngram": 0,
    "draft_model": 0,
    "eagle": 1,
    "eagle3": 1,
    "mtp": 1,
    "dflash": 0,
    "dspark": 0,
    "gemma4_mtp": 0,
}
DRAFTER_NAMES: tuple[str, ...] = tuple(DRAFTER_LOOKAHEAD)
MULTI_MODULE_DRAFTERS: frozenset[str] = frozenset({"mtp"})


@dataclass(frozen=True)
class DrafterPolicy:
    """What the cache needs to know of a drafter: its name and L."""

    name: str
    num_modules: int = 1  # chained draft modules (mtp only may have more than one)

    def __post_init__(self) -> None:
        if self.name not in DRAFTER_LOOKAHEAD:
            raise ValueError(
                f"unknown drafter {self.name!r}; choose one of: {', '.join(DRAFTER_NAMES)}"
            )
        if not isinstance(self.num_modules, int) or self.num_modules < 1:
            raise ValueError(f"{self.name} num_modules must be >= 1, got {self.num_modules!r}")
        if self.num_modules > 1 and self.name not in MULTI_MODULE_DRAFTERS:
            raise ValueError(f"{self.name} has one module, got num_modules={self.num_modules}")

    @property
    def draft_kv_lookahead_tokens(self) -> int:
        """L: how many tokens after `p` the draft KV at `p` depends on (0: none)."""
        return DRAFTER_LOOKAHEAD[self.name] * self.num_modules

    @property
    def label(self) -> str:
        """The name, with the module count where it has more than one (tables, JSON keys)."""
        return self.name if self.num_modules == 1 else f"{self.name} ({self.num_modules} modules)"


NO_DRAFTER = DrafterPolicy("none")


def drafter_policy(name: str, num_modules: int = 1) -> DrafterPolicy:
    """The policy of a drafter name; ValueError for an unknown name or module count."""
    return DrafterPolicy(name, num_modules)


class ConnectorCapability(Protocol):
    """The one thing the hash mode needs to know about a KV connector."""

    @property
    def supports_lookahead_block_hashes(self) -> bool: ...


def resolve_hash_mode(
    drafter: DrafterPolicy,
    *,
    enable_prefix_caching: bool = True,
    disable_lookahead_block_hashes: bool = False,
    connector: ConnectorCapability | None = None,
    reuse_divergent_blocks: bool = True,
    connector_blocker: str | None = None,
) -> HashMode:
    """Decide lookahead hashes vs legacy hashes (+ drop) for one engine, and whether blocks
    are reused at divergence points (lookahead hashes only; not under a KV connector, whose
    tiers are keyed by whole block hashes). `connector_blocker`: why the engine's connector
    rules lookahead hashes out, naming the connector at fault (the engine's caller computes it
    with `speckv.connectors.capability.lookahead_blocker`). Pure."""
    lookahead = drafter.draft_kv_lookahead_tokens
    if lookahead == 0:
        if drafter.name == NO_DRAFTER.name:
            return HashMode.for_lookahead(0, "speculation is off, no draft KV to cover: vLLM's "
                                             "plain block hashes")
        return HashMode.for_lookahead(0, f"the {drafter.name} drafter writes no draft KV from "
                                         "later tokens")
    if not enable_prefix_caching:
        return HashMode.for_lookahead(0, "prefix caching is off")
    if disable_lookahead_block_hashes:
        return HashMode.legacy_drop("disable_lookahead_block_hashes is set")
    if connector_blocker is not None:
        return HashMode.legacy_drop(f"{connector_blocker}: legacy hashes with the last-block "
                                    "drop")
    if connector is not None and not connector.supports_lookahead_block_hashes:
        return HashMode.legacy_drop("the KV connector does not support lookahead block hashes")
    reuse = reuse_divergent_blocks and connector is None
    return HashMode.for_lookahead(
        lookahead, f"{drafter.name} draft KV depends on {lookahead} token(s)", reuse
    )
