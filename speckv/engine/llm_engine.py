"""LLMEngine: add requests, step, abort. The front of the engine for `LLM` and the server.

Owns turning user input into scheduler requests (tokenization, validation against the vocab,
`max_model_len` and the KV cache size, sampling seeds), building the parts from an
`EngineConfig`, and one step's outer order:

    EngineCore.step (core.py): schedule → run → update (scheduler.py, model_runner.py)
    OutputProcessor (output_processor.py): detokenize, stop strings, deltas → RequestOutput
        a stop string ends its request in the core (its last block cached, then freed)
    publish the step's KV events (optional): the local cache's, then the KV connector's tiers'

The KV cache groups come from the model (`model.kv_cache_layout(block_size)`: full attention,
sliding window, ...): the cache manager gets one group per entry (the alignment unit follows
from their block sizes, the hash mode from the drafter), the runner one block table per group.
Every layer keeps a `[num_blocks, ...]` tensor, so a block id costs the bytes of all layers
whichever group holds it (simple, over-provisioned for multi-group models).

With `EngineConfig.kv_connector`, the engine builds the connector (`kv_connector.py`), resolves
its hash mode from the drafter AND the connector's lookahead capability (`hash_mode.reason`
says why; logged at start-up), and binds the connector to the target's and drafter's caches.
When the engine goes idle, the saves of the requests that just left are snapshotted (their
stores proceed in the background); `close()` settles every store, then stops the tiers.

Bad requests raise a ValueError from `add_request` and never enter the batch; the engine keeps
serving the others.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from speckv.attention import bytes_per_block
from speckv.cache import KVCacheManager
from speckv.cache.block_pool import hit_check_for
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.cache.hash_mode import HashMode
from speckv.cache.retention import TailWidening
from speckv.connectors import ConnectorStats, KVConnector
from speckv.engine.config import EngineConfig
from speckv.engine.core import EngineCore
from speckv.engine.kv_connector import (
    RunnerConnector,
    SchedulerConnector,
    build_connector,
    initialize_connector,
)
from speckv.engine.messages import FinishReason
from speckv.engine.model_runner import ModelRunner
from speckv.engine.output_processor import OutputProcessor
from speckv.engine.outputs import RequestOutput
from speckv.engine.request import Request
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.scheduler import Scheduler
from speckv.engine.speculative import Drafter, make_proposer, resolve_connector_hash_mode
from speckv.engine.stats import SchedulerStats
from speckv.hashing.functions import get_hash_algo
from speckv.models.kv_layout import KVCacheLayout
from speckv.models.llama import LlamaForCausalLM
from speckv.models.tokenizer import Tokenizer
from speckv.spec.adaptive import (
    AdaptiveSpecConfig,
    AdaptiveSpeculation,
    Clock,
    SpecDecodeStats,
    default_clock,
)
from speckv.spec.policy import NO_DRAFTER, DrafterPolicy
from speckv.spec.proposer import Proposer


class EventPublisher(Protocol):
    def publish(self, events: Sequence[KVCacheEvent]) -> Any: ...


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        proposer: Proposer | None = None,
        event_publisher: EventPublisher | None = None,
        detokenize: bool = True,
        drafter: Drafter | None = None,
        connector: KVConnector | None = None,
        *,
        layout: KVCacheLayout | None = None,
        retention_interval: int | None = None,
        tail_widening: TailWidening = TailWidening.UNIT,
        spec_clock: Clock | None = None,
    ) -> None:
        """`connector`: a KV connector to use instead of the one `config.kv_connector` names
        (not yet initialized; the engine initializes it and closes it).

        Cache-policy overrides (benches, tests): `layout` replaces the model's KV cache groups
        (e.g. other block sizes per group; the drafter's group keeps `config.block_size`);
        `retention_interval` / `tail_widening` go to the `KVCacheManager` (sliding-window
        tails kept only at multiples of the interval, and how they widen). `spec_clock`: what
        the adaptive draft length times steps with (default `default_clock` of the model's
        device; tests pass a scripted one)."""
        self.config = config = config or EngineConfig()
        if connector is not None and config.kv_connector is not None:
            raise ValueError("pass a connector or set EngineConfig.kv_connector, not both")
        self.model = model
        self.tokenizer = tokenizer
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        block_size = config.block_size
        assert model_config.head_dim is not None
        # a drafter's KV layers share the target's blocks (same heads and head size)
        num_draft_layers = drafter.num_kv_layers if drafter is not None else 0
        if config.mamba_block_size is not None and not getattr(model, "is_hybrid", False):
            raise ValueError("EngineConfig.mamba_block_size applies to models with a GDN / "
                             "Mamba state group only")
        context = model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > context:
            # as vLLM: positions past the model's context give noise, not an error
            raise ValueError(f"max_model_len {config.max_model_len} is more than the model's "
                             f"context of {context} tokens (max_position_embeddings in its "
                             "config)")
        if config.num_blocks is not None:
            self.num_blocks = config.num_blocks
        else:
            if hasattr(model, "kv_cache_bytes_per_block"):
                # layers of different KV shapes (Gemma 4), KV + GDN state (hybrids): the model
                # sizes its own blocks
                per_block = model.kv_cache_bytes_per_block(block_size)
                if num_draft_layers:
                    per_block += bytes_per_block(num_draft_layers, block_size,
                                                 model_config.num_key_value_heads,
                                                 model_config.head_dim, model.dtype)
            else:
                per_block = bytes_per_block(model_config.num_hidden_layers + num_draft_layers,
                                            block_size, model_config.num_key_value_heads,
                                            model_config.head_dim, model.dtype)
            self.num_blocks = config.kv_cache_memory_bytes // per_block
            if self.num_blocks < 2:  # named as the config field: the CLI shows it as its flag
                raise ValueError(f"kv_cache_memory_bytes ({config.kv_cache_memory_bytes:,} "
                                 f"bytes) fits {self.num_blocks} KV blocks of {per_block:,} "
                                 "bytes; at least 2 are needed (block 0 is the null block)")
        clock = spec_clock or default_clock(model.device.type)
        if proposer is None:
            proposer = make_proposer(config, drafter, self.num_blocks, clock)
        self.proposer = proposer
        self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0
        layout = layout or (
            model.kv_cache_layout(block_size, config.mamba_block_size)
            if getattr(model, "is_hybrid", False) else model.kv_cache_layout(block_size))
        if num_draft_layers and layout.draft_group is None:
            # the drafter's KV is full attention: no block of it may be freed
            layout = layout.as_one_full_group()
        self.layout = layout
        draft_group = layout.draft_group
        if num_draft_layers and draft_group is not None \
                and layout.specs[draft_group].block_size != block_size:
            raise ValueError(f"the drafter's KV group has blocks of "
                             f"{layout.specs[draft_group].block_size} tokens; block_size is "
                             f"{block_size}: they must be equal")
        if proposer is not None and getattr(proposer, "kv_cache", None) is not None \
                and layout.draft_group is None:
            raise ValueError("a drafter's KV needs a full-attention KV cache group; this model "
                             f"has none ({layout.describe()}): pass the drafter as `drafter`")
        if layout.num_groups > 1 and (connector is not None or config.kv_connector is not None
                                      or config.kv_transfer_config is not None):
            raise ValueError(
                "KV connectors support single-group (full-attention) models only; this model "
                f"has {layout.num_groups} KV cache groups ({layout.describe()}): drop "
                "--kv-connector")
        if connector is not None and not config.enable_prefix_caching:
            raise ValueError("a KV connector needs enable_prefix_caching: tiers are keyed by "
                             "the prefix cache's block hashes")
        self.connector: KVConnector | None = (
            connector if connector is not None else build_connector(config, model, drafter))
        self._closed = False
        self.hash_mode = self._resolve_hash_mode(proposer.policy if proposer else NO_DRAFTER)
        self._owned_publisher: Any = None  # made from the config; close() ends it
        if event_publisher is None and config.kv_events_endpoint is not None:
            from speckv.events.publisher import publisher_for_endpoints

            event_publisher = self._owned_publisher = publisher_for_endpoints(
                config.kv_events_endpoint, config.kv_events_replay_endpoint)
        self.event_publisher = event_publisher
        algo = get_hash_algo(config.hash_algo)
        self.manager = KVCacheManager(
            layout.specs,
            self.num_blocks,
            self.hash_mode,
            enable_caching=config.enable_prefix_caching,
            hit_check=hit_check_for(algo),
            event_sink=KVEventSink() if event_publisher is not None else None,
            retention_interval=retention_interval,
            tail_widening=tail_widening,
        )
        self.hashing = self.manager.block_hashing(algo, config.hash_seed)
        connector = self.connector
        self.scheduler = Scheduler(
            self.manager, config.max_num_batched_tokens, config.max_num_seqs, self.num_spec_tokens,
            SchedulerConnector(connector, self.manager, config.kv_load_failure_policy)
            if connector is not None else None,
        )
        # how many drafts each step verifies (adaptive unless config says otherwise)
        self.spec_policy = None if proposer is None else AdaptiveSpeculation(AdaptiveSpecConfig(
            self.num_spec_tokens, adaptive=config.adaptive_speculation), clock)
        self.runner = ModelRunner(
            model, self.num_blocks, block_size, proposer,
            RunnerConnector(connector, block_size) if connector is not None else None,
            layout,
            spec_policy=self.spec_policy,
        )
        if connector is not None:
            initialize_connector(connector, self.runner.kv_cache,
                                 getattr(proposer, "kv_cache", None), self.hash_mode, block_size)
        self.core = EngineCore(self.scheduler, self.runner)
        self.output_processor = OutputProcessor(tokenizer, detokenize)
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(eos) or tuple(model_config.eos_token_ids)
        self._counter = itertools.count()
        self.last_stats: SchedulerStats | None = None  # the last step's, set by every step()

    def _resolve_hash_mode(self, policy: DrafterPolicy) -> HashMode:
        """Lookahead hashes or the legacy drop for this engine, from the drafter's policy and
        the KV connector's capability."""
        return resolve_connector_hash_mode(
            policy,
            enable_prefix_caching=self.config.enable_prefix_caching,
            disable_lookahead_block_hashes=self.config.disable_lookahead_block_hashes,
            connector=self.connector,
            reuse_divergent_blocks=not self.config.disable_divergent_block_reuse,
        )

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. Raises ValueError (engine unchanged) if bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        index = next(self._counter)
        request_id = request_id if request_id is not None else f"req-{index}"
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer")
            if not prompt:
                raise ValueError("the prompt is empty")
            token_ids: Sequence[int] = self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                f"({self.max_model_len})"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        seed = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + index
        request = Request(
            request_id,
            token_ids,
            self.hashing,
            max_tokens=params.max_tokens,
            eos_token_ids=stop_ids,
            vocab_size=self.vocab_size,
            arrival_time=time.perf_counter(),
            max_model_len=self.max_model_len,
            sampling_params=params,
            sampling_seed=seed,
        )
        # every KV cache group holds its own blocks of a prefill chunk
        capacity = (self.num_blocks - 1) // self.layout.num_groups * self.config.block_size
        if request.num_prompt_tokens + 1 + self.num_spec_tokens > capacity:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens but the KV cache holds "
                f"{capacity} tokens in all"
            )
        self.scheduler.add_request(request)  # first: it refuses an id a KV transfer holds
        self.output_processor.add_request(
            request_id, request.prompt_token_ids, params, request.arrival_time
        )
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None: unknown)."""
        output = self.output_processor.abort(request_id)
        self.scheduler.finish_requests([request_id], FinishReason.ABORT)
        self._settle_if_idle()
        return output

    def get_request(self, request_id: str) -> Request:
        """The scheduler-side state of an unfinished request (read-only use)."""
        request = self.scheduler.get_request(request_id)
        if request is None:
            raise KeyError(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def spec_decode_stats(self) -> SpecDecodeStats | None:
        """Speculation so far: per-position acceptance, draft lengths chosen (None: off)."""
        return self.spec_policy.stats() if self.spec_policy is not None else None

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced tokens or
        finished in it (deltas since the previous output)."""
        if self._closed:
            raise RuntimeError("the engine is closed")
        if self.scheduler.num_unfinished == 0 and self.scheduler.num_held_requests:
            # only blocks kept for a transfer: a step just polls for their release, so do
            # not spin the CPU doing it
            time.sleep(0.001)
        outputs, stopped_ids = self.output_processor.process(self.core.step())
        params = self.scheduler.finish_requests(stopped_ids, FinishReason.STOP)
        if params:  # a stop string ended them after their output was made
            outputs = [replace(output, kv_transfer_params=params[output.request_id])
                       if output.request_id in params else output for output in outputs]
        self._settle_if_idle()
        # taken every step, published or not: a tier's events pile up otherwise
        tier_events = self.connector.take_events() if self.connector is not None else []
        if self.event_publisher is not None:
            events = self.manager.take_events() + tier_events
            if events:
                self.event_publisher.publish(events)
        self.last_stats = self.scheduler.take_stats()
        return outputs

    # ---- KV cache and connector ---------------------------------------------------------------
    def _settle_if_idle(self) -> None:
        """No request left: snapshot the saves of those that just left now (no step would),
        so their stores go on in the background. Does not wait."""
        if (self.connector is not None and not self._closed
                and not self.scheduler.has_unfinished_requests()):
            self.connector.flush(timeout_s=0)

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget the local prefix cache (and, with `reset_connector`, everything the KV
        connector's tiers hold). False, with nothing forgotten locally, while requests hold
        blocks; False too if a tier kept blocks it is loading."""
        reset = self.manager.reset_prefix_cache()
        if self.event_publisher is not None:  # now, not at the next step: routers must know
            events = self.manager.take_events()
            if events:
                self.event_publisher.publish(events)
        if reset_connector and self.connector is not None:
            reset = self.connector.reset_cache() and reset
        return reset

    def kv_connector_stats(self) -> dict[str, ConnectorStats]:
        """Counters per tier (empty without a connector)."""
        return self.connector.stats() if self.connector is not None else {}

    def flush_kv_connector(self, timeout_s: float | None = None) -> bool:
        """Between steps: store every pending save and wait for the tiers. True if all
        settled within `timeout_s` (True without a connector)."""
        return self.connector.flush(timeout_s) if self.connector is not None else True

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Settle the tiers' pending stores (up to `timeout_s`), stop their threads, and shut
        the KV-event publisher the engine made from its config. The engine must not step
        afterwards. Idempotent."""
        if self.connector is not None and not self._closed:
            self._closed = True
            self.connector.flush(timeout_s)
            self.connector.shutdown()
        if self._owned_publisher is not None:
            self._owned_publisher.shutdown()
            self._owned_publisher = None

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
