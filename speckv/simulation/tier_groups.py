"""Every KV cache group of a hybrid layout in real tensors, so the real tiers copy them.

Owns what the toy runner needs to drive a KV connector on a hybrid layout: one tensor-backed
symbolic store per group (`PagedSymbolicKV` for attention groups, `PagedSymbolicState` for
Mamba / GDN groups), the `GroupedDeviceKV` a connector copies them through, and the content
check a tier's wrapper (`tiers.CheckedStore`) applies to a block of a sliding-window or state
group.

A state is recorded as a fingerprint of the tokens it was computed from, in one int64 row per
block id: [set, number of tokens, hash of all of them, hash of the last block's tokens]. It
compares equal to exactly that token prefix (what `SymbolicGroups.mismatch` asks), and a tier
can check a stored state against its block header (it ends with the header's tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speckv.cache.specs import FullAttentionSpec, MambaSpec
from speckv.connectors.layout import (
    DRAFT,
    TARGET,
    BlockTensors,
    DeviceKV,
    DeviceSegment,
    GroupedDeviceKV,
    KVSegment,
)
from speckv.connectors.metadata import BlockDescriptor
from speckv.simulation.paged_kv import PagedSymbolicKV, decode_target
from speckv.simulation.symbolic_groups import NULL_BLOCK_ID, SymbolicGroups

STATE = "state"
_SET, _LENGTH, _PREFIX, _LAST = range(4)


def _hash(tokens: Sequence[int]) -> int:
    return hash(tuple(tokens))  # ints hash the same in every process


class StateFingerprint:
    """A recorded state: equal to the token prefix it was computed from (a tuple)."""

    __slots__ = ("length", "prefix_hash")

    def __init__(self, length: int, prefix_hash: int) -> None:
        self.length = length
        self.prefix_hash = prefix_hash

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StateFingerprint):
            return (self.length, self.prefix_hash) == (other.length, other.prefix_hash)
        if isinstance(other, tuple):
            return len(other) == self.length and _hash(other) == self.prefix_hash
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


class PagedSymbolicState:
    """`SymbolicState` in a tensor a connector can copy: [num_blocks, 4] int64."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.tensor = torch.zeros((num_blocks, 4), dtype=torch.int64)

    def write(self, block_id: int, prefix: Sequence[int]) -> None:
        if block_id == NULL_BLOCK_ID:
            return
        last = prefix[len(prefix) // self.block_size * self.block_size - self.block_size:
                      len(prefix) // self.block_size * self.block_size] \
            if len(prefix) >= self.block_size else ()
        self.tensor[block_id] = torch.tensor([1, len(prefix), _hash(prefix), _hash(last)])

    def read(self, block_id: int) -> StateFingerprint | None:
        row = self.tensor[block_id].tolist()
        if not row[_SET]:
            return None
        return StateFingerprint(row[_LENGTH], row[_PREFIX])

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        src = torch.tensor([pair[0] for pair in copies], dtype=torch.int64)
        dst = torch.tensor([pair[1] for pair in copies], dtype=torch.int64)
        self.tensor[dst] = self.tensor[src]


def tensor_groups(specs: Sequence, num_blocks: Sequence[int], kv: PagedSymbolicKV
                  ) -> tuple[SymbolicGroups, GroupedDeviceKV]:
    """Every group's symbolic store in tensors (`kv` is group 0's), and the device KV a
    connector copies: attention groups' target KV (the draft group's draft KV too), Mamba
    groups' state fingerprints."""
    draft_group = next((g for g, spec in enumerate(specs)
                        if isinstance(spec, FullAttentionSpec)), None)
    stores: list[object] = [kv]
    for g, spec in enumerate(specs[1:], 1):
        if isinstance(spec, MambaSpec):
            stores.append(PagedSymbolicState(num_blocks[g], spec.block_size))
        else:
            depth = kv.draft_depth if g == draft_group else 0
            stores.append(PagedSymbolicKV(num_blocks[g], spec.block_size, depth))
    devices = []
    for g, (spec, store) in enumerate(zip(specs, stores)):
        if isinstance(store, PagedSymbolicState):
            segments = [DeviceSegment(KVSegment.state(STATE, (4,), spec.block_size,
                                                      torch.int64), store.tensor, 0)]
        else:
            assert isinstance(store, PagedSymbolicKV)
            segments = [DeviceSegment.of_cache(TARGET, store.target_cache)]
            if g == draft_group:
                segments.append(DeviceSegment.of_cache(DRAFT, store.draft_cache))
        devices.append(DeviceKV(segments=segments, num_blocks=num_blocks[g]))
    return SymbolicGroups(specs, stores, kv.draft_depth), GroupedDeviceKV(devices)


def group_block_violation(block: BlockDescriptor, tensors: BlockTensors) -> str | None:
    """Why a stored block of a sliding-window group (target KV only) or a state group (a
    fingerprint) is not what its header names; None when it is."""
    (tensor,) = tensors
    if tensor.dtype == torch.int64:  # a state: after the tokens up to the block's end
        row = tensor.tolist()
        if not row[_SET]:
            return "a state block that was never written"
        if row[_LENGTH] % len(block.token_ids) or row[_LAST] != _hash(block.token_ids):
            return (f"a state after {row[_LENGTH]} tokens that do not end with the header's "
                    f"{len(block.token_ids)}")
        return None
    for offset, token in enumerate(block.token_ids):  # [1, 2, B, 1, 1]
        got = decode_target(tensor[0, :, offset, 0, 0])
        if got != token:
            return f"position {offset}: target KV of {got!r}, its header says {token}"
    return None
