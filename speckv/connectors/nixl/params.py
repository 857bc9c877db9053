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
    block_ids           per KV group, the prefill engine's block ids, in position order
    num_tokens          prompt tokens whose KV the blocks hold (whole blocks)
    first_token_id      the token the prefill engine sampled
    hash_contract       how both sides hash blocks (algo, seed, block size, hash mode)
    manifest            per transferred block, its block hash on the prefill side

The decode engine recomputes its own block hashes and refuses a manifest that differs, so a
transfer is cached only under hashes the decode engine itself would have computed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import msgspec

MAX_BLOCKS = 1 << 20  # a bound on every block list a peer sends


class ParamsError(ValueError):
    """A `kv_transfer_params` (or side-channel message) that cannot be used; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}")
        self.field = field


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
    block_ids: list[list[int]]  # per KV group, in position order
    num_tokens: int
    first_token_id: int
    hash_contract: HashContract
    manifest: list[bytes]  # block hash per transferred block (group 0)
    do_remote_prefill: bool = True

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
        if self.num_tokens < 0 or self.num_tokens % size:
            raise ParamsError("num_tokens", f"{self.num_tokens} is not a whole number of "
                              f"{size}-token blocks")
        num_blocks = self.num_tokens // size
        if num_blocks > MAX_BLOCKS:
            raise ParamsError("num_tokens", f"{self.num_tokens} tokens is too many")
        for group, ids in enumerate(self.block_ids):
            if len(ids) != num_blocks:
                raise ParamsError(f"block_ids[{group}]", f"{len(ids)} block ids for "
                                  f"{self.num_tokens} tokens ({num_blocks} blocks)")
            if any(block_id <= 0 for block_id in ids):
                raise ParamsError(f"block_ids[{group}]", "block ids must be > 0 (0 is the "
                                  "null block)")
            if len(set(ids)) != len(ids):
                raise ParamsError(f"block_ids[{group}]", "a block id appears twice")
        if len(self.manifest) != num_blocks:
            raise ParamsError("manifest", f"{len(self.manifest)} block hashes for "
                              f"{num_blocks} blocks")
        if self.first_token_id < 0:
            raise ParamsError("first_token_id", f"{self.first_token_id} must be >= 0")

    @property
    def num_blocks(self) -> int:
        return self.num_tokens // self.hash_contract.block_size

    def to_json_obj(self) -> dict[str, Any]:
        """JSON-ready (block hashes as hex), as the API returns it."""
        obj = msgspec.to_builtins(self)
        obj["manifest"] = [block_hash.hex() for block_hash in self.manifest]
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
        decoded = []
        for index, item in enumerate(manifest):
            if isinstance(item, str):
                try:
                    item = bytes.fromhex(item)
                except ValueError:
                    raise ParamsError(f"manifest[{index}]", "not a hex block hash") from None
            decoded.append(item)
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
