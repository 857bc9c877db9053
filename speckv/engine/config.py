"""EngineConfig: the engine's configuration, nested by what each part owns, frozen and
validated part by part (each sub-config checks itself; `EngineConfig` checks how they combine).

    EngineConfig
      cache         CacheConfig          block size, KV size (block count or byte budget),
                                         prefix caching, block-hash algorithm / seed / mode,
                                         the GDN state block size
      scheduler     SchedulerConfig      per-step token budget, running requests
      speculative   SpeculativeConfig | None    method, drafts per step, drafter, adaptive
                                                (None: no speculation)
      kv_connector  ConnectorConfig | None      KV tiers beyond the local prefix cache
                                                (`--kv-connector`)
      kv_transfer   KVTransferConfig | None     a KV transfer connector, e.g. prefill/decode
                                                over NIXL (`--kv-transfer-config`)
      events        EventsConfig | None         where KV events are published
      kv_load_failure_policy, dtype, device, max_model_len, seed

Users fill the flat `EngineArgs` (`speckv.engine.engine_args`, what `LLM(...)` keywords and
the CLI flags set); `EngineArgs.create_engine_config()` builds this. Errors name the flat
`EngineArgs` field, so the CLI shows them as its flags (`speckv.commands.cli_words`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from speckv.connectors.config import (
    DEFAULT_LOAD_FAILURE_POLICY,
    ConnectorConfig,
    check_load_failure_policy,
)
from speckv.connectors.namespace import persistent_hash_seed
from speckv.connectors.transfer_config import KVTransferConfig
from speckv.hashing.functions import HASH_ALGOS
from speckv.speculation.methods import METHODS

SPECULATIVE_METHODS: tuple[str, ...] = tuple(METHODS)  # `--speculative-method`, registered
# the methods that run a drafter model (need a speculative model)
DRAFTER_METHODS: tuple[str, ...] = tuple(name for name, method in METHODS.items()
                                         if method.needs_drafter)
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEFAULT_KV_CACHE_MEMORY_BYTES = 512 * 1024**2
# Draft j is accepted only after drafts 1..j-1 were, so acceptance falls geometrically with j:
# past a handful, more drafts only cost (verification rows, draft forwards, draft slots).
MAX_NUM_SPEC_TOKENS = 16
ZMQ_TRANSPORTS: tuple[str, ...] = ("tcp://", "ipc://", "inproc://")


def _positive_int(name: str, value: object, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"EngineArgs.{name} must be a positive int, got {value!r}")


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"EngineArgs.{name} must be a bool, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_blocks: int | None = None  # KV blocks incl. the null block; None: from the budget
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_MEMORY_BYTES  # used when num_blocks is None
    enable_prefix_caching: bool = True
    hash_algo: str = "sha256"
    hash_seed: str | None = None  # NONE_HASH seed; None: PYTHONHASHSEED or random
    disable_lookahead_block_hashes: bool = False  # legacy hashes + the last-block drop
    # with lookahead hashes, a block cached under another successor is copied and its last L
    # positions recomputed (prompts diverging at a block boundary); True: recompute the block
    disable_divergent_block_reuse: bool = False
    # tokens per Mamba / GDN state block of a hybrid model: the state checkpoint interval and
    # so the alignment unit of prefix hits (a multiple of block_size); None: the model's
    # default (544 with block_size 16)
    mamba_block_size: int | None = None

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("num_blocks", self.num_blocks, allow_none=True)
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError("EngineArgs.num_blocks must be >= 2 (block 0 is the null block)")
        _positive_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.hash_algo not in HASH_ALGOS:
            raise ValueError(f"EngineArgs.hash_algo must be one of {tuple(HASH_ALGOS)}, got "
                             f"{self.hash_algo!r}")
        _bool("disable_lookahead_block_hashes", self.disable_lookahead_block_hashes)
        _bool("disable_divergent_block_reuse", self.disable_divergent_block_reuse)
        _positive_int("mamba_block_size", self.mamba_block_size, allow_none=True)
        if self.mamba_block_size is not None and self.mamba_block_size % self.block_size:
            raise ValueError(f"EngineArgs.mamba_block_size ({self.mamba_block_size}) must be a "
                             f"multiple of block_size ({self.block_size})")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 64  # running requests, at most

    def __post_init__(self) -> None:
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive_int("max_num_seqs", self.max_num_seqs)


def check_speculation_knobs(adaptive: bool, prompt_lookup_min: int,
                            prompt_lookup_max: int) -> None:
    """The speculation knobs that are checked with speculation off too (a typo fails early)."""
    _bool("adaptive_speculation", adaptive)
    _positive_int("prompt_lookup_min", prompt_lookup_min)
    _positive_int("prompt_lookup_max", prompt_lookup_max)
    if prompt_lookup_max < prompt_lookup_min:
        raise ValueError("EngineArgs.prompt_lookup_max must be >= prompt_lookup_min")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int  # drafts proposed per request per step, 1..16
    # the EAGLE / EAGLE3 / MTP drafter's checkpoint dir, or "builtin" (the built-in model's
    # shipped EAGLE head); None: the drafter is passed to the engine built
    model: str | None = None
    # draft fewer tokens, or none, when measurement says drafting does not pay (batch size,
    # acceptance); False: always num_speculative_tokens (speckv/speculation/adaptive.py)
    adaptive: bool = True
    prompt_lookup_min: int = 1  # n-gram proposer: shortest suffix matched, tokens
    prompt_lookup_max: int = 3  # n-gram proposer: longest suffix matched, tokens

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"EngineArgs.speculative_method must be None or one of "
                             f"{SPECULATIVE_METHODS}, got {self.method!r}")
        n = self.num_speculative_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("EngineArgs.num_spec_tokens must be >= 1 with a "
                             f"speculative_method, got {n!r}")
        if n > MAX_NUM_SPEC_TOKENS:
            raise ValueError(
                f"EngineArgs.num_spec_tokens must be <= {MAX_NUM_SPEC_TOKENS}, got {n} "
                "(acceptance falls with every draft position: beyond a few drafts each step "
                "only costs more)")
        if self.model is not None and self.method not in DRAFTER_METHODS:
            raise ValueError(f"EngineArgs.speculative_model needs speculative_method in "
                             f"{DRAFTER_METHODS}, got {self.method!r}")
        check_speculation_knobs(self.adaptive, self.prompt_lookup_min, self.prompt_lookup_max)


@dataclass(frozen=True)
class EventsConfig:
    endpoint: str  # ZeroMQ PUB endpoint for KV events
    replay_endpoint: str | None = None  # ROUTER endpoint answering replay requests

    def __post_init__(self) -> None:
        for name, value in (("kv_events_endpoint", self.endpoint),
                            ("kv_events_replay_endpoint", self.replay_endpoint)):
            if value is not None and (
                    not isinstance(value, str) or not value.startswith(ZMQ_TRANSPORTS)):
                raise ValueError(
                    f"EngineArgs.{name} must be a ZeroMQ endpoint starting with one of "
                    f"{ZMQ_TRANSPORTS} (e.g. tcp://*:5557), got {value!r}")


def _dtype_name(dtype: object) -> str:
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if name not in DTYPES:
        raise ValueError(f"EngineArgs.dtype must be one of {DTYPES}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class EngineConfig:
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculation
    kv_connector: ConnectorConfig | None = None  # None: the local prefix cache only
    kv_transfer: KVTransferConfig | None = None  # None: no KV transfer connector
    events: EventsConfig | None = None  # None: no KV events published
    # what a failed KV load (a tier's, or a transfer's) does to its request: recompute from the
    # first failed token, or end it with an error (vLLM's kv_load_failure_policy)
    kv_load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY
    dtype: str = "auto"  # "auto": bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # "auto": cuda when available, else cpu
    max_model_len: int | None = None  # tokens per sequence; None: the model's max positions
    seed: int = 0  # base of per-request sampling seeds when a request sets none
    threads: int | None = None  # CPU compute threads; None: torch's setting as it stands
    # compute threads of steps longer than the single-threaded kernels' rows (prefill chunks;
    # speckv.engine.step_threads); None: as `threads`
    prefill_threads: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        for flag, value in (("--threads", self.threads),
                            ("--prefill-threads", self.prefill_threads)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < 1):
                raise ValueError(f"{flag} must be >= 1, got {value!r}")
        if not isinstance(self.device, str) or not (
                self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"EngineArgs.device must be 'auto', 'cpu' or 'cuda[:N]', got "
                             f"{self.device!r}")
        _positive_int("max_model_len", self.max_model_len, allow_none=True)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"EngineArgs.seed must be an int, got {self.seed!r}")
        check_load_failure_policy(self.kv_load_failure_policy)
        if self.kv_connector is not None:
            self._check_kv_connector(self.kv_connector)
        if self.kv_transfer is not None:
            if not self.cache.enable_prefix_caching:
                raise ValueError("--kv-transfer-config needs prefix caching: a transfer is "
                                 "checked against the decode engine's own block hashes")
            persistent_hash_seed(self.cache.hash_seed, "--kv-transfer-config (a prefill and a "
                                 "decode engine must hash blocks alike)")
        if self.scheduler.max_num_batched_tokens < 1 + self.num_spec_tokens:
            raise ValueError("EngineArgs.max_num_batched_tokens must fit one decode step "
                             f"(1 + num_spec_tokens = {1 + self.num_spec_tokens})")

    def _check_kv_connector(self, connector: ConnectorConfig) -> None:
        if not self.cache.enable_prefix_caching:
            raise ValueError("EngineArgs.kv_connector needs enable_prefix_caching: tiers are "
                             "keyed by the prefix cache's block hashes")
        if "disk" in connector.names or "store" in connector.names:
            try:
                persistent_hash_seed(self.cache.hash_seed)  # a random seed never hits again
            except ValueError as error:
                raise ValueError(f"EngineArgs.kv_connector: {error}") from None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_spec_tokens(self) -> int:
        """Drafts per request per step (0: no speculation)."""
        return 0 if self.speculative is None else self.speculative.num_speculative_tokens

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("EngineArgs.device: CUDA was requested but is not available")
        return torch.device(self.device)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().type == "cuda" else "float32"
