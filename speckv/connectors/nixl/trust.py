"""Which prefill engines a decode engine will talk to.

Owns the peer policy of `--kv-transfer-config` (`kv_connector_extra_config`):

    kv_peers      ["10.0.0.5", "10.0.0.6:5600"]  side channels a decode engine may contact
                  (a host: any port; host:port: that port only). Hosts compare as written
                  (an IP address in its normal form), never resolved: no DNS on a request.
    kv_secret     a shared secret: a prefill engine signs its `kv_transfer_params`
                  (`signature`, HMAC-SHA256 over the params' canonical JSON), a decode
                  engine refuses params without a valid one. `SPECKV_KV_SECRET` in the
                  environment is read when the JSON has none (a secret on a command line is
                  visible to every user of the machine).

Neither set: loopback peers only (127.0.0.0/8, ::1, localhost). A secret and no `kv_peers`:
any host the signed params name (the signer vouches for it). Both: both must hold.

`PeerPolicy.check` is pure (no network): it runs when a request is added, so a refused request
is a 400 naming `kv_transfer_params.signature` or `kv_transfer_params.host` and the engine
never contacts the address.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.connectors.nixl.params import ParamsError

SECRET_ENV = "SPECKV_KV_SECRET"


def canonical_bytes(obj: Mapping[str, Any]) -> bytes:
    """The params as signed: JSON, keys sorted, no spaces, without `signature`. Both sides
    compute it from the JSON object the API carries, so a router passing it on untouched
    keeps it valid."""
    unsigned = {key: value for key, value in obj.items() if key != "signature"}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":"),
                      ensure_ascii=True).encode()


def sign(obj: Mapping[str, Any], secret: bytes) -> str:
    """HMAC-SHA256 of `canonical_bytes(obj)` under `secret`, hex."""
    return hmac.new(secret, canonical_bytes(obj), hashlib.sha256).hexdigest()


def _normal_host(host: str) -> str:
    text = host.strip().lower()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return text


def _is_loopback(host: str) -> bool:
    normal = _normal_host(host)
    if normal == "localhost":
        return True
    try:
        return ipaddress.ip_address(normal).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Peer:
    """One `kv_peers` entry: a host, and a port (None: any)."""

    host: str
    port: int | None = None

    @classmethod
    def parse(cls, text: Any) -> Peer:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"--kv-transfer-config kv_connector_extra_config.kv_peers: each "
                             f"peer is \"host\" or \"host:port\", got {text!r}")
        text = text.strip()
        host, port = text, None
        if text.startswith("["):  # [v6] or [v6]:port
            host, _, rest = text[1:].partition("]")
            if rest:
                port = rest.removeprefix(":")
        elif text.count(":") == 1:
            host, port = text.split(":")
        if port is not None:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--kv-transfer-config kv_connector_extra_config.kv_peers: "
                                 f"{text!r} has no valid port")
            return cls(_normal_host(host), int(port))
        return cls(_normal_host(host))

    def admits(self, host: str, port: int) -> bool:
        return self.host == _normal_host(host) and self.port in (None, port)

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


@dataclass(frozen=True)
class PeerPolicy:
    """The decode side's rule for a `kv_transfer_params`' side channel (module docstring)."""

    peers: tuple[Peer, ...] | None = None  # None: not configured
    secret: bytes | None = field(default=None, repr=False)

    @classmethod
    def parse(cls, peers: Any, secret: Any) -> PeerPolicy:
        """From `kv_peers` (a list of strings, or None) and `kv_secret` (a string, or None:
        `SPECKV_KV_SECRET` if set)."""
        if peers is not None and (isinstance(peers, str) or not isinstance(peers, Sequence)):
            raise ValueError("--kv-transfer-config kv_connector_extra_config.kv_peers must be "
                             f"a list of \"host\" or \"host:port\" strings, got {peers!r}")
        if secret is None:
            secret = os.environ.get(SECRET_ENV) or None
        if secret is not None and (not isinstance(secret, str) or not secret):
            raise ValueError("--kv-transfer-config kv_connector_extra_config.kv_secret must be "
                             "a non-empty string")
        return cls(None if peers is None else tuple(Peer.parse(p) for p in peers),
                   None if secret is None else secret.encode())

    def signed(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The prefill side's params with their `signature` (as they are: no secret)."""
        if self.secret is not None:
            obj["signature"] = sign(obj, self.secret)
        return obj

    def check(self, obj: Mapping[str, Any]) -> None:
        """ParamsError (field `signature` or `host`) unless the decode engine may contact the
        side channel these params name."""
        if self.secret is not None:
            given = obj.get("signature")
            if not isinstance(given, str) or not given:
                raise ParamsError("signature", "missing: this decode engine accepts only "
                                  "params signed by a prefill engine sharing its kv_secret")
            if not hmac.compare_digest(given, sign(obj, self.secret)):
                raise ParamsError("signature", "does not match these params under this "
                                  "engine's kv_secret (altered, or signed with another secret)")
        host, port = obj.get("host"), obj.get("port")
        if not isinstance(host, str) or isinstance(port, bool) or not isinstance(port, int):
            return  # the schema check names the field
        if self.peers is not None:
            if not any(peer.admits(host, port) for peer in self.peers):
                raise ParamsError("host", f"{host}:{port} is not in this decode engine's "
                                  f"kv_peers ({', '.join(map(str, self.peers))})")
        elif self.secret is None and not _is_loopback(host):
            raise ParamsError("host", f"{host} is not a loopback address, and this decode "
                              "engine has no kv_peers or kv_secret to trust any other (see "
                              "--kv-transfer-config kv_connector_extra_config)")

    def describe(self) -> str:
        """For the start-up line: which peers this engine accepts."""
        parts = []
        if self.peers is not None:
            parts.append("peers " + ", ".join(map(str, self.peers)))
        if self.secret is not None:
            parts.append("signed params only")
        return "; ".join(parts) if parts else "loopback peers only"
