"""HashMode: how the cache hashes blocks, and whether it drops the last matched unit.

Owns the one decision the cache follows for a whole engine. Exactly one of two things protects
a hit's draft KV when the drafter writes the draft KV at `p` from tokens after `p`:

    lookahead hashes   lookahead_tokens = L > 0: the L successor tokens are part of each hash
    legacy + drop      lookahead_tokens = 0, drops_last_unit: the last matched unit is recomputed

With lookahead hashes, `reuses_divergent_blocks` adds block reuse at divergence points: a
block whose tokens (and chain) match a cached block that names another successor is copied
into a block of the request's own, and only its last L positions are recomputed (their draft
KV is the only part of the block that depends on the successor).

`speckv.cache.drafter_policy.resolve_hash_mode` picks one from the drafter, the settings and the KV
connector's capability; the cache never looks at drafters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HashMode:
    lookahead_tokens: int  # L: successor tokens hashed into each block (0: legacy hashes)
    drops_last_unit: bool  # legacy hashes under an EAGLE-style drafter: recompute the last unit
    reason: str  # why this mode, in words an operator can act on (printed at start-up)
    # copy a block cached under another successor, recompute its last L positions
    reuses_divergent_blocks: bool = False

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {self.lookahead_tokens}")
        if self.lookahead_tokens and self.drops_last_unit:
            raise ValueError("lookahead hashes and the legacy block drop are exclusive")
        if self.reuses_divergent_blocks and not self.lookahead_tokens:
            raise ValueError("divergent block reuse needs lookahead hashes")

    @classmethod
    def for_lookahead(cls, lookahead_tokens: int, reason: str = "",
                      reuses_divergent_blocks: bool = False) -> HashMode:
        """Lookahead hashes over `lookahead_tokens` successors (0: plain legacy, no drop)."""
        return cls(lookahead_tokens, False,
                   reason or f"lookahead hashes over {lookahead_tokens} successor token(s)",
                   reuses_divergent_blocks and lookahead_tokens > 0)

    @classmethod
    def legacy_drop(cls, reason: str = "legacy hashes with the last-unit drop") -> HashMode:
        return cls(0, True, reason)

    @property
    def label(self) -> str:
        if self.lookahead_tokens:
            return f"lookahead L={self.lookahead_tokens}"
        return "legacy+drop" if self.drops_last_unit else "legacy"
