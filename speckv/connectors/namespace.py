"""Who may share a persistent tier: the namespace, the model fingerprint, the seed rule.

Owns `DiskNamespace` (everything that changes a block's hash or its bytes: model weights,
dtype, block size, per-segment shapes, hash algorithm, hash seed, lookahead tokens `L`, codec
version), `fingerprint_tensors` (a content digest of weights) and `persistent_hash_seed`, which
refuses a random block-hash seed: hashes seeded at random cannot be reproduced by another
process, so a persistent tier keyed by them could never hit after a restart.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import cbor2
import torch
import xxhash

from speckv.connectors.codec import VERSION
from speckv.connectors.layout import BlockLayout
from speckv.hashing.functions import HASH_ALGOS


def persistent_hash_seed(hash_seed: str | None, what: str = "the disk KV tier") -> str:
    """The block-hash seed a persistent tier can rely on; ValueError if it would be random."""
    if hash_seed is not None:
        return hash_seed
    env = os.environ.get("PYTHONHASHSEED")
    if env is None:
        raise ValueError(
            f"{what} needs block hashes that another process can reproduce, but the block-hash "
            "seed is random in every process: set PYTHONHASHSEED (for example "
            "PYTHONHASHSEED=0) in the environment, or EngineConfig.hash_seed"
        )
    return env


def fingerprint_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A digest of named weights: names, shapes, dtypes and every byte (xxh3-128 per tensor).

    Use the target's and the drafter's parameters together: draft KV depends on both.
    """
    digest = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        data = tensor.detach().contiguous().cpu()
        digest.update(cbor2.dumps([name, list(data.shape), str(data.dtype)]))
        digest.update(xxhash.xxh3_128_digest(memoryview(data.reshape(-1).view(torch.uint8).numpy())))
    return digest.hexdigest()


@dataclass(frozen=True)
class DiskNamespace:
    """Blocks stored under one namespace can only meet engines that agree on all of it."""

    model_fingerprint: str
    hash_algo: str
    hash_seed: str
    lookahead_tokens: int
    layout: BlockLayout
    # one KV cache group of a hybrid model ("<group>:<kind>"; "" for a one-group model)
    group: str = ""

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("a disk namespace needs a model fingerprint")
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algorithm {self.hash_algo!r}")
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {self.lookahead_tokens}")

    def fields(self) -> dict[str, object]:
        """Plain data, written beside the blocks as `namespace.json`."""
        return {
            "format_version": VERSION,
            "model_fingerprint": self.model_fingerprint,
            "hash_algo": self.hash_algo,
            "hash_seed": self.hash_seed,
            "lookahead_tokens": self.lookahead_tokens,
            "block_size": self.layout.block_size,
            "segments": self.layout.describe(),
            **({"group": self.group} if self.group else {}),
        }

    @cached_property
    def ident(self) -> str:
        """32 hex digits of the SHA-256 of the canonical CBOR of `fields()`."""
        return hashlib.sha256(cbor2.dumps(self.fields(), canonical=True)).hexdigest()[:32]

    @property
    def dirname(self) -> str:
        return f"ns-{self.ident}"


def lane_label(mode: Any) -> str:
    """The namespace's group field for a tier mode: "" unless it carries one group of a
    hybrid model (`ConnectorMode.group`)."""
    group = getattr(mode, "group", None)
    return "" if group is None else f"{group.group_id}:{group.kind}"
