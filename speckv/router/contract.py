"""An engine's cache contract as the router reads it, and the check that the router can
reproduce it.

Owns turning the JSON of `GET /kv_cache_contract` (`speckv.api.contract`) into an
`EngineContract`, refusing, with the field named, every contract whose hits the router could
not predict exactly: another contract version, a random hash seed, an unknown hash algorithm,
several KV cache groups (a sliding-window or state group makes a hit depend on more than one
prefix), no KV events, a hash mode the router does not know, or hashes sent as 64-bit ints.
`ContractError.field` is the contract's field name. Also resolves the events endpoints an
engine binds (`tcp://*:5557`) to the address the router connects to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from speckv.cache.group_rules import KINDS, GroupRule, hybrid_hit
from speckv.hashing.functions import HASH_ALGOS
from speckv.router.index import EngineHashConfig

SUPPORTED_VERSION = 1
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


class ContractError(ValueError):
    """An engine's contract the router cannot reproduce; `field` names the contract field."""

    def __init__(self, engine: str, field: str, message: str) -> None:
        super().__init__(f"engine {engine!r}: cache contract field {field!r}: {message}")
        self.engine = engine
        self.field = field


@dataclass(frozen=True)
class HitRule:
    """How an engine turns matched blocks into cached tokens (its `get_computed_blocks`)."""

    block_size: int
    lookahead_tokens: int  # L
    drops_last_unit: bool  # legacy hashes under an EAGLE-style drafter
    prefix_caching: bool
    # the engine copies a block cached under another successor at a divergence point (a hit
    # of j * U + U - L); the fleet checks its successor index for such a block
    reuses_divergent_blocks: bool = False
    # hybrid engines: one rule per KV cache group and the alignment unit U (hits are whole
    # multiples of it); () for one full-attention group of blocks of U
    groups: tuple[GroupRule, ...] = ()
    alignment_tokens: int = 0

    @property
    def is_hybrid(self) -> bool:
        return bool(self.groups)

    @property
    def lookahead_values(self) -> tuple[int, ...]:
        """The lookahead values whose prompt chains a hybrid hit reads."""
        return tuple(sorted({g.lookahead_tokens for g in self.groups}))

    def hybrid_cached_tokens(self, chains: Mapping[int, Sequence[bytes]],
                             holds: Callable[[int, bytes], bool], num_prompt_tokens: int) -> int:
        """A hybrid engine's hit: the longest U-aligned prefix every group serves. Pure."""
        if not self.prefix_caching:
            return 0
        return hybrid_hit(self.groups, self.block_size, self.alignment_tokens, chains, holds,
                          num_prompt_tokens, self.drops_last_unit)

    def cached_tokens(self, num_matched_blocks: int, num_prompt_tokens: int) -> int:
        """Tokens the engine serves from cache: whole blocks, at most N - 1, and one unit less
        under the legacy drop. Pure."""
        if not self.prefix_caching:
            return 0
        unit = self.block_size
        hit = min(num_matched_blocks * unit, max(0, num_prompt_tokens - 1) // unit * unit)
        if self.drops_last_unit and hit > 0:
            hit -= unit
        return hit


@dataclass(frozen=True)
class EngineContract:
    engine: str  # the router's name for it
    epoch: str
    served_model_name: str
    model: str
    max_model_len: int
    vocab_size: int
    tokenizer: str | None  # digest
    hashing: EngineHashConfig
    hit_rule: HitRule
    hash_mode_label: str
    events_endpoint: str
    replay_endpoint: str | None
    num_blocks: int
    vllm: bool = False  # built from a vLLM engine's /metrics (`speckv.router.vllm_engine`)

    @property
    def reproduction_key(self) -> tuple[Any, ...]:
        """What must stay equal across an epoch for the index entries to stay meaningful."""
        h = self.hashing
        return (h.algo, h.seed, h.block_size, h.lookahead_tokens, self.hit_rule,
                self.tokenizer, self.served_model_name)


def _field(engine: str, body: dict[str, Any], name: str, kind: type | tuple[type, ...],
           allow_none: bool = False) -> Any:
    if name not in body:
        raise ContractError(engine, name, "missing (is the engine a speckv serve of this "
                            "version?)")
    value = body[name]
    if value is None and allow_none:
        return None
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ContractError(engine, name, f"expected {kind}, got {value!r}")
    return value


def connect_endpoint(bound: str, engine_url: str) -> str:
    """The endpoint a router connects to for one an engine bound: a wildcard host becomes the
    engine URL's host (`tcp://*:5557` of http://10.0.0.2:8000 -> tcp://10.0.0.2:5557)."""
    if not bound.startswith("tcp://"):
        return bound  # ipc:// and inproc:// name the same thing everywhere they can be reached
    host, sep, port = bound[len("tcp://"):].rpartition(":")
    if not sep:
        return bound
    if host in _WILDCARDS:
        host = urlsplit(engine_url).hostname or "127.0.0.1"
        if ":" in host:
            host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _group_rules(engine: str, groups: list[Any], block_size: int, alignment: int,
                 lookahead: int) -> tuple[GroupRule, ...]:
    """One `GroupRule` per `kv_groups` entry, or a `ContractError` naming `kv_groups` (or
    `alignment_tokens`) for a group whose hits the router could not predict."""
    if not groups:
        raise ContractError(engine, "kv_groups", "no KV cache groups")
    rules = []
    for index, group in enumerate(groups):
        kind = group.get("kind") if isinstance(group, dict) else None
        if kind not in KINDS:
            raise ContractError(engine, "kv_groups", f"group {index}: kind {kind!r}; the "
                                f"router predicts {', '.join(KINDS)} groups")
        size, window = group.get("block_size"), group.get("sliding_window")
        group_lookahead = group.get("lookahead_tokens")
        if not isinstance(size, int) or size <= 0 or size % block_size:
            raise ContractError(engine, "kv_groups", f"group {index}: block_size {size!r} is "
                                f"not a multiple of the hash unit {block_size}")
        if alignment <= 0 or alignment % size:
            raise ContractError(engine, "alignment_tokens", f"{alignment} is not a multiple "
                                f"of group {index}'s block size {size}")
        expected = 0 if kind == "mamba" else lookahead
        if group_lookahead != expected:
            raise ContractError(engine, "kv_groups", f"group {index} ({kind}) lookahead "
                                f"{group_lookahead!r} != {expected} (hash_mode L {lookahead})")
        if kind == "sliding_window" and (not isinstance(window, int) or window <= 0):
            raise ContractError(engine, "kv_groups", f"group {index}: sliding_window "
                                f"{window!r}")
        rules.append(GroupRule(index, kind, size, expected,
                               window if kind == "sliding_window" else None))
    return tuple(rules)


def parse_contract(engine: str, engine_url: str, body: Any) -> EngineContract:
    """The contract, or a `ContractError` naming the first field the router cannot use."""
    if not isinstance(body, dict):
        raise ContractError(engine, "contract", f"not a JSON object: {body!r:.80}")
    version = _field(engine, body, "contract_version", int)
    if version != SUPPORTED_VERSION:
        raise ContractError(engine, "contract_version", f"{version}; this router reads "
                            f"version {SUPPORTED_VERSION} (upgrade the older of the two)")
    algo = _field(engine, body, "hash_algo", str)
    if algo not in HASH_ALGOS:
        raise ContractError(engine, "hash_algo", f"{algo!r} is not one the router can "
                            f"reproduce ({', '.join(HASH_ALGOS)})")
    seed = _field(engine, body, "hash_seed", str, allow_none=True)
    if seed is None:
        raise ContractError(engine, "hash_seed", "the engine hashes with a random seed, which "
                            "nobody can reproduce: start it with --hash-seed S (or "
                            "PYTHONHASHSEED)")
    block_size = _field(engine, body, "block_size", int)
    alignment = _field(engine, body, "alignment_tokens", int)
    groups = _field(engine, body, "kv_groups", list)
    mode = _field(engine, body, "hash_mode", dict)
    lookahead = mode.get("lookahead_tokens")
    drops = mode.get("drops_last_unit")
    if not isinstance(lookahead, int) or isinstance(lookahead, bool) or lookahead < 0 \
            or not isinstance(drops, bool) or (lookahead and drops):
        raise ContractError(engine, "hash_mode", f"{mode!r} is neither lookahead L nor "
                            "legacy with or without the drop")
    rules = _group_rules(engine, groups, block_size, alignment, lookahead)
    single_full = len(rules) == 1 and rules[0].kind == "full_attention"
    if single_full and (rules[0].block_size != block_size or alignment != block_size):
        raise ContractError(engine, "alignment_tokens", f"{alignment} with blocks of "
                            f"{block_size}: the router needs hits in whole blocks")
    events = _field(engine, body, "kv_events", dict, allow_none=True)
    if events is None or not events.get("endpoint"):
        raise ContractError(engine, "kv_events", "the engine publishes no KV events: start it "
                            "with --kv-events-endpoint tcp://*:PORT (and "
                            "--kv-events-replay-endpoint tcp://*:PORT2, so gaps can be filled)")
    if events.get("hash_encoding", "bytes") != "bytes":
        raise ContractError(engine, "kv_events", f"hash_encoding {events['hash_encoding']!r}: "
                            "the router recomputes hashes from full bytes")
    if events.get("topic"):
        raise ContractError(engine, "kv_events", f"topic {events['topic']!r}: the router "
                            "subscribes to the empty topic")
    replay = events.get("replay_endpoint")
    hashing = EngineHashConfig(algo=algo, seed=seed, block_size=block_size,
                               lookahead_tokens=lookahead)
    return EngineContract(
        engine=engine,
        epoch=_field(engine, body, "engine_epoch", str),
        served_model_name=_field(engine, body, "served_model_name", str),
        model=_field(engine, body, "model", str),
        max_model_len=_field(engine, body, "max_model_len", int),
        vocab_size=_field(engine, body, "vocab_size", int),
        tokenizer=_field(engine, body, "tokenizer", str, allow_none=True),
        hashing=hashing,
        hit_rule=HitRule(block_size, lookahead, drops,
                         bool(_field(engine, body, "prefix_caching", bool)),
                         bool(body.get("divergent_block_reuse", False)),
                         *(((), 0) if single_full else (rules, alignment))),
        hash_mode_label=str(mode.get("label", "")),
        events_endpoint=connect_endpoint(events["endpoint"], engine_url),
        replay_endpoint=connect_endpoint(replay, engine_url) if replay else None,
        num_blocks=_field(engine, body, "num_blocks", int),
    )
