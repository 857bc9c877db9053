"""What each KV cache group of a hybrid engine can serve: the cache manager's hit rule, pure.

Owns the per-group hit rule the engine's cache manager applies (`KVCacheManager`), as a pure
function of which blocks each group holds. Two users outside the manager: the router predicts
an engine's hit from the groups its contract lists (`kv_groups`) and the blocks its events
published per group; a transfer connector (P/D) computes how much of a prompt a peer's blocks
serve beyond the local hit.

    hash unit H (the contract's block_size), alignment unit U, group g: block B_g, stride
    m_g = B_g / H, lookahead L_g (attention groups: the hash mode's L; Mamba groups: 0).
    Block i of g is named by chain_{L_g}[(i + 1) * m_g - 1] (a chained hash covers all before).

    a hit at h (h a multiple of U) is served by group g when it holds
      full attention    every block before h
      sliding window W  the ceil((W - 1) / B_g) blocks before h (fewer near the start)
      Mamba / GDN       the state checkpoint at exactly h (block h / B_g - 1)

    hit = the largest h <= floor((N - 1) / U) * U that every group serves (0 if none); under
    the legacy drop, once more from hit - U. That is the manager's fixed point: each group
    only shortens the hit, so the minimum over the groups of what each can serve.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

KINDS = ("full_attention", "sliding_window", "mamba")


@dataclass(frozen=True)
class GroupRule:
    group_idx: int
    kind: str
    block_size: int
    lookahead_tokens: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown KV cache group kind {self.kind!r} ({', '.join(KINDS)})")
        if self.kind == "sliding_window" and not (self.sliding_window or 0) > 0:
            raise ValueError("a sliding-window group needs sliding_window > 0")

    @property
    def num_window_blocks(self) -> int:
        assert self.sliding_window is not None
        return -(-(self.sliding_window - 1) // self.block_size)

    @classmethod
    def of_spec(cls, group_idx: int, spec: Any, lookahead_tokens: int) -> GroupRule:
        """The rule of a `KVCacheSpec` under a hash mode of `lookahead_tokens` (Mamba groups
        keep legacy hashes: the drafter writes no state)."""
        return cls(group_idx, spec.kind, spec.block_size,
                   lookahead_tokens if spec.drafter_writes_kv else 0,
                   getattr(spec, "sliding_window", None))

    def needed_blocks(self, hit_tokens: int) -> range:
        """The block indices a hit of `hit_tokens` reads of this group (the module
        docstring): every block before it, the window's blocks before it, or the state
        checkpoint at it."""
        num_blocks = hit_tokens // self.block_size
        if self.kind == "full_attention":
            return range(num_blocks)
        if self.kind == "sliding_window":
            return range(max(0, num_blocks - self.num_window_blocks), num_blocks)
        return range(num_blocks - 1, num_blocks) if num_blocks else range(0)

    def longest_given(self, held: Sequence[bool]) -> Callable[[int], int]:
        """`longest(candidate)`: the longest prefix (tokens, a whole number of this group's
        blocks, <= candidate) whose hit this group serves from `held`. Pure."""
        serves = self.serves_given(held)
        size = self.block_size

        def longest(candidate: int) -> int:
            num_blocks = max(0, candidate) // size
            while num_blocks > 0 and not serves(num_blocks * size):
                num_blocks -= 1
            return num_blocks * size

        return longest

    def serves_given(self, held: Sequence[bool]) -> Callable[[int], bool]:
        """`serves(hit_tokens)` from `held[i]`: whether block i of this group is at hand (a
        block past the list is not). Pure."""
        run = [0] * (len(held) + 1)  # run[n]: held blocks ending at block n - 1
        for i, ok in enumerate(held):
            run[i + 1] = run[i] + 1 if ok else 0
        if self.kind == "full_attention":
            def needed(num_blocks: int) -> int:
                return num_blocks
        elif self.kind == "sliding_window":
            window = self.num_window_blocks

            def needed(num_blocks: int) -> int:
                return min(window, num_blocks)
        else:
            def needed(num_blocks: int) -> int:
                return 1

        def serves(hit_tokens: int) -> bool:
            num_blocks = hit_tokens // self.block_size
            if num_blocks == 0:
                return True
            return num_blocks <= len(held) and run[num_blocks] >= needed(num_blocks)

        return serves


def group_hashes(chain: Sequence[bytes], stride: int) -> list[bytes]:
    """A group's block hashes from the hash-unit chain: every stride-th one."""
    return list(chain[stride - 1::stride]) if stride > 1 else list(chain)


def hybrid_fixed_point(max_length: int, unit: int, order: Sequence[int],
                       longest: Callable[[int, int], int]) -> int:
    """The hybrid hit rule: the longest U-aligned length <= `max_length` that every group
    accepts, where `longest(g, candidate)` is the longest prefix (tokens, <= candidate) that
    group g can serve. Groups may only shorten it; iterates to a fixed point. The local
    cache, every KV connector tier that carries several groups, the P/D transfer and the
    router apply this one rule."""
    hit_length = max(0, max_length) // unit * unit
    while True:
        candidate = hit_length
        for index in order:
            candidate = min(candidate, longest(index, candidate))
        candidate = candidate // unit * unit
        if candidate == hit_length:
            return hit_length
        hit_length = candidate


def hit_given(groups: Sequence[GroupRule], held: Sequence[Sequence[bool]],
              alignment_tokens: int, max_tokens: int, drops_last_unit: bool) -> int:
    """The hit (tokens, at most `max_tokens`) when block i of group g is at hand exactly where
    `held[g][i]` (the module docstring; under the legacy drop once more from one unit
    less). Pure."""
    longests = [group.longest_given(h) for group, h in zip(groups, held)]
    # full attention first: cheap, and usually the binding constraint (the manager's order)
    order = sorted(range(len(groups)), key=lambda g: groups[g].kind != "full_attention")

    def longest(index: int, candidate: int) -> int:
        return longests[index](candidate)

    hit = hybrid_fixed_point(max_tokens, alignment_tokens, order, longest)
    if drops_last_unit and hit > 0:
        hit = hybrid_fixed_point(hit - alignment_tokens, alignment_tokens, order, longest)
    return hit


def hybrid_hit(groups: Sequence[GroupRule], hash_unit: int, alignment_tokens: int,
               chains: Mapping[int, Sequence[bytes]], holds: Callable[[int, bytes], bool],
               num_prompt_tokens: int, drops_last_unit: bool) -> int:
    """Cached tokens a hybrid engine serves for a prompt (the module docstring). `chains`:
    the prompt's hash-unit chain per lookahead value. Pure."""
    held = [[holds(g.group_idx, block_hash) for block_hash in
             group_hashes(chains[g.lookahead_tokens], g.block_size // hash_unit)]
            for g in groups]
    return hit_given(groups, held, alignment_tokens, num_prompt_tokens - 1, drops_last_unit)
