"""Block-hash functions by name, and the per-process seed `NONE_HASH`.

Owns the mapping from a user-facing algorithm name to (encoding, digest). The encodings are the
ones vLLM uses, so hashes are bit-identical with the same seed:

| name          | encoding                         | digest     | cryptographic |
|---------------|----------------------------------|------------|---------------|
| `sha256`      | pickle, highest protocol         | SHA-256    | yes           |
| `sha256_cbor` | canonical CBOR (any language)    | SHA-256    | yes           |
| `xxhash`      | pickle, highest protocol         | xxh3-128   | no            |
| `xxhash_cbor` | canonical CBOR                   | xxh3-128   | no            |

A non-cryptographic algorithm is opt-in; the block pool then verifies every hit by comparing the
cached block's content with the request's (see `BlockPool`).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import cbor2

try:  # optional where speckv runs as a vLLM plugin: vLLM leaves xxhash uninstalled by default
    from xxhash import xxh3_128_digest as _xxh3_128_digest
except ImportError:  # pragma: no cover - depends on the environment

    def _xxh3_128_digest(data: bytes) -> bytes:
        raise ModuleNotFoundError(
            "the xxhash and xxhash_cbor algorithms need the xxhash package: pip install xxhash"
        )

BlockHash = bytes
Digest = Callable[[bytes], bytes]


class Encoding(Enum):
    PICKLE = "pickle"
    CBOR = "cbor"


def _sha256_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


@dataclass(frozen=True)
class HashAlgo:
    """One named block-hash algorithm: `hash(obj) = digest(encode(obj))`."""

    name: str
    encoding: Encoding
    digest: Digest
    cryptographic: bool

    def encode(self, obj: Any) -> bytes:
        return _pickle(obj) if self.encoding is Encoding.PICKLE else _cbor(obj)

    def __call__(self, obj: Any) -> BlockHash:
        return self.digest(self.encode(obj))


HASH_ALGOS: dict[str, HashAlgo] = {
    "sha256": HashAlgo("sha256", Encoding.PICKLE, _sha256_digest, cryptographic=True),
    "sha256_cbor": HashAlgo("sha256_cbor", Encoding.CBOR, _sha256_digest, cryptographic=True),
    "xxhash": HashAlgo("xxhash", Encoding.PICKLE, _xxh3_128_digest, cryptographic=False),
    "xxhash_cbor": HashAlgo(
        "xxhash_cbor", Encoding.CBOR, _xxh3_128_digest, cryptographic=False
    ),
}
DEFAULT_HASH_ALGO = "sha256"


def get_hash_algo(name: str) -> HashAlgo:
    """Look up an algorithm by name; a clear error lists the allowed names."""
    try:
        return HASH_ALGOS[name]
    except KeyError:
        allowed = ", ".join(HASH_ALGOS)
        raise ValueError(f"unknown hash algorithm {name!r}; choose one of: {allowed}") from None


def make_none_hash(algo: HashAlgo, seed: str | None = None) -> BlockHash:
    """The parent hash of block 0.

    `hash(PYTHONHASHSEED)` (the string) when the variable is set, so that separate processes
    (engines, routers) agree; otherwise 32 random bytes, private to this process.
    """
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED")
    return os.urandom(32) if seed is None else algo(seed)
