"""KV connectors: move KV blocks (target and draft) between this engine and other tiers.

Depends on `speckv.cache`, `speckv.attention` and `speckv.hashing` only: never on the engine
or `speckv.speculation`.

| module          | owns |
|-----------------|------|
| `base.py`       | the interface (scheduler side / worker side) and where the engine calls it |
| `metadata.py`   | the typed messages between the two sides, stats |
| `rules.py`      | which blocks a tier may serve and store, under lookahead or legacy + drop |
| `capability.py` | the lookahead capability rule and the engine's hash mode from it |
| `layout.py`     | a block's shape across the target and drafter caches; device copies |
| `codec.py`      | a block's bytes: prefix, msgpack header, raw tensors; checked decoding |
| `store.py`      | the storage protocol behind a tier |
| `tier.py`       | `TierConnector`: the tier connector, its three parts composed |
| `tier_scheduler.py` | its scheduler side: lookups, planned loads, saves, the step's metadata |
| `tier_worker.py` | its worker side: snapshot of the step's saves, then its loads |
| `tier_copier.py` | its copy thread (or seeded schedule), staging slots, counters, events |
| `host_pool.py`  | the CPU pool (LRU, pins, GiB-sized) |
| `offload.py`    | `OffloadConnector` (CPU tier) and the no-capability variant |
| `namespace.py`  | who may share a persistent tier; weight fingerprints; the seed rule |
| `disk.py`       | `DiskConnector`: one file per block, atomic writes, size bound |
| `redis_store.py` | the store behind the shared tier: Valkey/Redis keys, checks, health |
| `embedded_valkey.py` | the private valkey-server of `--kv-store-url embedded` |
| `shared_store.py` | `StoreConnector`: the shared tier over Valkey/Redis (Cluster) |
| `multi.py`      | `MultiConnector` |
| `config.py`     | `ConnectorConfig` (each option spelled once), the CLI flags, `make_connector` |
| `transfer_config.py` | `KVTransferConfig` (vLLM's `--kv-transfer-config`), the name registry |
| `nixl/`         | prefill/decode over NIXL: `NixlConnector` (named only by the registry) |
"""

from speckv.connectors.base import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    ExternalHit,
    FinishDecision,
    GroupBlockIds,
    KVConnector,
    ReleasedBlocks,
    RequestBlocks,
    TransferParamsError,
)
from speckv.connectors.capability import (
    KVGroupSupport,
    kv_group_blocker,
    lookahead_blocker,
    supports_lookahead,
)
from speckv.connectors.config import (
    CONNECTORS,
    ConnectorConfig,
    ConnectorEntry,
    TierIdentity,
    add_connector_arguments,
    connector_config_from_args,
    make_connector,
    register_connector,
)
from speckv.connectors.disk import DiskConnector
from speckv.connectors.layout import BlockLayout, DeviceKV
from speckv.connectors.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    LoadFailure,
    MultiConnectorMetadata,
    StepMetadata,
)
from speckv.connectors.multi import MultiConnector
from speckv.connectors.namespace import fingerprint_tensors, persistent_hash_seed
from speckv.connectors.offload import NoLookaheadOffloadConnector, OffloadConnector
from speckv.connectors.rules import ConnectorMode, ConnectorRequest
from speckv.connectors.shared_store import MEDIUM_STORE, StoreConnector

__all__ = [
    "CONNECTORS",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_STORE",
    "BlockLayout",
    "ConnectorConfig",
    "ConnectorEntry",
    "ConnectorMetadata",
    "ConnectorMode",
    "ConnectorOutput",
    "ConnectorRequest",
    "ConnectorStats",
    "DeviceKV",
    "DiskConnector",
    "ExternalHit",
    "FinishDecision",
    "GroupBlockIds",
    "KVConnector",
    "KVGroupSupport",
    "LoadFailure",
    "MultiConnector",
    "MultiConnectorMetadata",
    "NoLookaheadOffloadConnector",
    "OffloadConnector",
    "ReleasedBlocks",
    "RequestBlocks",
    "StepMetadata",
    "StoreConnector",
    "TierIdentity",
    "TransferParamsError",
    "add_connector_arguments",
    "connector_config_from_args",
    "fingerprint_tensors",
    "kv_group_blocker",
    "lookahead_blocker",
    "make_connector",
    "persistent_hash_seed",
    "register_connector",
    "supports_lookahead",
]
