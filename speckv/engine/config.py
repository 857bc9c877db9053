"""EngineConfig: every engine knob in one frozen, validated place.

Owns the engine's shape: block size, KV cache size (a block count, or a memory budget turned
into one), the per-step token budget, the batch size limit, the context limit, prefix caching,
dtype/device, the block-hash algorithm and seed, the speculative proposer, where KV events
are published (the engine then makes the publisher) and the KV connector (`kv_connector`:
tiers beyond the local prefix cache, e.g. "offload" or "offload,disk"). Bad values raise a
ValueError naming the field.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from speckv.connectors.config import ConnectorConfig, check_load_failure_policy
from speckv.connectors.disk import DEFAULT_DISK_GIB
from speckv.connectors.namespace import persistent_hash_seed
from speckv.connectors.nixl.config import NixlConfig
from speckv.connectors.offload import DEFAULT_OFFLOAD_GIB
from speckv.hashing.functions import HASH_ALGOS

SPECULATIVE_METHODS: tuple[str, ...] = ("ngram", "eagle", "eagle3", "mtp")
DRAFTER_METHODS: tuple[str, ...] = ("eagle", "eagle3", "mtp")  # need a speculative_model
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024**2
# Draft j is accepted only after drafts 1..j-1 were, so acceptance falls geometrically with j:
# past a handful, more drafts only cost (verification rows, draft forwards, lookahead slots).
MAX_NUM_SPEC_TOKENS = 16
ZMQ_TRANSPORTS: tuple[str, ...] = ("tcp://", "ipc://", "inproc://")


def _check_positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks incl. the null block; None: from the budget
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES  # used when num_blocks is None
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running requests, at most
    max_model_len: int | None = None  # tokens per sequence; None: the model's max positions
    enable_prefix_caching: bool = True
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available, else cpu
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # NONE_HASH seed; None: PYTHONHASHSEED or random
    seed: int = 0  # base of per-request sampling seeds when a request sets none
    speculative_method: str | None = None  # None, "ngram", or a drafter: eagle / eagle3 / mtp
    num_spec_tokens: int = 0  # drafts proposed per request per step
    # the EAGLE / EAGLE3 / MTP drafter's checkpoint dir, or "builtin" (the built-in model's
    # shipped EAGLE head)
    speculative_model: str | None = None
    disable_lookahead_block_hashes: bool = False  # legacy hashes + the last-block drop
    # with lookahead hashes, a block cached under another successor is copied and its last L
    # positions recomputed (prompts diverging at a block boundary); True: recompute the block
    disable_divergent_block_reuse: bool = False
    # draft fewer tokens, or none, when measurement says drafting does not pay (batch size,
    # acceptance); False: always num_spec_tokens (speckv/spec/adaptive.py)
    adaptive_speculation: bool = True
    prompt_lookup_min: int = 1  # n-gram proposer: shortest suffix matched, tokens
    prompt_lookup_max: int = 3  # n-gram proposer: longest suffix matched, tokens
    kv_events_endpoint: str | None = None  # ZeroMQ PUB endpoint for KV events; None: off
    kv_events_replay_endpoint: str | None = None  # ROUTER endpoint answering replay requests
    draft_model: str | None = None  # deprecated alias of speculative_model (one release)
    # KV tiers beyond the local prefix cache, fastest first, comma-separated: "offload" (CPU),
    # "disk", "offload,disk" (see speckv.connectors.config); None: none
    kv_connector: str | None = None
    kv_offload_gb: float = DEFAULT_OFFLOAD_GIB  # CPU tier size, GiB of host memory
    kv_offload_dir: str | None = None  # disk tier directory (needed by "disk")
    kv_offload_disk_gb: float = DEFAULT_DISK_GIB  # disk tier size bound, GiB
    kv_store_url: str = "embedded"  # shared store: redis[s]://..., or a private Valkey server
    kv_store_gb: float = 4.0  # maxmemory of the embedded Valkey server, GiB
    kv_store_cluster: bool = False  # the store URL names a Redis Cluster node
    kv_store_optional: bool = False  # start without the store when it is unreachable
    kv_store_timeout_s: float = 1.0  # per store call, then a miss
    # prefill/decode transfer over NIXL: the `--kv-transfer-config` JSON
    # ({"kv_connector": "nixl", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", ...},
    # speckv.connectors.nixl.config); its side channel binds `kv_transfer_host`. None: off
    kv_transfer_config: str | None = None
    kv_transfer_host: str = "127.0.0.1"
    kv_load_failure_policy: str = "recompute"  # a failed KV load: "recompute" or "fail"
    # tokens per Mamba / GDN state block of a hybrid model: the state checkpoint interval and
    # so the alignment unit of prefix hits (a multiple of block_size); None: the model's
    # default (544 with block_size 16)
    mamba_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.draft_model is not None:
            warnings.warn("EngineConfig.draft_model is deprecated; use speculative_model",
                          DeprecationWarning, stacklevel=3)
            if self.speculative_model not in (None, self.draft_model):
                raise ValueError("EngineConfig: set speculative_model or draft_model, not both")
            object.__setattr__(self, "speculative_model", self.draft_model)
            object.__setattr__(self, "draft_model", None)
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("num_blocks", self.num_blocks, allow_none=True)
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("EngineConfig.num_blocks must be >= 2 (block 0 is the null block)")
        _check_positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(
                f"EngineConfig.enable_prefix_caching must be a bool, got "
                f"{self.enable_prefix_caching!r}"
            )
        dtype = str(self.dtype).removeprefix("torch.")
        dtype = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(dtype, dtype)
        if dtype not in DTYPES:
            raise ValueError(f"EngineConfig.dtype must be one of {DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.device, str) or not (
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda")
        ):
            raise ValueError(
                f"EngineConfig.device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(
                f"EngineConfig.hash_algo must be one of {tuple(HASH_ALGOS)}, got "
                f"{self.hash_algo!r}"
            )
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineConfig.seed must be an int, got {self.seed!r}")
        if self.speculative_method not in (None, *SPECULATIVE_METHODS):
            raise ValueError(
                f"EngineConfig.speculative_method must be None or one of {SPECULATIVE_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if (
            not isinstance(self.num_spec_tokens, int)
            or isinstance(self.num_spec_tokens, bool)
            or self.num_spec_tokens < 0
        ):
            raise ValueError(
                f"EngineConfig.num_spec_tokens must be an int >= 0, got {self.num_spec_tokens!r}"
            )
        if self.num_spec_tokens > MAX_NUM_SPEC_TOKENS:
            raise ValueError(
                f"EngineConfig.num_spec_tokens must be <= {MAX_NUM_SPEC_TOKENS}, got "
                f"{self.num_spec_tokens} (acceptance falls with every draft position: beyond a "
                "few drafts each step only costs more)"
            )
        if self.speculative_method is not None and self.num_spec_tokens == 0:
            raise ValueError("EngineConfig.num_spec_tokens must be >= 1 with a speculative_method")
        if self.speculative_method is None and self.num_spec_tokens:
            raise ValueError("EngineConfig.num_spec_tokens needs a speculative_method")
        if (self.speculative_model is not None
                and self.speculative_method not in DRAFTER_METHODS):
            raise ValueError(
                f"EngineConfig.speculative_model needs speculative_method in {DRAFTER_METHODS}, "
                f"got {self.speculative_method!r}"
            )
        if not isinstance(self.adaptive_speculation, bool):
            raise ValueError("EngineConfig.adaptive_speculation must be a bool")
        if not isinstance(self.disable_lookahead_block_hashes, bool):
            raise ValueError("EngineConfig.disable_lookahead_block_hashes must be a bool")
        if not isinstance(self.disable_divergent_block_reuse, bool):
            raise ValueError("EngineConfig.disable_divergent_block_reuse must be a bool")
        _check_positive_int("mamba_block_size", self.mamba_block_size, allow_none=True)
        if self.mamba_block_size is not None and self.mamba_block_size % self.block_size:
            raise ValueError(f"EngineConfig.mamba_block_size ({self.mamba_block_size}) must be a "
                             f"multiple of block_size ({self.block_size})")
        _check_positive_int("prompt_lookup_min", self.prompt_lookup_min)
        _check_positive_int("prompt_lookup_max", self.prompt_lookup_max)
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError("EngineConfig.prompt_lookup_max must be >= prompt_lookup_min")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, str) or not value.startswith(ZMQ_TRANSPORTS)
            ):
                raise ValueError(
                    f"EngineConfig.{name} must be a ZeroMQ endpoint starting with one of "
                    f"{ZMQ_TRANSPORTS} (e.g. tcp://*:5557), got {value!r}"
                )
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("EngineConfig.kv_events_replay_endpoint needs kv_events_endpoint")
        self._check_connector()
        if self.max_num_batched_tokens < 1 + self.num_spec_tokens:
            raise ValueError(
                "EngineConfig.max_num_batched_tokens must fit one decode step "
                f"(1 + num_spec_tokens = {1 + self.num_spec_tokens})"
            )

    def _check_connector(self) -> None:
        try:
            check_load_failure_policy(self.kv_load_failure_policy)
        except ValueError as error:
            raise ValueError(f"EngineConfig.kv_load_failure_policy: {error}") from None
        if self.kv_transfer_config is not None:
            if not self.enable_prefix_caching:
                raise ValueError("--kv-transfer-config needs prefix caching: a transfer is "
                                 "checked against the decode engine's own block hashes")
            persistent_hash_seed(self.hash_seed, "--kv-transfer-config (a prefill and a "
                                 "decode engine must hash blocks alike)")
            transfer = self.transfer_config()
            assert transfer is not None
            if transfer.load_failure_policy is not None:  # the JSON's key, as vLLM's
                object.__setattr__(self, "kv_load_failure_policy",
                                   transfer.load_failure_policy)
        if self.kv_connector is None:
            if self.kv_offload_dir is not None:
                raise ValueError("EngineConfig.kv_offload_dir needs kv_connector='disk' (or "
                                 "'offload,disk')")
            return
        if not isinstance(self.kv_connector, str):
            raise ValueError(f"EngineConfig.kv_connector must be a string like 'offload,disk', "
                             f"got {self.kv_connector!r}")
        if self.kv_offload_dir is not None:
            object.__setattr__(self, "kv_offload_dir", str(self.kv_offload_dir))
        if not self.enable_prefix_caching:
            raise ValueError("EngineConfig.kv_connector needs enable_prefix_caching: tiers are "
                             "keyed by the prefix cache's block hashes")
        try:
            connector = self.connector_config()
            assert connector is not None
            if "disk" in connector.names or "store" in connector.names:
                persistent_hash_seed(self.hash_seed)  # a random seed could never hit again
        except ValueError as error:
            raise ValueError(f"EngineConfig.kv_connector: {error}") from None

    # ---- derived -------------------------------------------------------------------------------
    def connector_config(self) -> ConnectorConfig | None:
        """The KV connector's settings (None: no connector). ValueError names the CLI flag."""
        if self.kv_connector is None:
            return None
        return ConnectorConfig.parse(self.kv_connector, offload_gib=self.kv_offload_gb,
                                     offload_dir=self.kv_offload_dir,
                                     disk_gib=self.kv_offload_disk_gb,
                                     store_url=self.kv_store_url, store_gib=self.kv_store_gb,
                                     store_cluster=self.kv_store_cluster,
                                     store_optional=self.kv_store_optional,
                                     store_timeout_s=self.kv_store_timeout_s,
                                     load_failure_policy=self.kv_load_failure_policy)

    def transfer_config(self) -> NixlConfig | None:
        """The prefill/decode transfer settings (None: off). ValueError names the JSON key."""
        if self.kv_transfer_config is None:
            return None
        return NixlConfig.parse(self.kv_transfer_config, host=self.kv_transfer_host)

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("EngineConfig.device: CUDA was requested but is not available")
        return torch.device(self.device)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().type == "cuda" else "float32"
