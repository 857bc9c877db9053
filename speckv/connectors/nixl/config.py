"""`--kv-transfer-config`: the JSON that turns an engine into a prefill or a decode engine.

Owns `NixlConfig` (frozen, validated; errors name the JSON key) and its parsing:

    {"kv_connector": "nixl",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_port": 0,                        side channel port (0: any free port)
     "kv_lease_s": 30.0,                  how long a prefill engine keeps unpulled blocks
     "kv_transfer_timeout_s": 10.0,       a decode engine's wait for the handshake and a READ
     "kv_load_failure_policy": "recompute" | "fail",   read by `transfer_config.py`
     "engine_id": "prefill-0",            default: a random id per start
     "kv_connector_extra_config": {
         "kv_peers": ["10.0.0.5", "10.0.0.6:5600"],   side channels a decode engine may contact
         "kv_secret": "..."}}                  signs (prefill) / is required (decode) on params

The side channel binds to `--host` (the same address the HTTP server listens on). Which peers a
decode engine trusts (default: loopback only) is `trust.PeerPolicy`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from speckv.connectors.nixl.lease import DEFAULT_LEASE_S
from speckv.connectors.nixl.trust import PeerPolicy
from speckv.connectors.transfer_config import (
    CONSUMER_ROLES,
    PRODUCER_ROLES,
    check_role,
    extra_config,
    json_object,
    reject_unknown_keys,
    role_of,
)

DEFAULT_TRANSFER_TIMEOUT_S = 10.0
_KEYS = ("kv_connector", "kv_role", "kv_port", "kv_lease_s", "kv_transfer_timeout_s",
         "engine_id", "kv_connector_extra_config")
_EXTRA_KEYS = ("kv_peers", "kv_secret")


@dataclass(frozen=True)
class NixlConfig:
    role: str
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = DEFAULT_LEASE_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S
    engine_id: str = field(default_factory=lambda: f"speckv-{uuid.uuid4().hex[:12]}")
    policy: PeerPolicy = field(default_factory=PeerPolicy)

    def __post_init__(self) -> None:
        check_role(self.role)
        if isinstance(self.port, bool) or not isinstance(self.port, int) \
                or not 0 <= self.port < 65536:
            raise ValueError(f"--kv-transfer-config kv_port must be a TCP port, got "
                             f"{self.port!r}")
        for key, value in (("kv_lease_s", self.lease_s),
                           ("kv_transfer_timeout_s", self.transfer_timeout_s)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"--kv-transfer-config {key} must be a number > 0, got "
                                 f"{value!r}")
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError("--kv-transfer-config engine_id must be a non-empty string")

    @property
    def is_producer(self) -> bool:
        return self.role in PRODUCER_ROLES

    @property
    def is_consumer(self) -> bool:
        return self.role in CONSUMER_ROLES

    @classmethod
    def parse(cls, text: str | dict[str, Any], host: str = "127.0.0.1") -> NixlConfig:
        """From the `--kv-transfer-config` JSON text (or its dict)."""
        obj = json_object(text)
        reject_unknown_keys(obj, _KEYS)
        if obj.get("kv_connector") not in ("nixl", "NixlConnector"):
            raise ValueError(f"--kv-transfer-config kv_connector must be \"nixl\", got "
                             f"{obj.get('kv_connector')!r}")
        options: dict[str, Any] = {"role": role_of(obj), "host": host,
                                   "policy": _policy(obj.get("kv_connector_extra_config"))}
        for key, name in (("kv_port", "port"), ("kv_lease_s", "lease_s"),
                          ("kv_transfer_timeout_s", "transfer_timeout_s"),
                          ("engine_id", "engine_id")):
            if key in obj:
                options[name] = obj[key]
        return cls(**options)



def _policy(extra: Any) -> PeerPolicy:
    """The peer policy of `kv_connector_extra_config` (None: the defaults)."""
    extra = extra_config(extra, _EXTRA_KEYS)
    return PeerPolicy.parse(extra.get("kv_peers"), extra.get("kv_secret"))
