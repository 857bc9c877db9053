"""KV cache group specs: what kind of state a group of layers keeps, and its block size.

Owns the frozen, validated description of each group. The manager for a group is chosen by the
spec's type (see `speckv.cache.single_type`), never by a flag.

| spec              | state per block                    | a hit at h needs                      |
|-------------------|------------------------------------|---------------------------------------|
| FullAttentionSpec | K/V of B tokens                    | every block before h                  |
| SlidingWindowSpec | K/V of B tokens, window W          | the ceil((W - 1) / B) blocks before h |
| MambaSpec         | one recurrent state per checkpoint | the state at exactly h                |
"""

from __future__ import annotations

from dataclasses import dataclass


def _check_block_size(block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    kind: str = "full_attention"

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)

    @property
    def drafter_writes_kv(self) -> bool:
        """Draft models have attention layers: these groups carry lookahead hashes."""
        return True


@dataclass(frozen=True)
class SlidingWindowSpec:
    block_size: int
    sliding_window: int
    kind: str = "sliding_window"

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)
        if self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be > 0, got {self.sliding_window}")

    @property
    def drafter_writes_kv(self) -> bool:
        return True

    @property
    def num_window_blocks(self) -> int:
        """Blocks before a hit length h that the next token can attend to: ceil((W - 1) / B)."""
        return -(-(self.sliding_window - 1) // self.block_size)


@dataclass(frozen=True)
class MambaSpec:
    """Mamba / linear-attention state, checkpointed every `block_size` tokens."""

    block_size: int
    kind: str = "mamba"

    def __post_init__(self) -> None:
        _check_block_size(self.block_size)

    @property
    def drafter_writes_kv(self) -> bool:
        """Draft models have no Mamba layers: Mamba groups keep legacy hashes."""
        return False


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MambaSpec


def parse_group_specs(text: str) -> list[KVCacheSpec]:
    """`full:16,swa:1024:16,mamba:544` → specs (kind:block_size, swa:window:block_size)."""
    specs: list[KVCacheSpec] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        fields = item.split(":")
        try:
            if fields[0] == "full" and len(fields) == 2:
                specs.append(FullAttentionSpec(int(fields[1])))
            elif fields[0] == "swa" and len(fields) == 3:
                specs.append(SlidingWindowSpec(int(fields[2]), int(fields[1])))
            elif fields[0] == "mamba" and len(fields) == 2:
                specs.append(MambaSpec(int(fields[1])))
            else:
                raise ValueError
        except ValueError as error:
            detail = f": {error}" if str(error) else ""
            raise ValueError(
                f"bad group {item!r}{detail}; use full:B, swa:W:B or mamba:B"
            ) from None
    if not specs:
        raise ValueError("no KV cache groups given")
    return specs


def format_group_specs(specs: list[KVCacheSpec]) -> str:
    """The inverse of `parse_group_specs`."""
    parts = []
    for spec in specs:
        if isinstance(spec, SlidingWindowSpec):
            parts.append(f"swa:{spec.sliding_window}:{spec.block_size}")
        elif isinstance(spec, MambaSpec):
            parts.append(f"mamba:{spec.block_size}")
        else:
            parts.append(f"full:{spec.block_size}")
    return ",".join(parts)
