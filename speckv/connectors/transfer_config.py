"""`--kv-transfer-config`: vLLM's `KVTransferConfig` JSON, and the registry of the connectors
it names.

Owns the generic part of the JSON and which connector class each `kv_connector` name builds:

    {"kv_connector": "nixl",              a registered name (TRANSFER_CONNECTORS; vLLM's class
                                          names are aliases: "NixlConnector"): "nixl", the
                                          tiers "offload", "disk", "store", or
                                          "MultiConnector" with
                                          kv_connector_extra_config.connectors: [{...}, ...]
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_load_failure_policy": "recompute" | "fail",   the engine's one policy (over
                                          --kv-load-failure-policy)
     "kv_connector_extra_config": {...},  the connector's own options
     ...}                                 the rest: the connector's keys (`kv_port`, ...)

`KVTransferConfig.parse` checks the generic keys and hands the whole object to the named
connector's `parse`, which returns its typed options (errors name the JSON key); `build` makes
the connector. A tier's options are a `ConnectorConfig` from `kv_connector_extra_config` (its
keys: the `EngineArgs` keywords, `kv_offload_gib`, ...): `tiers()` hands it to the engine,
which builds tiers with its own identity, as it does for `--kv-connector`. The engine, the
API and the server only see `KVConnector`: they never name a concrete connector, and the
request's `kv_transfer_params` reach only the connector.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speckv.connectors.base import KVConnector
from speckv.connectors.config import LOAD_FAILURE_POLICIES, ConnectorConfig, options

ROLES: tuple[str, ...] = ("kv_producer", "kv_consumer", "kv_both")
PRODUCER_ROLES = frozenset({"kv_producer", "kv_both"})  # an engine that sends its KV
CONSUMER_ROLES = frozenset({"kv_consumer", "kv_both"})  # an engine that receives KV
EXTRA_CONFIG = "kv_connector_extra_config"


def json_object(text: str | dict[str, Any]) -> dict[str, Any]:
    """The `--kv-transfer-config` JSON text (or its dict) as a dict of its own."""
    if isinstance(text, str):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"--kv-transfer-config is not JSON: {error}") from None
    else:
        obj = text
    if not isinstance(obj, dict):
        raise ValueError("--kv-transfer-config must be a JSON object")
    return dict(obj)


def reject_unknown_keys(obj: dict[str, Any], known: tuple[str, ...], where: str = "",
                        owner: str = "") -> None:
    """ValueError naming the keys of `obj` not in `known` (`where`: " <key>" of a nested
    object; `owner`: " for <connector>")."""
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ValueError(f"--kv-transfer-config{where}: unknown key(s) {unknown}{owner}; "
                         f"known: {', '.join(known)}")


def extra_config(value: Any, known: tuple[str, ...], owner: str = "") -> dict[str, Any]:
    """`kv_connector_extra_config` (None: empty), checked to hold only `known` keys."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ValueError(f"--kv-transfer-config {EXTRA_CONFIG} must be a JSON object")
    reject_unknown_keys(value, known, f" {EXTRA_CONFIG}", owner)
    return value


def check_role(role: Any) -> None:
    if role not in ROLES:
        raise ValueError(f"--kv-transfer-config kv_role must be one of {', '.join(ROLES)}, "
                         f"got {role!r}")


def role_of(obj: dict[str, Any]) -> str:
    """`kv_role`, present and one of `ROLES`."""
    if "kv_role" not in obj:
        raise ValueError("--kv-transfer-config needs kv_role (kv_producer, kv_consumer or "
                         "kv_both)")
    check_role(obj["kv_role"])
    return obj["kv_role"]


@dataclass(frozen=True)
class TransferEntry:
    """One `kv_connector` name: its options from the JSON (`parse(obj, host)`, `host`: where a
    side channel binds, the server's `--host`) and the connector from them (`build(options,
    load_failure_policy, hash_algo, hash_seed)`)."""

    parse: Callable[[dict[str, Any], str], Any]
    build: Callable[[Any, str, str, str | None], KVConnector]
    describe: str  # for the flag's help


def _nixl_parse(obj: dict[str, Any], host: str) -> Any:
    from speckv.connectors.nixl.config import NixlConfig

    return NixlConfig.parse(obj, host=host)


def _nixl_build(options: Any, load_failure_policy: str, hash_algo: str,
                hash_seed: str | None) -> KVConnector:
    from speckv.connectors.nixl.connector import NixlConnector

    return NixlConnector(options, hash_algo, hash_seed, load_failure_policy)


def _tier_parse(name: str) -> Callable[[dict[str, Any], str], Any]:
    def parse(obj: dict[str, Any], host: str) -> ConnectorConfig:
        by_arg = {option.metadata["arg"]: option.name for option in options()}
        extra = extra_config(obj.get(EXTRA_CONFIG) or {}, tuple(by_arg), f" for {name}")
        try:
            return ConnectorConfig((name,), **{by_arg[key]: value
                                               for key, value in extra.items()})
        except ValueError as error:
            raise ValueError(f"--kv-transfer-config ({name}): {error}") from None
    return parse


def _tier_build(options: Any, load_failure_policy: str, hash_algo: str,
                hash_seed: str | None) -> KVConnector:
    raise ValueError("a KV tier is built by the engine (KVTransferConfig.tiers)")


def _multi_parse(obj: dict[str, Any], host: str) -> tuple[KVTransferConfig, ...]:
    extra = obj.get("kv_connector_extra_config") or {}
    children = extra.get("connectors") if isinstance(extra, dict) else None
    if not isinstance(children, list) or not children or set(extra) != {"connectors"}:
        raise ValueError("--kv-transfer-config MultiConnector needs kv_connector_extra_config "
                         "{\"connectors\": [{\"kv_connector\": ...}, ...]} (and nothing else)")
    parsed = []
    for child in children:
        if not isinstance(child, dict):
            raise ValueError("--kv-transfer-config MultiConnector: each connector is a JSON "
                             "object")
        parsed.append(KVTransferConfig.parse({"kv_role": obj["kv_role"], **child}, host))
    if any(child.kv_connector == "MultiConnector" for child in parsed):
        raise ValueError("--kv-transfer-config MultiConnector: connectors nest one level")
    others = [child.kv_connector for child in parsed
              if not isinstance(child.options, ConnectorConfig)]
    if len(others) > 1:
        raise ValueError(f"--kv-transfer-config MultiConnector: one transfer connector at "
                         f"most, got {', '.join(others)}")
    return tuple(parsed)


_NIXL = TransferEntry(_nixl_parse, _nixl_build, (
    "prefill/decode over NIXL; also kv_port, kv_lease_s, kv_transfer_timeout_s, engine_id, "
    "kv_connector_extra_config kv_peers / kv_secret; its side channel binds --host"))
_OFFLOAD = TransferEntry(_tier_parse("offload"), _tier_build, "the CPU tier (--kv-connector "
                         "offload; extra config: kv_offload_gib)")
TRANSFER_CONNECTORS: dict[str, TransferEntry] = {
    "nixl": _NIXL, "NixlConnector": _NIXL,
    "offload": _OFFLOAD, "OffloadingConnector": _OFFLOAD,
    "disk": TransferEntry(_tier_parse("disk"), _tier_build, "the disk tier (extra config: "
                          "kv_offload_dir, kv_offload_disk_gib)"),
    "store": TransferEntry(_tier_parse("store"), _tier_build, "the shared store (extra "
                           "config: kv_store_url, kv_store_gib, ...)"),
    "MultiConnector": TransferEntry(_multi_parse, _tier_build, "several, in order "
                                    "(extra config: connectors, a list of these objects)"),
}


def transfer_connectors_help() -> str:
    """The registered names (aliases together) and what each is, for the flag's help."""
    names: dict[int, list[str]] = {}
    for name, entry in TRANSFER_CONNECTORS.items():
        names.setdefault(id(entry), []).append(name)
    entries = {id(entry): entry for entry in TRANSFER_CONNECTORS.values()}
    return "; ".join(f"{' | '.join(group)}: {entries[key].describe}"
                     for key, group in names.items())


@dataclass(frozen=True)
class KVTransferConfig:
    """The parsed `--kv-transfer-config`: the generic keys and the connector's own options."""

    kv_connector: str
    kv_role: str
    kv_load_failure_policy: str | None  # None: --kv-load-failure-policy decides
    options: Any  # what TRANSFER_CONNECTORS[kv_connector].parse returned

    @property
    def is_producer(self) -> bool:
        return self.kv_role in PRODUCER_ROLES

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in CONSUMER_ROLES

    @classmethod
    def parse(cls, text: str | dict[str, Any], host: str = "127.0.0.1") -> KVTransferConfig:
        """From the JSON text (or its dict); ValueError naming the JSON key."""
        obj = json_object(text)
        name = obj.get("kv_connector")
        if name not in TRANSFER_CONNECTORS:
            raise ValueError(f"--kv-transfer-config kv_connector must be one of "
                             f"{', '.join(map(repr, TRANSFER_CONNECTORS))}, got {name!r}")
        role = role_of(obj)
        policy = obj.get("kv_load_failure_policy")
        if policy is not None and policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(f"--kv-transfer-config kv_load_failure_policy must be one of "
                             f"{', '.join(LOAD_FAILURE_POLICIES)}, got {policy!r}")
        rest = {key: value for key, value in obj.items() if key != "kv_load_failure_policy"}
        options = TRANSFER_CONNECTORS[name].parse(rest, host)
        return cls(name, role, policy, options)

    def parts(self) -> tuple[KVTransferConfig, ...]:
        """The named connectors, in order (a MultiConnector's children; else itself)."""
        return self.options if self.kv_connector == "MultiConnector" else (self,)

    def tiers(self) -> ConnectorConfig | None:
        """The KV tiers this JSON names, as one `ConnectorConfig` (None: none)."""
        tiers = [part.options for part in self.parts()
                 if isinstance(part.options, ConnectorConfig)]
        if not tiers:
            return None
        merged = {option.name: getattr(tiers[0], option.name) for option in options()}
        for tier in tiers[1:]:  # each tier's own options win for its own keys
            merged.update({option.name: getattr(tier, option.name) for option in options()
                           if getattr(tier, option.name) != option.default})
        try:
            return ConnectorConfig(tuple(name for tier in tiers for name in tier.names),
                                   **merged)
        except ValueError as error:
            raise ValueError(f"--kv-transfer-config: {error}") from None

    def transfer(self) -> KVTransferConfig | None:
        """The one connector that is not a tier (None: none; `parse` allows one)."""
        others = [part for part in self.parts() if not isinstance(part.options, ConnectorConfig)]
        return others[0] if others else None

    def build(self, load_failure_policy: str, hash_algo: str, hash_seed: str | None
              ) -> KVConnector:
        """The connector (not yet initialized), under the engine's one load-failure policy."""
        return TRANSFER_CONNECTORS[self.kv_connector].build(
            self.options, load_failure_policy, hash_algo, hash_seed)
