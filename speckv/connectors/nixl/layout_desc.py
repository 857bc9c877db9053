"""What one engine tells a peer about its paged KV: enough to address any block of any KV cache
group, and to refuse a peer whose blocks do not mean the same thing.

Owns `KVLayoutDesc` (sent over the side channel at the handshake, msgpack) and
`check_peer_layout`, which compares a peer's description with this engine's and raises a
`ParamsError` naming the first field that differs (block size, hash contract, KV groups and
their block sizes, segments, and per segment: planes, chunk shape and bytes, dtype).

A segment is one device tensor of one KV cache group (`connectors.layout.DeviceSegment`:
storage, block axis, layers): the target's paged KV and the drafter's of an attention group,
the conv and the recurrent state of a GDN group. Each storage is contiguous, so the axes before
its block axis flatten to `planes` rows of `num_blocks` equal chunks (its own block count: with
per-group pools every group has its own):

    chunk (plane p, block b)   base_addr + (p * num_blocks + b) * chunk_bytes

    paged KV [layers, 2, n, bs, heads, dim]   plane l * 2 + c   chunk bs * heads * dim
    GDN conv [layers, n, C, K - 1]            plane l           chunk C * (K - 1)
    GDN recurrent [layers, n, Hv, dk, dv]     plane l           chunk Hv * dk * dv (fp32)

`planes` lists the planes the group uses (a paged KV over every layer shared by two attention
groups: each group its own layers' planes).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

import msgspec

from speckv.connectors.layout import DeviceKV, DeviceSegment, GroupedDeviceKV, dtype_name
from speckv.connectors.nixl.params import HashContract, ParamsError


class SegmentDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    group: int  # the KV cache group whose block ids index it
    name: str  # "target", "draft", "conv", "recurrent"
    dtype: str
    base_addr: int  # address of the tensor's first byte in the owner's memory
    num_blocks: int  # block ids of the group (rows per plane)
    chunk_bytes: int  # one block of one plane
    chunk_shape: list[int]
    planes: list[int]  # the planes the group uses, in the order both sides pair them

    @property
    def key(self) -> tuple[int, str]:
        return self.group, self.name


class KVLayoutDesc(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    engine_id: str
    epoch: str
    agent_name: str
    block_size: int
    kv_groups: list[str]  # group kinds, in group order
    group_block_sizes: list[int]  # tokens per block of each group
    hash_contract: HashContract
    segments: list[SegmentDesc]
    mem_type: str = "DRAM"  # "VRAM" on a GPU engine

    def group_num_blocks(self, group: int) -> int:
        return next(s.num_blocks for s in self.segments if s.group == group)


def segment_desc(group: int, device: DeviceSegment) -> SegmentDesc:
    """A device segment as chunks: its storage's axes before the block axis flattened to
    planes (of the segment's layers only, when it holds some of the storage's)."""
    storage = device.storage
    if not storage.is_contiguous():
        raise ValueError(f"the {device.segment.name} KV cache is not contiguous")
    shape = tuple(storage.shape)
    axis = device.block_axis
    inner = prod(shape[1:axis])  # planes per layer (keys and values: 2; a state: 1)
    layers = device.layers if device.layers is not None else range(shape[0])
    planes = [layer * inner + rest for layer in layers for rest in range(inner)]
    chunk_shape = list(shape[axis + 1:])
    return SegmentDesc(group, device.segment.name, dtype_name(storage.dtype),
                       storage.data_ptr(), shape[axis],
                       prod(chunk_shape) * storage.element_size(), chunk_shape, planes)


def describe_layout(kv: DeviceKV | GroupedDeviceKV, engine_id: str, epoch: str,
                    agent_name: str, hash_contract: HashContract,
                    groups: Sequence[Any] | None = None) -> KVLayoutDesc:
    """`groups`: every KV cache group's rule (`cache.group_rules.GroupRule`: kind, block
    size), in the order of `kv.groups`; default one full-attention group."""
    devices = kv.groups
    kinds = [g.kind for g in groups] if groups else ["full_attention"] * len(devices)
    sizes = [g.block_size for g in groups] if groups else [kv.layout.block_size] * len(devices)
    segments = [segment_desc(g, device) for g, group in enumerate(devices)
                for device in group.segments]
    return KVLayoutDesc(engine_id, epoch, agent_name, kv.layout.block_size, kinds, sizes,
                        hash_contract, segments, "DRAM" if kv.device.type == "cpu" else "VRAM")


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
    if peer.group_block_sizes != local.group_block_sizes:
        raise ParamsError("layout.group_block_sizes",
                          f"{peer.group_block_sizes} != {local.group_block_sizes}")
    names = [s.key for s in peer.segments]
    if names != [s.key for s in local.segments]:
        raise ParamsError("layout.segments", f"the prefill engine holds KV of "
                          f"{_names(peer)}, this engine of {_names(local)} (same drafter on "
                          "both sides?)")
    for mine, theirs in zip(local.segments, peer.segments):
        where = f"layout.segments[{mine.name}]" if len(local.kv_groups) == 1 else \
            f"layout.segments[{mine.group}.{mine.name}]"
        if len(theirs.planes) != len(mine.planes):
            raise ParamsError(f"{where}.planes", f"the prefill engine has {len(theirs.planes)} "
                              f"(layers x keys/values), this engine {len(mine.planes)}")
        for name in ("chunk_shape", "dtype", "chunk_bytes"):
            if getattr(mine, name) != getattr(theirs, name):
                raise ParamsError(f"{where}.{name}",
                                  f"the prefill engine has {getattr(theirs, name)!r}, this "
                                  f"engine {getattr(mine, name)!r}")


def _names(layout: KVLayoutDesc) -> list[str]:
    if len(layout.kv_groups) == 1:
        return [s.name for s in layout.segments]
    return [f"{layout.kv_groups[s.group]}.{s.name}" for s in layout.segments]
