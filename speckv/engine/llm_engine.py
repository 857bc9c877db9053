"""LLMEngine: add requests, step, abort. The front of the engine for `LLM` and the server.

Owns turning user input into scheduler requests (tokenization, validation against the vocab,
`max_model_len` and the KV cache size, sampling seeds), building the parts from an
`EngineConfig`, and one step's outer order:

    EngineCore.step (core.py): schedule → run → update (scheduler.py, model_runner.py)
        a stop string (found by the OutputProcessor in the runner's sampled tokens) is an
        input of the update, which ends its request (its last block cached, then freed)
    OutputProcessor (output_processor.py): detokenize, deltas → RequestOutput
    publish the step's KV events (optional): the local cache's, then the KV connector's tiers'

The KV cache groups come from the model (`model.kv_cache_layout(block_size)`: full attention,
sliding window, ...): the cache manager gets one group per entry (the alignment unit follows
from their block sizes, the hash mode from the drafter), the runner one block table per group.
With a configured `num_blocks` every layer keeps a `[num_blocks, ...]` tensor (one pool that
every group draws from: a block id costs the bytes of all layers whichever group holds it);
from a memory budget a hybrid layout gets one pool per group instead (`kv_budget.py`: each
group's tensors have the rows its pool has), reported as `kv_budget`.

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
from typing import Any, Protocol

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import NO_DRAFTER
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.cache.hash_mode import HashMode
from speckv.cache.hit_check import hit_check_for
from speckv.cache.retention import TailWidening
from speckv.connectors import ConnectorStats, KVConnector
from speckv.engine.config import EngineConfig
from speckv.engine.core import EngineCore
from speckv.engine.engine_check import check_connector_groups, check_engine, check_model_fits
from speckv.engine.host_memory import keep_freed_memory
from speckv.engine.kv_budget import plan_kv_budget
from speckv.engine.kv_connector import (
    RunnerConnector,
    SchedulerConnector,
    build_connector,
    initialize_connector,
)
from speckv.engine.kv_plan import KVCachePlan, plan_kv_cache
from speckv.engine.messages import FinishReason
from speckv.engine.model_runner import ModelRunner
from speckv.engine.output_processor import OutputProcessor
from speckv.engine.outputs import RequestOutput
from speckv.engine.request import Request
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.scheduler import Scheduler
from speckv.engine.speculative import Drafter, make_proposer, resolve_connector_hash_mode
from speckv.engine.stats import SchedulerStats
from speckv.engine.step_threads import step_threads_for
from speckv.hashing.functions import get_hash_algo
from speckv.models.base import TargetModel
from speckv.models.common.kv_layout import KVCacheLayout
from speckv.models.common.native_linear import single_threaded_max_rows
from speckv.models.common.tokenizer import Tokenizer
from speckv.speculation.adaptive import (
    AdaptiveSpecConfig,
    AdaptiveSpeculation,
    Clock,
    SpeculationReport,
    default_clock,
)
from speckv.speculation.proposer import Proposer


class EventPublisher(Protocol):
    def publish(self, events: Sequence[KVCacheEvent]) -> Any: ...


class LLMEngine:
    def __init__(
        self,
        model: TargetModel,
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
        hash_mode: HashMode | None = None,
    ) -> None:
        """`connector`: a KV connector to use instead of the one `config.kv_connector` names
        (not yet initialized; the engine initializes it and closes it).

        Cache-policy overrides (benches, tests): `layout` replaces the model's KV cache groups
        (e.g. other block sizes per group; the drafter's group keeps `config.cache.block_size`);
        `retention_interval` / `tail_widening` go to the `KVCacheManager` (sliding-window
        tails kept only at multiples of the interval, and how they widen). `spec_clock`: what
        the adaptive draft length times steps with (default `default_clock` of the model's
        device; tests pass a scripted one). `hash_mode`: used instead of the one resolved from the
        drafter and the connector (the negative control of `bench draft-kv`).

        The body is the start-up order, one call per part (plan and budget, proposer, checks,
        connector, hash mode, parts)."""
        self.config = config = config or EngineConfig()
        cache = config.cache
        self.model = model
        if model.device.type == "cpu":
            keep_freed_memory()  # once per process: a forward's buffers stay paged in
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.max_model_len = config.max_model_len or model.config.max_position_embeddings
        check_model_fits(model, config)
        # a drafter's KV layers share the target's blocks (same heads and head size)
        num_draft_layers = drafter.num_kv_layers if drafter is not None else 0
        plan = self._plan_kv(num_draft_layers, layout, retention_interval, tail_widening,
                             speculates=drafter is not None or config.speculative is not None)
        clock = spec_clock or default_clock(model.device.type)
        if proposer is None:
            proposer = make_proposer(config, drafter, self.num_blocks, clock)
        self.proposer = proposer
        self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0
        check_engine(plan.layout, config, num_draft_layers=num_draft_layers, proposer=proposer,
                     connector=connector)
        self.connector = self._own_connector(connector, drafter, plan.layout)
        self._closed = False
        # lookahead hashes or the legacy drop, from the drafter's policy and the connector
        self.hash_mode = hash_mode or resolve_connector_hash_mode(
            proposer.policy if proposer else NO_DRAFTER,
            enable_prefix_caching=cache.enable_prefix_caching,
            disable_lookahead_block_hashes=cache.disable_lookahead_block_hashes,
            connector=self.connector,
            reuse_divergent_blocks=not cache.disable_divergent_block_reuse,
        )
        self._owned_publisher: Any = None  # made from the config; close() ends it
        self.event_publisher = (event_publisher if event_publisher is not None
                                else self._configured_publisher())
        self._build_parts(model, proposer, clock, retention_interval, tail_widening)
        self.output_processor = OutputProcessor(tokenizer, detokenize)
        # stop strings: the output processor finds them, the core applies them
        self.core = EngineCore(self.scheduler, self.runner, self.output_processor)
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(eos) or tuple(model.config.eos_token_ids)
        self._counter = itertools.count()
        self.last_stats: SchedulerStats | None = None  # the last step's, set by every step()

    def _plan_kv(self, num_draft_layers: int, layout: KVCacheLayout | None,
                 retention_interval: int | None, tail_widening: TailWidening, *,
                 speculates: bool) -> KVCachePlan:
        """The KV cache plan (layout, block ids) and the blocks of each group's pool."""
        model, config = self.model, self.config
        cache = config.cache
        self.kv_plan = plan = plan_kv_cache(
            model, block_size=cache.block_size, num_blocks=cache.num_blocks,
            budget_bytes=cache.kv_cache_memory_bytes, state_block_size=cache.mamba_block_size,
            num_draft_layers=num_draft_layers, layout=layout)
        self.layout = plan.layout
        self.kv_budget = plan_kv_budget(
            model, plan.layout, plan.num_blocks, cache, config.scheduler,
            num_draft_layers=num_draft_layers, retention_interval=retention_interval,
            tail_widening=tail_widening,
            speculates=speculates)
        # rows of each group's tensors: one shared count, or one per group (per-group pools);
        # `num_blocks` is the full-attention (drafter's) group's: what holds the context
        self.group_num_blocks = tuple(group.num_blocks for group in self.kv_budget.groups)
        self.num_blocks = self.group_num_blocks[plan.layout.draft_group or 0]
        return plan

    def _own_connector(self, connector: KVConnector | None, drafter: Drafter | None,
                       layout: KVCacheLayout) -> KVConnector | None:
        """`connector`, or the one the config names (built here, so shut down here if the
        model's KV cache groups do not fit it)."""
        own: KVConnector | None = (connector if connector is not None
                                   else build_connector(self.config, self.model, drafter))
        try:
            check_connector_groups(own, layout, self.config)
        except ValueError:
            if connector is None and own is not None:
                own.shutdown()  # built here: nothing else would stop its threads
            raise
        return own

    def _configured_publisher(self) -> EventPublisher | None:
        """The KV-event publisher `config.events` names (None: none); the engine owns it."""
        events = self.config.events
        if events is None:
            return None
        from speckv.events.publisher import publisher_for_endpoints

        self._owned_publisher = publisher_for_endpoints(events.endpoint, events.replay_endpoint)
        return self._owned_publisher

    def _build_parts(self, model: TargetModel, proposer: Proposer | None, clock: Clock,
                     retention_interval: int | None, tail_widening: TailWidening) -> None:
        """The cache manager, scheduler, adaptive draft length and runner for the plan, and
        the connector bound to the runner's caches."""
        config, cache = self.config, self.config.cache
        algo = get_hash_algo(cache.hash_algo)
        self.manager = KVCacheManager(
            self.layout.specs,
            self.kv_budget.num_blocks,
            self.hash_mode,
            enable_caching=cache.enable_prefix_caching,
            hit_check=hit_check_for(algo),
            event_sink=KVEventSink() if self.event_publisher is not None else None,
            retention_interval=retention_interval,
            tail_widening=tail_widening,
        )
        self.hashing = self.manager.block_hashing(algo, cache.hash_seed)
        connector = self.connector
        self.scheduler = Scheduler(
            self.manager, config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
            self.num_spec_tokens,
            SchedulerConnector(connector, self.manager, config.kv_load_failure_policy)
            if connector is not None else None,
        )
        # how many drafts each step verifies (adaptive unless config says otherwise)
        adaptive = config.speculative is None or config.speculative.adaptive
        self.spec_policy = None if proposer is None else AdaptiveSpeculation(AdaptiveSpecConfig(
            self.num_spec_tokens, adaptive=adaptive), clock)
        # CPU threads by step size (None: torch's setting for every step)
        self.step_threads = step_threads_for(
            config.threads, config.prefill_threads, single_threaded_max_rows(model)
        ) if model.device.type == "cpu" else None
        self.runner = ModelRunner(
            model, self.kv_budget.num_blocks, cache.block_size, proposer,
            RunnerConnector(connector, cache.block_size) if connector is not None else None,
            self.layout,
            spec_policy=self.spec_policy,
            step_threads=self.step_threads,
        )
        if connector is not None:
            initialize_connector(connector, self.runner.kv_cache,
                                 proposer.kv_cache if proposer is not None else None,
                                 self.hash_mode, cache.block_size, manager=self.manager,
                                 layout=self.layout,
                                 state_cache=self.runner.states.cache
                                 if self.runner.states is not None else None)

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
        if self.connector is not None:  # refused here: nothing is queued, no peer contacted
            self.connector.check_transfer_params(params.kv_transfer_params)
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
        # every KV cache group holds its own blocks of a prefill chunk (one shared pool), or
        # the full-attention group's own pool holds the context (per-group pools)
        capacity = self.kv_budget.context_tokens
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

    def transfer_abandoned(self, kv_transfer_params: Any) -> None:
        """A request with these `kv_transfer_params` was refused before `add_request`: the KV
        connector lets a peer that keeps KV for it know (never blocks)."""
        if self.connector is not None and isinstance(kv_transfer_params, dict):
            self.connector.transfer_abandoned(kv_transfer_params)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def spec_decode_stats(self) -> SpeculationReport | None:
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
        outputs = self.output_processor.process(self.core.step())
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
