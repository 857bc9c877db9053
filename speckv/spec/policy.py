"""Drafter policies: the single place that decides lookahead hashes versus the legacy drop.

Owns one type per drafter family (SPEC §6). A policy says whether the drafter writes draft KV
at position `p` from a token after `p` (EAGLE-style), and how many such tokens (`L`);
`resolve_hash_mode` turns that, the prefix-caching setting, `disable_lookahead_block_hashes`
and the KV connector's capability into one `HashMode` that the cache follows.

| drafter                          | draft KV from next token(s) | L with lookahead | legacy      |
|----------------------------------|-----------------------------|------------------|-------------|
| none, ngram, draft_model         | no                          | 0                | no drop     |
| eagle, eagle3, mtp (1 module)    | yes, p + 1                  | 1                | drop a unit |
| mtp (k modules)                  | yes, up to p + k            | k                | drop a unit |
| dflash, dspark                   | no (target hidden only)     | 0                | no drop     |
| gemma4_mtp (writes no draft KV)  | no                          | 0                | no drop     |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class DrafterPolicy(Protocol):
    name: str

    @property
    def draft_kv_lookahead_tokens(self) -> int:
        """How many tokens after `p` the draft KV at `p` depends on (0: none)."""
        ...


@dataclass(frozen=True)
class NoDrafterPolicy:
    name: str = "none"
    draft_kv_lookahead_tokens: int = 0


@dataclass(frozen=True)
class NgramPolicy:
    name: str = "ngram"
    draft_kv_lookahead_tokens: int = 0


@dataclass(frozen=True)
class DraftModelPolicy:
    """A separate small model: its KV is plain causal over the same tokens."""

    name: str = "draft_model"
    draft_kv_lookahead_tokens: int = 0


@dataclass(frozen=True)
class EaglePolicy:
    name: str = "eagle"
    draft_kv_lookahead_tokens: int = 1


@dataclass(frozen=True)
class Eagle3Policy:
    name: str = "eagle3"
    draft_kv_lookahead_tokens: int = 1


@dataclass(frozen=True)
class MTPPolicy:
    """k chained modules; module j writes its KV at p from the token at p + j."""

    num_modules: int = 1
    name: str = "mtp"

    def __post_init__(self) -> None:
        if self.num_modules < 1:
            raise ValueError(f"mtp num_modules must be >= 1, got {self.num_modules}")

    @property
    def draft_kv_lookahead_tokens(self) -> int:
        return self.num_modules


@dataclass(frozen=True)
class DFlashPolicy:
    name: str = "dflash"
    draft_kv_lookahead_tokens: int = 0


@dataclass(frozen=True)
class DSparkPolicy:
    name: str = "dspark"
    draft_kv_lookahead_tokens: int = 0


@dataclass(frozen=True)
class Gemma4MTPPolicy:
    """Gemma-4's MTP assistant reads the target's KV and writes none of its own."""

    name: str = "gemma4_mtp"
    draft_kv_lookahead_tokens: int = 0


_SIMPLE_POLICIES: dict[str, DrafterPolicy] = {
    policy.name: policy
    for policy in (
        NoDrafterPolicy(),
        NgramPolicy(),
        DraftModelPolicy(),
        EaglePolicy(),
        Eagle3Policy(),
        DFlashPolicy(),
        DSparkPolicy(),
        Gemma4MTPPolicy(),
    )
}
DRAFTER_NAMES: tuple[str, ...] = (*_SIMPLE_POLICIES, "mtp")


def make_drafter_policy(name: str, mtp_modules: int = 1) -> DrafterPolicy:
    """The policy for a drafter name; `mtp_modules` applies to `mtp` only."""
    if name == "mtp":
        return MTPPolicy(num_modules=mtp_modules)
    try:
        return _SIMPLE_POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown drafter {name!r}; choose one of: {', '.join(DRAFTER_NAMES)}"
        ) from None


class ConnectorCapability(Protocol):
    """The one thing the hash mode needs to know about a KV connector."""

    @property
    def supports_lookahead_block_hashes(self) -> bool: ...


@dataclass(frozen=True)
class HashMode:
    """How the cache hashes blocks and whether it drops the last matched unit.

    Exactly one of the two is in effect for an EAGLE-style drafter: lookahead hashes
    (`lookahead_tokens > 0`) or the legacy drop.
    """

    lookahead_tokens: int
    drops_last_unit: bool
    reason: str

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {self.lookahead_tokens}")
        if self.lookahead_tokens and self.drops_last_unit:
            raise ValueError("lookahead hashes and the legacy block drop are exclusive")

    @property
    def label(self) -> str:
        if self.lookahead_tokens:
            return f"lookahead L={self.lookahead_tokens}"
        return "legacy+drop" if self.drops_last_unit else "legacy"


def resolve_hash_mode(
    drafter: DrafterPolicy,
    *,
    enable_prefix_caching: bool = True,
    disable_lookahead_block_hashes: bool = False,
    connector: ConnectorCapability | None = None,
) -> HashMode:
    """Decide lookahead hashes vs legacy hashes (+ drop) for one engine. Pure."""
    lookahead = drafter.draft_kv_lookahead_tokens
    if lookahead == 0:
        return HashMode(0, False, f"{drafter.name} writes no draft KV from later tokens")
    if not enable_prefix_caching:
        return HashMode(0, False, "prefix caching is off")
    if disable_lookahead_block_hashes:
        return HashMode(0, True, "disable_lookahead_block_hashes is set")
    if connector is not None and not connector.supports_lookahead_block_hashes:
        return HashMode(0, True, "the KV connector does not support lookahead block hashes")
    return HashMode(lookahead, False, f"{drafter.name} draft KV depends on {lookahead} token(s)")
