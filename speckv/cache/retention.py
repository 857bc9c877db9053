"""Which cached blocks are worth keeping: reachable hit boundaries and retention intervals.

Owns the decision "may a later request ever hit at length h with this block's help". Full
attention keeps every block. Sliding-window and Mamba groups only help a hit at a boundary h:
a sliding-window group needs the W-token tail before h, a Mamba group the state at h. Keeping
every tail (dense retention) costs memory, so a retention interval R keeps them only at:

    every multiple of R (R > 0), and the prompt's own reachable boundary
    R = 0: only the prompt's own reachable boundary;  R = None: every boundary (dense)

Under the legacy EAGLE drop a hit at checkpoint c is served at c - U, so each kept
sliding-window tail is widened by U // B blocks: a sibling request that
diverges just after c still finds a full window before c - U. Lookahead hashes widen the same
way: a sibling diverging exactly at c has another successor for the block ending at c, so its
hit is c - U too.

    tokens:   ... | widen (U) |  window tail (ceil((W-1)/B) blocks)  | c
                   ^ kept only under the legacy drop
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TailWidening(Enum):
    """How much wider a kept sliding-window tail is under the legacy drop."""

    UNIT = "unit"  # U // B blocks: the fix
    NONE = "none"  # the bug: a sibling diverging after c finds no full window
    ONE_BLOCK = "one_block"  # enough only when B == U

    def extra_blocks(self, alignment_tokens: int, block_size: int) -> int:
        if self is TailWidening.UNIT:
            return alignment_tokens // block_size
        return 1 if self is TailWidening.ONE_BLOCK else 0


@dataclass(frozen=True)
class RetentionPolicy:
    """Reachable boundaries of one request; frozen per model config."""

    alignment_tokens: int
    interval: int | None = None

    def __post_init__(self) -> None:
        if self.interval is None:
            return
        if self.interval < 0:
            raise ValueError(f"retention interval must be None, 0 or > 0, got {self.interval}")
        if self.interval % self.alignment_tokens:
            raise ValueError(
                f"retention interval {self.interval} is not a multiple of the alignment unit "
                f"{self.alignment_tokens}"
            )

    @property
    def is_dense(self) -> bool:
        return self.interval is None

    def boundaries(self, num_tokens: int, num_prompt_tokens: int) -> list[int]:
        """Hit lengths in `(0, num_tokens]` worth keeping state for, ascending. Pure."""
        unit = self.alignment_tokens
        if self.interval is None:
            return list(range(unit, num_tokens + 1, unit))
        points = set()
        if self.interval > 0:
            points.update(range(self.interval, num_tokens + 1, self.interval))
        prompt_boundary = (num_prompt_tokens - 1) // unit * unit
        if 0 < prompt_boundary <= num_tokens:
            points.add(prompt_boundary)
        return sorted(points)


def runs_worth_keeping(retention: RetentionPolicy, num_tail_blocks: int, block_size: int,
                       start: int, end: int, num_prompt_tokens: int) -> list[tuple[int, int]]:
    """Block-index runs in `[start, end)` of a sliding-window or Mamba group (blocks of
    `block_size`) that a hit at a reachable boundary can use: the `num_tail_blocks` blocks
    before each boundary. Ascending, merged. Pure. (The local cache keeps these; a KV
    connector tier stores the same.)"""
    if retention.is_dense:
        return [(start, end)] if start < end else []
    runs: list[tuple[int, int]] = []
    for boundary in retention.boundaries(end * block_size, num_prompt_tokens):
        last = boundary // block_size
        low, high = max(start, last - num_tail_blocks), min(end, last)
        if low >= high:
            continue
        if runs and low <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], high))
        else:
            runs.append((low, high))
    return runs
