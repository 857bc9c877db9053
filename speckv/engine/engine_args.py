"""EngineArgs: the flat front door to the engine's configuration (as vLLM's `EngineArgs`).

Owns the knobs a user sets by name, `LLM(model, num_spec_tokens=3, kv_connector="offload")`
or through the CLI flags (`speckv.engine.cli_args`), and `create_engine_config()`, the one
place they become the nested, validated `EngineConfig`:

    block_size, num_blocks, kv_cache_memory_bytes, enable_prefix_caching, hash_*,
    disable_*, mamba_block_size                               -> EngineConfig.cache
    max_num_batched_tokens, max_num_seqs                      -> EngineConfig.scheduler
    speculative_method (None: off), num_spec_tokens, speculative_model,
    adaptive_speculation, prompt_lookup_*                     -> EngineConfig.speculative
    kv_connector + kv_offload_* / kv_store_* (or a whole kv_connector_config)
                                                              -> EngineConfig.kv_connector
    kv_transfer_config (the JSON) + kv_transfer_host         -> EngineConfig.kv_transfer
    kv_load_failure_policy (or the JSON's key)                -> EngineConfig.kv_load_failure_policy
    kv_events_endpoint, kv_events_replay_endpoint             -> EngineConfig.events
    threads, prefill_threads                                  -> EngineConfig (CPU threads)

Sizes say their unit: `kv_offload_gib`, `kv_offload_disk_gib`, `kv_store_gib` are GiB.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

from speckv.connectors.config import DEFAULT_LOAD_FAILURE_POLICY, ConnectorConfig, options
from speckv.connectors.disk import DEFAULT_DISK_GIB
from speckv.connectors.offload import DEFAULT_OFFLOAD_GIB
from speckv.connectors.redis_store import DEFAULT_TIMEOUT_S
from speckv.connectors.shared_store import DEFAULT_STORE_GIB, EMBEDDED
from speckv.connectors.transfer_config import KVTransferConfig
from speckv.engine.config import (
    DEFAULT_KV_CACHE_MEMORY_BYTES,
    CacheConfig,
    EngineConfig,
    EventsConfig,
    SchedulerConfig,
    SpeculativeConfig,
    check_speculation_knobs,
)


@dataclass(frozen=True)
class EngineArgs:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "auto"
    device: str = "auto"
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    seed: int = 0
    speculative_method: str | None = None  # None: no speculation
    num_spec_tokens: int = 0
    speculative_model: str | None = None
    disable_lookahead_block_hashes: bool = False
    disable_divergent_block_reuse: bool = False
    adaptive_speculation: bool = True
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    draft_model: str | None = None  # deprecated alias of speculative_model (one release)
    kv_connector: str | None = None  # e.g. "offload" or "offload,disk"
    kv_offload_gib: float = DEFAULT_OFFLOAD_GIB  # CPU tier size
    kv_offload_dir: str | None = None  # disk tier directory (needed by "disk")
    kv_offload_disk_gib: float = DEFAULT_DISK_GIB  # disk tier size bound
    kv_store_url: str = EMBEDDED  # shared store: redis[s]://..., or a private Valkey server
    kv_store_gib: float = DEFAULT_STORE_GIB  # maxmemory of the embedded Valkey server
    kv_store_cluster: bool = False  # the store URL names a Redis Cluster node
    kv_store_optional: bool = False  # start without the store when it is unreachable
    kv_store_timeout_s: float = DEFAULT_TIMEOUT_S  # per store call, then a miss
    kv_load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY  # a failed load: recompute | fail
    # the connector settings whole (what the CLI parses); instead of kv_connector + kv_*
    kv_connector_config: ConnectorConfig | None = None
    threads: int | None = None  # CPU compute threads; None: torch's setting
    prefill_threads: int | None = None  # of prefill-sized steps; None: as threads
    # a KV transfer connector (prefill/decode over NIXL): the `--kv-transfer-config` JSON
    # (text or dict; speckv.connectors.transfer_config); a side channel binds
    # `kv_transfer_host`. None: off
    kv_transfer_config: str | dict[str, Any] | None = None
    kv_transfer_host: str = "127.0.0.1"
    mamba_block_size: int | None = None

    def create_engine_config(self) -> EngineConfig:
        """The nested `EngineConfig` (ValueError naming the field that is wrong)."""
        parsed = (None if self.kv_transfer_config is None else
                  KVTransferConfig.parse(self.kv_transfer_config, host=self.kv_transfer_host))
        transfer = parsed.transfer() if parsed is not None else None
        kv_connector = self._kv_connector()
        tiers = parsed.tiers() if parsed is not None else None
        if tiers is not None:  # vLLM's JSON naming a tier: as --kv-connector would
            if kv_connector is not None:
                raise ValueError("--kv-transfer-config names KV tiers and --kv-connector too; "
                                 "name them in one of the two")
            kv_connector = tiers
        return EngineConfig(
            cache=CacheConfig(
                block_size=self.block_size, num_blocks=self.num_blocks,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                enable_prefix_caching=self.enable_prefix_caching, hash_algo=self.hash_algo,
                hash_seed=self.hash_seed,
                disable_lookahead_block_hashes=self.disable_lookahead_block_hashes,
                disable_divergent_block_reuse=self.disable_divergent_block_reuse,
                mamba_block_size=self.mamba_block_size),
            scheduler=SchedulerConfig(self.max_num_batched_tokens, self.max_num_seqs),
            speculative=self._speculative(),
            kv_connector=kv_connector,
            kv_transfer=transfer,
            events=self._events(),
            kv_load_failure_policy=(
                parsed.kv_load_failure_policy  # the JSON's key, as vLLM's
                if parsed is not None and parsed.kv_load_failure_policy is not None
                else self.kv_load_failure_policy),
            dtype=self.dtype, device=self.device, max_model_len=self.max_model_len,
            seed=self.seed, threads=self.threads, prefill_threads=self.prefill_threads,
        )

    def _speculative(self) -> SpeculativeConfig | None:
        model = self.speculative_model
        if self.draft_model is not None:
            warnings.warn("EngineArgs.draft_model is deprecated; use speculative_model",
                          DeprecationWarning, stacklevel=4)
            if model not in (None, self.draft_model):
                raise ValueError("EngineArgs: set speculative_model or draft_model, not both")
            model = self.draft_model
        n = self.num_spec_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"EngineArgs.num_spec_tokens must be an int >= 0, got {n!r}")
        if self.speculative_method is None:
            check_speculation_knobs(self.adaptive_speculation, self.prompt_lookup_min,
                                    self.prompt_lookup_max)
            if n:
                raise ValueError("EngineArgs.num_spec_tokens needs a speculative_method")
            if model is not None:
                raise ValueError("EngineArgs.speculative_model needs speculative_method in "
                                 "('eagle', 'eagle3', 'mtp'), got None")
            return None
        return SpeculativeConfig(self.speculative_method, n, model, self.adaptive_speculation,
                                 self.prompt_lookup_min, self.prompt_lookup_max)

    def _kv_connector(self) -> ConnectorConfig | None:
        if self.kv_connector_config is not None:
            if self.kv_connector is not None:
                raise ValueError("EngineArgs: set kv_connector or kv_connector_config, not both")
            return self.kv_connector_config
        if self.kv_connector is None:
            if self.kv_offload_dir is not None:
                raise ValueError("EngineArgs.kv_offload_dir needs kv_connector='disk' (or "
                                 "'offload,disk')")
            return None
        if not isinstance(self.kv_connector, str):
            raise ValueError(f"EngineArgs.kv_connector must be a string like 'offload,disk', "
                             f"got {self.kv_connector!r}")
        try:
            given = {option.name: getattr(self, option.metadata["arg"]) for option in options()}
            if given["offload_dir"] is not None:  # a Path is fine
                given["offload_dir"] = str(given["offload_dir"])
            return ConnectorConfig.parse(self.kv_connector, **given)
        except ValueError as error:
            raise ValueError(f"EngineArgs.kv_connector: {error}") from None

    def _events(self) -> EventsConfig | None:
        if self.kv_events_endpoint is None:
            if self.kv_events_replay_endpoint is not None:
                raise ValueError("EngineArgs.kv_events_replay_endpoint needs "
                                 "kv_events_endpoint")
            return None
        return EventsConfig(self.kv_events_endpoint, self.kv_events_replay_endpoint)



def engine_config(**kwargs: Any) -> EngineConfig:
    """`EngineArgs(**kwargs).create_engine_config()` in one call (benches and tests that build
    an `LLMEngine` directly)."""
    return EngineArgs(**kwargs).create_engine_config()
