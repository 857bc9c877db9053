"""What one engine tells a peer about its paged KV: enough to address any block of any layer,
and to refuse a peer whose blocks do not mean the same thing.

Owns `KVLayoutDesc` (sent over the side channel at the handshake, msgpack) and
`check_peer_layout`, which compares a peer's description with this engine's and raises a
`ParamsError` naming the first field that differs (block size, hash contract, KV groups,
segments, and per segment: layers, KV heads, head dim, dtype).

Block addressing, per segment (the target's cache, then the drafter's), from
`PagedKVCache.storage` [layers, 2, num_blocks, block_size, kv_heads, head_dim], contiguous:

    chunk (one block of one layer's keys or values)   block_size * kv_heads * head_dim * itemsize
    address of (layer l, k/v c, block b)               base + ((l * 2 + c) * num_blocks + b) * chunk
"""

from __future__ import annotations

import msgspec

from speckv.connectors.layout import DeviceKV, dtype_name
from speckv.connectors.nixl.params import HashContract, ParamsError


class SegmentDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str  # "target" or "draft"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    base_addr: int  # address of storage[0, 0, 0] in the owner's memory
    chunk_bytes: int  # one block of one layer's keys (or values)

    @property
    def num_chunks_per_block(self) -> int:
        return self.num_layers * 2


class KVLayoutDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    epoch: str
    agent_name: str
    block_size: int
    num_blocks: int
    kv_groups: list[str]  # group kinds, in group order
    hash_contract: HashContract
    segments: list[SegmentDesc]
    mem_type: str = "DRAM"  # "VRAM" on a GPU engine


def describe_layout(kv: DeviceKV, engine_id: str, epoch: str, agent_name: str,
                    hash_contract: HashContract, kv_groups: list[str] | None = None
                    ) -> KVLayoutDesc:
    segments = []
    for segment, cache in zip(kv.layout.segments, kv.caches):
        storage = cache.storage
        if not storage.is_contiguous():
            raise ValueError(f"the {segment.name} KV cache is not contiguous")
        chunk = segment.block_size * segment.num_kv_heads * segment.head_dim \
            * storage.element_size()
        segments.append(SegmentDesc(segment.name, segment.num_layers, segment.num_kv_heads,
                                    segment.head_dim, dtype_name(cache.dtype),
                                    storage.data_ptr(), chunk))
    return KVLayoutDesc(engine_id, epoch, agent_name, kv.layout.block_size, kv.num_blocks,
                        kv_groups or ["full_attention"], hash_contract, segments,
                        "DRAM" if kv.device.type == "cpu" else "VRAM")


def check_peer_layout(local: KVLayoutDesc, peer: KVLayoutDesc) -> None:
    """ParamsError naming the first field on which `peer`'s blocks differ from ours."""
    if peer.block_size != local.block_size:
        raise ParamsError("layout.block_size", f"the prefill engine uses blocks of "
                          f"{peer.block_size} tokens, this engine {local.block_size}")
    field = local.hash_contract.mismatch(peer.hash_contract)
    if field is not None:
        raise ParamsError(f"hash_contract.{field}",
                          f"the prefill engine has {getattr(peer.hash_contract, field)!r}, "
                          f"this engine {getattr(local.hash_contract, field)!r}")
    if peer.kv_groups != local.kv_groups:
        raise ParamsError("layout.kv_groups", f"{peer.kv_groups} != {local.kv_groups}")
    names = [s.name for s in peer.segments]
    if names != [s.name for s in local.segments]:
        raise ParamsError("layout.segments", f"the prefill engine holds KV of {names}, this "
                          f"engine of {[s.name for s in local.segments]} (same drafter on "
                          "both sides?)")
    for mine, theirs in zip(local.segments, peer.segments):
        for name in ("num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_bytes"):
            if getattr(mine, name) != getattr(theirs, name):
                raise ParamsError(f"layout.segments[{mine.name}].{name}",
                                  f"the prefill engine has {getattr(theirs, name)!r}, this "
                                  f"engine {getattr(mine, name)!r}")
