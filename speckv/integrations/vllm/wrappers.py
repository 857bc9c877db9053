"""The wrappers the plugin puts around vLLM's functions (patches.py applies them).

Owns what each patched function does differently on an engine the plugin switched on: the
flags `_switch_on` sets on that engine's scheduler, coordinator, block pool and manager are the
only state, so every other engine in the process runs vLLM's code unchanged. The switch is
made in `Scheduler.__init__`, not `EngineCore.__init__`: vLLM loads general plugins at the top
of `EngineCore.__init__` in its engine-core process, so that call is never a wrapped one.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

from speckv.integrations.vllm.decision import PluginDecision, decide
from speckv.integrations.vllm.events import event_with_lookahead
from speckv.integrations.vllm.hasher import LookaheadBlockHasher
from speckv.integrations.vllm.reuse import divergent_source, record_cached_blocks

_FLAG = "_speckv_lookahead_tokens"  # L on an engine's scheduler, coordinator and block pool
_REUSE = "_speckv_reuse"  # (block size, L, NONE_HASH) on the manager and pool that reuse blocks

logger = logging.getLogger("vllm.plugins.speckv")


def engine_decision(vllm_config: Any, targets: Any) -> PluginDecision:
    spec = vllm_config.speculative_config
    scheduler_cls = vllm_config.scheduler_config.get_scheduler_cls()
    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, targets.scheduler)):
        return PluginDecision(0, f"scheduler class {scheduler_cls!r} is not vLLM's Scheduler")
    return decide(
        method=None if spec is None else spec.method,
        num_prefill_lookahead=vllm_config.num_prefill_lookahead_tokens,
        enable_prefix_caching=bool(vllm_config.cache_config.enable_prefix_caching),
        has_kv_connector=vllm_config.kv_transfer_config is not None,
    )


# what the Scheduler wrapper leaves for the hasher factory EngineCore.__init__ calls next
_pending_hasher: dict[str, Any] = {}


def _inside_engine_core_init(targets: Any) -> bool:
    """Whether the caller chain has vLLM's EngineCore.__init__, which builds the request
    hasher right after the scheduler: a scheduler built anywhere else (vLLM's own tests) gets
    no lookahead hashes, so it must keep vLLM's drop too."""
    code = getattr(targets.engine_core.__init__, "__code__", None)
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _switch_on(scheduler: Any, vllm_config: Any, decision: PluginDecision,
               targets: Any) -> None:
    lookahead = decision.lookahead_tokens
    manager = scheduler.kv_cache_manager
    coordinator = manager.coordinator
    for owner in (scheduler, coordinator, coordinator.block_pool):
        setattr(owner, _FLAG, lookahead)
    groups = coordinator.single_type_managers
    reuse = (len(groups) == 1 and type(groups[0]) is targets.full_attention_manager
             and groups[0].block_size == scheduler.hash_block_size
             and lookahead < groups[0].block_size)
    if reuse:
        setting = (groups[0].block_size, lookahead, targets.kv_cache_utils)
        setattr(manager, _REUSE, setting)
        setattr(coordinator.block_pool, _REUSE, setting)
    _pending_hasher.update(algo=vllm_config.cache_config.prefix_caching_hash_algo,
                           lookahead=lookahead)
    logger.info("speckv: lookahead block hashes with L=%d replace vLLM's EAGLE block drop (%s); "
                "block reuse at divergence points %s", lookahead, decision.reason,
                "on" if reuse else "off (needs one full-attention group)")


def scheduler_init(targets: Any) -> Callable[[Callable], Callable]:
    def make(original):
        def __init__(self, vllm_config, kv_cache_config, *args, **kwargs):
            _pending_hasher.clear()
            decision = engine_decision(vllm_config, targets)
            if decision.active and not _inside_engine_core_init(targets):
                decision = PluginDecision(0, "the scheduler is not built by vLLM's EngineCore")
            if decision.active:
                # vLLM's own switch (hit lookup, replay boundaries); the groups were annotated
                # for the drop before the scheduler exists: lookahead hashes make it needless
                vllm_config.speculative_config.disable_eagle_block_drop = True
                for group in kv_cache_config.kv_cache_groups:
                    group.is_eagle_group = False
            original(self, vllm_config, kv_cache_config, *args, **kwargs)
            if decision.active:
                _switch_on(self, vllm_config, decision, targets)
            elif vllm_config.speculative_config is not None:
                logger.info("speckv: plugin off for this engine: %s", decision.reason)
        return __init__
    return make


def block_hasher_factory(targets: Any, original: Callable) -> Callable:
    """vLLM's `get_request_block_hasher` as EngineCore.__init__ calls it: speckv's lookahead
    hasher right after a scheduler the plugin switched on, vLLM's own otherwise."""
    def get_request_block_hasher(hash_block_size, caching_hash_fn, *args, **kwargs):
        pending = dict(_pending_hasher)
        _pending_hasher.clear()
        if not pending:
            return original(hash_block_size, caching_hash_fn, *args, **kwargs)
        return LookaheadBlockHasher(pending["algo"], targets.kv_cache_utils.NONE_HASH,
                                    hash_block_size, pending["lookahead"])
    return get_request_block_hasher


def stored_event(targets: Any) -> Callable[[Callable], Callable]:
    def make(original):
        def wrapper(self, request, block_hashes, parent_block_hash, start_token_idx,
                    end_token_idx, block_size, *args, **kwargs):
            event = original(self, request, block_hashes, parent_block_hash, start_token_idx,
                             end_token_idx, block_size, *args, **kwargs)
            lookahead = getattr(self, _FLAG, 0)
            if not lookahead:
                return event
            return event_with_lookahead(event, request, start_token_idx, end_token_idx,
                                        block_size, lookahead, targets)
        return wrapper
    return make


def cache_blocks(original):
    def wrapper(self, request, num_computed_tokens, *args, **kwargs):
        if getattr(self, _FLAG, 0):
            # a block's hash exists once its L successors are real tokens
            hashed = len(request.block_hashes) * self.block_pool.hash_block_size
            num_computed_tokens = min(num_computed_tokens, hashed)
        return original(self, request, num_computed_tokens, *args, **kwargs)
    return wrapper


def free_request(original):
    def wrapper(self, request, *args, **kwargs):
        if getattr(self, _FLAG, 0) and request.num_computed_tokens > 0:
            # the last sampled token completed the lookahead of the block before it
            self.kv_cache_manager.cache_blocks(
                request, min(request.num_computed_tokens, request.num_tokens))
        return original(self, request, *args, **kwargs)
    return wrapper


def computed_blocks(original):
    def wrapper(self, request, *args, **kwargs):
        result = original(self, request, *args, **kwargs)
        setting = getattr(self, _REUSE, None)
        if setting is None or not self.prefix_cache_lookup_enabled(request):
            return result
        blocks, hit_length, *rest = result
        block_size, lookahead, none_hash = setting
        source = divergent_source(self.block_pool, request, hit_length, block_size,
                                  lookahead, none_hash)
        if source is None:
            return result
        extended = self.create_kv_cache_blocks((list(blocks.blocks[0]) + [source],))
        return (extended, hit_length + block_size - lookahead, *rest)
    return wrapper


def cache_full(original):
    def wrapper(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, *args, **kwargs):
        original(self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                 kv_cache_group_id, *args, **kwargs)
        setting = getattr(self, _REUSE, None)
        if setting is not None and kv_cache_group_id == 0:
            record_cached_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                                 block_size, setting[2])
    return wrapper
