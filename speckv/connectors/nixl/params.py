"""The `kv_transfer_params` a prefill engine returns and a decode engine is given, and the hash
contract both sides must share. Pure data, validated; no live objects.

Owns the wire schema (msgspec Structs, JSON in the API, msgpack on the side channel) and
`ParamsError`, whose `field` names the offending `kv_transfer_params` field in the API's words:

    request to the prefill engine     {"do_remote_decode": true}
    prefill engine's final output     KVTransferParams (below), do_remote_prefill true
    request to the decode engine      that object as returned

    engine_id, epoch    the prefill engine (a restarted engine has a new epoch: its leases die)
    host, port          its side channel (ZeroMQ), where the decode engine handshakes
    lease_id            the lease that keeps the blocks on the prefill side
    block_ids           per KV cache group, the prefill engine's block ids, in position order
                        (group g: num_tokens / group_block_sizes[g] of them; 0 where that
                        engine holds nothing any more: a block behind a sliding window, a
                        GDN state before the last checkpoint)
    group_block_sizes   tokens per block of each group (empty: every group of block_size)
    num_tokens          the prompt tokens whose KV every group serves (the hit rule)
    first_token_id      the token the prefill engine sampled
    hash_contract       how both sides hash blocks (algo, seed, block size, hash mode)
    manifest            per KV cache group, per block, its block hash on the prefill side
                        (empty where the block id is 0)
    signature           HMAC-SHA256 of the rest under the engines' shared `kv_secret` (empty:
                        no secret; `trust.py`)

The decode engine recomputes its own block hashes (each group's: attention groups under the
hash mode's lookahead, GDN state under legacy hashes) and pulls a block only where the
manifest equals its own hash, so a transfer is cached only under hashes the decode engine
itself would have computed, for the KV, the drafter's KV and the state alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

from speckv.connectors.base import TransferParamsError

MAX_BLOCKS = 1 << 20  # a bound on every block list a peer sends


class ParamsError(TransferParamsError):
    """A `kv_transfer_params` (or side-channel message) that cannot be used; `field` names it."""


class HashContract(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What decides a block's hash on an engine: both sides of a transfer must agree exactly.
    Read from the engine's `GET /kv_cache_contract` fields (`from_contract`)."""

    hash_algo: str
    hash_seed: str | None
    block_size: int
    lookahead_tokens: int
    drops_last_unit: bool

    @classmethod
    def from_contract(cls, contract: Mapping[str, Any]) -> HashContract:
        """From the JSON of `speckv.api.contract.engine_contract`."""
        mode = contract["hash_mode"]
        return cls(contract["hash_algo"], contract["hash_seed"], int(contract["block_size"]),
                   int(mode["lookahead_tokens"]), bool(mode["drops_last_unit"]))

    @classmethod
    def of(cls, hash_algo: str, hash_seed: str | None, block_size: int, hash_mode: Any
           ) -> HashContract:
        """From an engine's settings and its `HashMode`."""
        return cls(hash_algo, hash_seed, block_size, hash_mode.lookahead_tokens,
                   hash_mode.drops_last_unit)

    def mismatch(self, other: HashContract) -> str | None:
        """The first field on which `other` differs, or None."""
        for name in self.__struct_fields__:
            if getattr(self, name) != getattr(other, name):
                return name
        return None


class KVTransferParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a decode engine needs to pull one request's KV from a prefill engine."""

    engine_id: str
    epoch: str
    host: str
    port: int
    lease_id: str
    block_ids: list[list[int]]  # per KV group, in position order (0: not held)
    num_tokens: int
    first_token_id: int
    hash_contract: HashContract
    manifest: list[list[bytes]]  # per KV group, block hash per block (b"" where id is 0)
    group_block_sizes: list[int] = []
    do_remote_prefill: bool = True
    signature: str = ""

    def __post_init__(self) -> None:
        if not self.engine_id:
            raise ParamsError("engine_id", "empty")
        if not 0 < self.port < 65536:
            raise ParamsError("port", f"{self.port} is not a TCP port")
        if not self.block_ids:
            raise ParamsError("block_ids", "no KV group")
        size = self.hash_contract.block_size
        if size <= 0:
            raise ParamsError("hash_contract.block_size", f"{size} must be > 0")
        if self.group_block_sizes and len(self.group_block_sizes) != len(self.block_ids):
            raise ParamsError("group_block_sizes", f"{len(self.group_block_sizes)} block "
                              f"sizes for {len(self.block_ids)} KV groups")
        if self.num_tokens < 0:
            raise ParamsError("num_tokens", f"{self.num_tokens} must be >= 0")
        if self.num_tokens // size > MAX_BLOCKS:
            raise ParamsError("num_tokens", f"{self.num_tokens} tokens is too many")
        if len(self.manifest) != len(self.block_ids):
            raise ParamsError("manifest", f"{len(self.manifest)} block-hash lists for "
                              f"{len(self.block_ids)} KV groups")
        for group, (ids, hashes) in enumerate(zip(self.block_ids, self.manifest)):
            group_size = self.block_size_of(group)
            if group_size <= 0 or self.num_tokens % group_size:
                raise ParamsError("num_tokens", f"{self.num_tokens} is not a whole number of "
                                  f"{group_size}-token blocks (group {group})")
            num_blocks = self.num_tokens // group_size
            if len(ids) != num_blocks:
                raise ParamsError(f"block_ids[{group}]", f"{len(ids)} block ids for "
                                  f"{self.num_tokens} tokens ({num_blocks} blocks)")
            if any(block_id < 0 for block_id in ids):
                raise ParamsError(f"block_ids[{group}]", "block ids must be >= 0 (0: not "
                                  "held)")
            held = [block_id for block_id in ids if block_id]
            if len(set(held)) != len(held):
                raise ParamsError(f"block_ids[{group}]", "a block id appears twice")
            if len(hashes) != num_blocks:
                raise ParamsError(f"manifest[{group}]", f"{len(hashes)} block hashes for "
                                  f"{num_blocks} blocks")
        if self.first_token_id < 0:
            raise ParamsError("first_token_id", f"{self.first_token_id} must be >= 0")

    def block_size_of(self, group: int) -> int:
        """Tokens per block of KV cache group `group`."""
        if self.group_block_sizes:
            return self.group_block_sizes[group]
        return self.hash_contract.block_size

    @property
    def num_blocks(self) -> int:
        """Blocks of group 0."""
        return self.num_tokens // self.block_size_of(0)

    def held_block_ids(self) -> list[list[int]]:
        """Per group, the block ids the prefill engine holds (the lease's)."""
        return [[block_id for block_id in ids if block_id] for ids in self.block_ids]

    def to_json_obj(self) -> dict[str, Any]:
        """JSON-ready (block hashes as hex), as the API returns it."""
        obj = msgspec.to_builtins(self)
        obj["manifest"] = [[block_hash.hex() for block_hash in hashes]
                           for hashes in self.manifest]
        return obj


def _error_field(error: msgspec.ValidationError) -> tuple[str, str]:
    """msgspec says `... - at `$.hash_contract.block_size``: the field and the message."""
    text = str(error)
    message, sep, where = text.rpartition(" - at `$")
    if not sep:
        return "", text
    return where.rstrip("`").lstrip("."), message


def parse_transfer_params(obj: Any) -> KVTransferParams:
    """`kv_transfer_params` from a request's JSON (manifest hashes as hex strings) or from the
    side channel (raw bytes). ParamsError naming the field otherwise."""
    if isinstance(obj, KVTransferParams):
        return obj
    if not isinstance(obj, dict):
        raise ParamsError("", f"expected an object, got {type(obj).__name__}")
    manifest = obj.get("manifest")
    if isinstance(manifest, list):
        decoded: list[Any] = []
        for group, hashes in enumerate(manifest):
            if not isinstance(hashes, list):
                decoded.append(hashes)  # msgspec names the field
                continue
            items = []
            for index, item in enumerate(hashes):
                if isinstance(item, str):
                    try:
                        item = bytes.fromhex(item)
                    except ValueError:
                        raise ParamsError(f"manifest[{group}][{index}]",
                                          "not a hex block hash") from None
                items.append(item)
            decoded.append(items)
        obj = {**obj, "manifest": decoded}
    obj = {key: value for key, value in obj.items() if key != "do_remote_decode"}
    try:
        return msgspec.convert(obj, KVTransferParams)
    except ParamsError:
        raise
    except msgspec.ValidationError as error:
        cause = error.__cause__ or error.__context__
        if isinstance(cause, ParamsError):  # raised by __post_init__, wrapped by msgspec
            raise ParamsError(cause.field, str(cause).partition(": ")[2]) from None
        field, message = _error_field(error)
        unknown = re.search(r"unknown field `([^`]+)`", message)
        if unknown:
            field = ".".join(part for part in (field, unknown.group(1)) if part)
            message = "unknown field (is the decode engine a speckv serve of this version?)"
        raise ParamsError(field, message) from None


def wants_remote_decode(obj: Any) -> bool:
    """True when a request's `kv_transfer_params` asks the prefill side to keep its KV."""
    return isinstance(obj, dict) and obj.get("do_remote_decode") is True


def wants_remote_prefill(obj: Any) -> bool:
    """True when a request's `kv_transfer_params` names KV to pull from a prefill engine."""
    return isinstance(obj, dict) and obj.get("do_remote_prefill") is True
