"""The engines behind a router: their contracts, health, load, KV events and the index.

Owns one `EngineLink` per engine (its contract, health, the load it last reported, requests in
flight through this router, its index generation) and the `Fleet` that holds them with the
`RouterIndex`. One lock serialises the index: the subscriber threads apply events under it,
the HTTP side plans a request under it. Each engine's events are read by its own thread
(`EventSubscriber`, msgspec only, gaps filled from the replay socket); when the engine's
epoch changes (a restart: its sequence numbers start again at 0) or it comes back after its
entries expired, its entries are dropped and its thread subscribes again from seq 0, so the
replay buffer fills the index. A batch read under an older generation is dropped.

Health is polled (`poll_engine`): `/health`, `/kv_cache_contract` and `/metrics`
(running / waiting requests and KV usage). An engine that fails leaves rotation at once; one
silent for `stale_after_s` has its entries expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.cache.group_rules import GroupRule
from speckv.events.schema import KVEventBatch, low64
from speckv.events.subscriber import EventSubscriber, SubscriberConfig, SubscriberStats
from speckv.hashing.extra_keys import NO_HASH_INPUTS
from speckv.router.contract import ContractError, EngineContract, HitRule, parse_contract
from speckv.router.index import EngineState, RouterIndex
from speckv.router.policy import EngineView
from speckv.router.pool_mirror import PoolMirror
from speckv.router.tokenizer import TokenizerCache
from speckv.router.vllm_engine import VLLMFlags, hybrid_rule, learn_groups, pool_shape

logger = logging.getLogger("speckv.router")
SUBSCRIBER_COUNTERS = ("received_batches", "replayed_batches", "replay_requests",
                       "lost_batches", "malformed_messages", "duplicate_batches", "seq_gaps")


@dataclass(frozen=True)
class EngineSpec:
    name: str
    url: str  # http://host:port
    api_key: str | None = None  # sent on as Authorization: Bearer
    vllm: VLLMFlags | None = None  # a vLLM engine, as the --vllm-* flags naming it describe it
    # what the --vllm-* flags without a name say, for an engine found to be vLLM's
    vllm_default: VLLMFlags | None = None


@dataclass
class EngineLink:
    spec: EngineSpec
    # None: the engine did not answer at the router's start; its first passing health poll
    # reads the contract and adds it
    contract: EngineContract | None
    healthy: bool = True
    refused: str | None = None  # a later contract the router cannot reproduce
    # what its KV events showed the router cannot predict (a vLLM group of an unknown kind,
    # a hybrid one under the EAGLE drop), until the engine restarts
    events_refused: str | None = None
    # a vLLM engine's KV cache groups as its events showed them, and the hybrid hit rule
    # over them (None: one full-attention group, the contract's rule)
    vllm_groups: dict[int, GroupRule] = field(default_factory=dict)
    vllm_rule: HitRule | None = None
    # a vLLM engine's block pool as the router models it (one full-attention group with
    # prefix caching): its predicted hits see the evictions its events have not shown yet
    pool: PoolMirror | None = None
    unhealthy_since: float | None = None
    expired: bool = False  # entries dropped after stale_after_s without health
    generation: int = 0  # bumped to make the subscriber thread start over
    epochs_seen: int = 1
    index_resets: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    inflight: int = 0  # requests through this router not yet answered
    external_load: int = 0  # running + waiting at the last poll that were not the router's
    events_applied: int = 0
    apply_errors: int = 0
    subscriber: EventSubscriber | None = None
    closed_stats: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(SUBSCRIBER_COUNTERS, 0))

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def vllm_flags(self) -> VLLMFlags:
        return self.spec.vllm or self.spec.vllm_default or VLLMFlags()

    @property
    def in_rotation(self) -> bool:
        return (self.healthy and self.refused is None and self.events_refused is None
                and self.contract is not None)

    @property
    def load_requests(self) -> int:
        """Running + waiting: the router's own in flight now, plus the others the engine
        reported at the last poll (a poll lags; the router's count does not)."""
        return self.inflight + self.external_load

    def subscriber_stats(self) -> dict[str, int]:
        live: SubscriberStats | None = self.subscriber.stats if self.subscriber else None
        return {name: self.closed_stats[name] + (getattr(live, name) if live else 0)
                for name in SUBSCRIBER_COUNTERS}

    def headers(self) -> dict[str, str]:
        key = self.spec.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass(frozen=True)
class EnginePlan:
    """One engine's side of a request: its token ids' blocks and the hits predicted."""

    hashes: list[bytes]
    published_cached_tokens: int  # from blocks the engine has published as stored
    # the published blocks and the pending ones (routed there, events not yet in): what the
    # policy scores and the metrics check against the engine's report
    predicted_cached_tokens: int
    num_prompt_tokens: int
    # the prompt, kept where the engine reuses divergent blocks: routing it enters its
    # blocks' contents into the pending divergent-block index
    token_ids: Sequence[int] | None = None
    # the key of the block cached under another successor that the predicted hit copies
    # (a pool mirror touches it)
    divergent_source: int | None = None


@dataclass(frozen=True)
class FleetConfig:
    stale_after_s: float = 10.0  # unhealthy this long: the engine's entries expire
    # routed blocks count as held while their request is in flight and this long after
    pending_ttl_s: float = 1.0
    poll_timeout_s: float = 0.05  # subscriber poll
    replay_timeout_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.stale_after_s > 0:
            raise ValueError(f"--stale-after must be > 0, got {self.stale_after_s}")
        if not self.pending_ttl_s >= 0:
            raise ValueError(f"--pending-ttl must be >= 0, got {self.pending_ttl_s}")
        if not (self.poll_timeout_s > 0 and self.replay_timeout_s > 0):
            raise ValueError("FleetConfig poll and replay timeouts must be > 0")


def _pool_mirror(link: EngineLink) -> PoolMirror | None:
    shape = pool_shape(link.contract, link.vllm_flags) if link.contract is not None else None
    return PoolMirror(shape) if shape is not None else None  # None: not a vLLM engine


class Fleet:
    def __init__(self, links: Sequence[EngineLink], tokenizers: TokenizerCache,
                 config: FleetConfig | None = None) -> None:
        if not links:
            raise ValueError("the router needs at least one --engine")
        self.links: dict[str, EngineLink] = {link.name: link for link in links}
        self.config = config or FleetConfig()
        self.tokenizers = tokenizers
        self.index = RouterIndex({link.name: link.contract.hashing for link in links
                                  if link.contract is not None})
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # the model every engine serves: the first contract's (None while no engine answered)
        self.served_model_name: str | None = None
        for link in links:
            if link.contract is None:
                link.healthy = False  # out of rotation until its health passes
                link.epochs_seen = 0
                continue
            self._check_model(link, link.contract)
            tokenizers.get(link.name, link.contract.model, link.contract.tokenizer)
            link.pool = _pool_mirror(link)

    def _check_model(self, link: EngineLink, contract: EngineContract) -> None:
        """One router, one served model name: the first contract read sets it."""
        if self.served_model_name is None:
            self.served_model_name = contract.served_model_name
        elif contract.served_model_name != self.served_model_name:
            raise ContractError(
                link.name, "served_model_name",
                f"{contract.served_model_name!r}, but the router serves "
                f"{self.served_model_name!r}: one router, one model name")

    def first_contract(self) -> EngineContract | None:
        """The contract of the first engine that has answered (the model the router names)."""
        return next((link.contract for link in self.links.values()
                     if link.contract is not None), None)

    # ---- threads -----------------------------------------------------------------------------
    def start(self) -> None:
        for link in self.links.values():
            thread = threading.Thread(target=self._consume, args=(link,), daemon=True,
                                      name=f"router-events-{link.name}")
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 3.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout_s)

    def _consume(self, link: EngineLink) -> None:
        while not self._stop.is_set():
            with self.lock:
                generation = link.generation
                contract = link.contract
            if contract is None:  # not reached yet: its first passing poll adds it
                self._stop.wait(self.config.poll_timeout_s)
                continue
            subscriber = EventSubscriber(SubscriberConfig(
                endpoint=contract.events_endpoint, replay_endpoint=contract.replay_endpoint,
                start_seq=0, replay_timeout_s=self.config.replay_timeout_s))
            link.subscriber = subscriber
            try:
                while not self._stop.is_set() and link.generation == generation:
                    for seq, batch in subscriber.poll(self.config.poll_timeout_s):
                        self.apply(link, generation, seq, batch)
            finally:
                for name in SUBSCRIBER_COUNTERS:
                    link.closed_stats[name] += getattr(subscriber.stats, name)
                link.subscriber = None
                subscriber.close()

    def apply(self, link: EngineLink, generation: int, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            if link.generation != generation:
                return  # read before the engine's entries were dropped
            if link.contract is not None and link.contract.vllm:
                self._learn_groups(link, batch)
            try:
                self.index.apply_batch(link.name, batch, seq)
                if link.pool is not None:
                    link.pool.apply_batch(batch)
                link.events_applied += len(batch.events)
            except Exception:  # a malformed event is counted; the router keeps routing
                link.apply_errors += 1
                logger.exception("engine %s: could not apply a KV event batch", link.name)

    def _learn_groups(self, link: EngineLink, batch: KVEventBatch) -> None:
        """A vLLM engine's groups as its events name them, and its hit rule over them; out of
        rotation for a group the router cannot predict (lock held)."""
        contract = link.contract
        assert contract is not None
        try:
            if learn_groups(link.name, batch, link.vllm_groups, contract.hashing.block_size):
                link.vllm_rule = hybrid_rule(contract, link.vllm_groups, link.vllm_flags)
                if link.vllm_rule is not None:
                    link.pool = None  # the mirror models one group's pool
                    logger.warning("engine %s: its events show KV cache groups %s (hits "
                                   "aligned to %d tokens)", link.name,
                                   ", ".join(f"{g.group_idx}: {g.kind} of {g.block_size}"
                                             for g in link.vllm_rule.groups),
                                   link.vllm_rule.alignment_tokens)
        except ContractError as error:
            if link.events_refused is None:
                logger.error("engine %s out of rotation: %s", link.name, error)
            link.events_refused = str(error)

    # ---- health ------------------------------------------------------------------------------
    def mark_unhealthy(self, link: EngineLink, why: str) -> None:
        with self.lock:
            if link.healthy:
                logger.warning("engine %s leaves rotation: %s", link.name, why)
            link.healthy = False
            if link.unhealthy_since is None:
                link.unhealthy_since = time.monotonic()

    def expire_stale(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self.lock:
            for link in self.links.values():
                if (not link.healthy and not link.expired and link.contract is not None
                        and link.unhealthy_since is not None
                        and now - link.unhealthy_since >= self.config.stale_after_s):
                    logger.warning("engine %s silent for %.0f s: its index entries expire",
                                   link.name, now - link.unhealthy_since)
                    self._reset(link)
                    link.expired = True

    def _reset(self, link: EngineLink, contract: EngineContract | None = None) -> None:
        """Drop the engine's entries and make its thread subscribe again (lock held)."""
        if contract is not None:
            link.contract = contract
            link.events_refused = None  # a new epoch: its events are judged again
        self.index.reset_engine(link.name, link.contract.hashing)
        link.vllm_groups = {}
        link.vllm_rule = None
        link.pool = _pool_mirror(link)
        link.index_resets += 1
        link.generation += 1

    def refuse(self, link: EngineLink, error: Exception) -> None:
        """Out of rotation: the engine answers with a contract the router cannot use."""
        with self.lock:
            if link.refused != str(error):
                logger.error("engine %s out of rotation: %s", link.name, error)
            link.refused = str(error)

    def engine_healthy(self, link: EngineLink, contract_body: Any,
                       load: Mapping[str, float]) -> None:
        """A successful poll: the contract as served now (its JSON, or an `EngineContract`
        built from a vLLM engine's /metrics) and the load from /metrics."""
        try:
            contract = contract_body if isinstance(contract_body, EngineContract) \
                else parse_contract(link.name, link.spec.url, contract_body)
            if link.contract is None \
                    or contract.reproduction_key != link.contract.reproduction_key:
                self.tokenizers.get(link.name, contract.model, contract.tokenizer)
                with self.lock:
                    self._check_model(link, contract)
        except ValueError as error:
            self.refuse(link, error)
            return
        with self.lock:
            link.refused = None
            if link.contract is None:
                logger.warning("engine %s answers: added (%s block hashes, blocks of %d)",
                               link.name, contract.hash_mode_label,
                               contract.hashing.block_size)
                link.epochs_seen = 1
                self._reset(link, contract)
            elif contract.epoch != link.contract.epoch:
                logger.warning("engine %s restarted (epoch %s -> %s): dropping its index "
                               "entries, replaying its events", link.name,
                               link.contract.epoch[:8], contract.epoch[:8])
                link.epochs_seen += 1
                self._reset(link, contract)
                link.expired = False
            elif link.expired:
                self._reset(link, contract)
                link.expired = False
            if not link.healthy:
                logger.warning("engine %s back in rotation", link.name)
            link.healthy = True
            link.unhealthy_since = None
            link.running = int(load.get("running", 0))
            link.waiting = int(load.get("waiting", 0))
            link.external_load = max(0, link.running + link.waiting - link.inflight)
            link.kv_usage = float(load.get("kv_usage", 0.0))

    def cleared(self, link: EngineLink) -> None:
        """The engine's prefix cache was reset: forget its blocks (as AllBlocksCleared)."""
        with self.lock:
            if link.name in self.index.state:
                self.index.clear_engine(link.name)
            if link.pool is not None:
                link.pool.clear(event_to_come=True)

    # ---- requests ----------------------------------------------------------------------------
    def plan(self, token_ids: Sequence[int], engines: Sequence[str]
             ) -> dict[str, EnginePlan]:
        """Each engine's hashes of the prompt and the hits it will serve. Under the lock."""
        now = time.monotonic()
        plans: dict[str, EnginePlan] = {}
        by_config: dict[Any, list[bytes]] = {}
        num_tokens = len(token_ids)
        with self.lock:
            for name in engines:
                link = self.links[name]
                hashing = link.contract.hashing
                rule = link.vllm_rule or link.contract.hit_rule
                if rule.is_hybrid:
                    plans[name] = self._hybrid_plan(name, rule, token_ids, by_config, now)
                    continue
                key = (hashing.algo, hashing.seed, hashing.block_size, hashing.lookahead_tokens)
                hashes = by_config.get(key)
                if hashes is None:
                    hashes = by_config[key] = self.index.prompt_hashes(name, token_ids,
                                                                       NO_HASH_INPUTS)
                confirmed = rule.cached_tokens(self.index.matched_blocks(name, hashes),
                                               num_tokens)
                if link.pool is not None:  # the engine's own pool rules, evictions included
                    matched = link.pool.matched_blocks(
                        [low64(h) for h in hashes],
                        lambda key, blocks=self.index.state[name].blocks,
                        group=hashing.route_group: (group, key) in blocks)
                else:
                    matched = self.index.matched_blocks(name, hashes, pending_at_s=now)
                with_pending = rule.cached_tokens(matched, num_tokens)
                routed_tokens = source = None
                if rule.reuses_divergent_blocks:
                    confirmed = self._with_reuse(name, rule, hashes, token_ids, confirmed)[0]
                    with_pending, source = self._with_reuse(
                        name, rule, hashes, token_ids, with_pending, now,
                        link.pool.holds if link.pool is not None else None)
                    routed_tokens = token_ids
                plans[name] = EnginePlan(hashes, confirmed, with_pending, num_tokens,
                                         routed_tokens, source)
        return plans

    def _hybrid_plan(self, name: str, rule: Any, token_ids: Sequence[int],
                     by_config: dict[Any, list[bytes]], now: float) -> EnginePlan:
        """A hybrid engine's plan: the prompt's chain per lookahead value its groups hash
        with, and the hit every group serves (`HitRule.hybrid_cached_tokens`)."""
        hashing = self.links[name].contract.hashing
        chains: dict[int, list[bytes]] = {}
        for lookahead in rule.lookahead_values:
            key = (hashing.algo, hashing.seed, hashing.block_size, lookahead)
            chain = by_config.get(key)
            if chain is None:
                chain = by_config[key] = self.index.prompt_hashes(
                    name, token_ids, NO_HASH_INPUTS, lookahead_tokens=lookahead)
            chains[lookahead] = chain
        hashes = [h for lookahead in rule.lookahead_values for h in chains[lookahead]]

        def holds(group: int, block_hash: bytes) -> bool:
            return self.index.holds(name, group, block_hash)

        def holds_or_pending(group: int, block_hash: bytes) -> bool:
            return self.index.holds(name, group, block_hash, pending_at_s=now)

        num_tokens = len(token_ids)
        return EnginePlan(hashes, rule.hybrid_cached_tokens(chains, holds, num_tokens),
                          rule.hybrid_cached_tokens(chains, holds_or_pending, num_tokens),
                          num_tokens)

    def _with_reuse(self, name: str, rule: Any, hashes: Sequence[bytes],
                    token_ids: Sequence[int], hit: int, pending_at_s: float | None = None,
                    holds: Callable[[int], bool] | None = None) -> tuple[int, int | None]:
        """The hit plus the U - L reused tokens of a divergent block, where the engine holds
        one right after it (and it ends by N - 1), as the engine's cache manager counts it,
        and that block's key; with `pending_at_s`, blocks routed there and still pending
        count too; with `holds`, what a pool mirror holds."""
        unit = rule.block_size
        if hit + unit > len(token_ids) - 1:
            return hit, None
        source = self.index.divergent_block(name, hashes, token_ids, hit // unit,
                                            pending_at_s, holds)
        if source is not None:
            return hit + unit - rule.lookahead_tokens, source
        return hit, None

    def views(self, plans: Mapping[str, EnginePlan], exclude: set[str]) -> list[EngineView]:
        with self.lock:
            return [EngineView(name, plans[name].predicted_cached_tokens, link.load_requests,
                               link.kv_usage)
                    for name, link in self.links.items()
                    if link.in_rotation and name not in exclude and name in plans]

    def routed(self, name: str, plan: EnginePlan) -> None:
        """A request goes to `name`: its blocks are pending there (scheduled in its pool
        mirror); one more in flight."""
        with self.lock:
            link = self.links[name]
            link.inflight += 1
            self.index.add_pending(name, plan.hashes, token_ids=plan.token_ids)
            if link.pool is not None:
                link.pool.schedule(id(plan), [low64(h) for h in plan.hashes],
                                   plan.num_prompt_tokens, plan.predicted_cached_tokens,
                                   plan.divergent_source)

    def finished(self, name: str, plan: EnginePlan, num_output_tokens: int | None) -> None:
        """The request routed to `name` is answered after `num_output_tokens` (None: it
        failed before the engine may have scheduled it): its blocks stay pending for
        `pending_ttl_s` more, for their events to arrive; its pool mirror frees them."""
        with self.lock:
            link = self.links[name]
            link.inflight -= 1
            self.index.release_pending(name, plan.hashes,
                                       time.monotonic() + self.config.pending_ttl_s)
            if link.pool is not None:
                group = link.contract.hashing.route_group
                blocks = self.index.state[name].blocks
                link.pool.finish(id(plan), num_output_tokens,
                                 confirmed=lambda key: (group, key) in blocks)

    def state(self) -> dict[str, Any]:
        """Per engine: rotation, contract summary, load, index and event counters (JSON)."""
        with self.lock:
            index = self.index.stats()
            return {name: {
                "url": link.spec.url, "healthy": link.healthy,
                "refused": link.refused or link.events_refused,
                "expired": link.expired, "reached": link.contract is not None,
                "epoch": link.contract.epoch if link.contract else None,
                "epochs_seen": link.epochs_seen, "index_resets": link.index_resets,
                "hash_mode": link.contract.hash_mode_label if link.contract else None,
                "divergent_block_reuse": bool(
                    link.contract and link.contract.hit_rule.reuses_divergent_blocks),
                "block_size": link.contract.hashing.block_size if link.contract else None,
                # a hybrid vLLM engine's groups as its events named them
                "kv_groups": [{"group_idx": g.group_idx, "kind": g.kind,
                               "block_size": g.block_size, "sliding_window": g.sliding_window}
                              for g in link.vllm_rule.groups] if link.vllm_rule else None,
                # a vLLM engine's pool as the router models it
                "pool_mirror": {"free_blocks": link.pool.num_free_blocks,
                                "corrections": link.pool.corrections} if link.pool else None,
                "running": link.running, "waiting": link.waiting, "kv_usage": link.kv_usage,
                "inflight": link.inflight, "events_applied": link.events_applied,
                "apply_errors": link.apply_errors, "generation": link.generation,
                "index": index.get(name, EngineState().counters()),
                "subscriber": link.subscriber_stats(),
            } for name, link in self.links.items()}
