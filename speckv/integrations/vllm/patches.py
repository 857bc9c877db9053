"""The patches the plugin applies to vLLM's scheduler-side code, all or none.

Owns the list of vLLM functions the plugin wraps and the check that each exists with the
parameters the wrapper expects. `resolve_targets` finds every one first; `apply` wraps them
only after all were found, so a vLLM that changed any of them is left untouched. Each wrapper
behaves exactly as the original unless its engine was switched on at start (an attribute the
patched `EngineCore.__init__` sets on that engine's scheduler, coordinator and block pool):

| wrapped                              | with lookahead hashes on                                |
|--------------------------------------|---------------------------------------------------------|
| EngineCore.__init__                  | decides (decision.py); sets disable_eagle_block_drop    |
|                                      | before the scheduler exists; installs speckv's hasher   |
| KVCacheCoordinator.cache_blocks      | caches a block only once its hash exists                |
| Scheduler._free_request              | caches what the last token completed, then frees        |
| BlockPool._build_block_stored_event  | BlockStored gets lookahead_token_ids and E(s, e + L)    |

All of it runs in the engine-core process, the scheduler side: the model runner (CPU or GPU)
is not touched.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from speckv.integrations.vllm.decision import PluginDecision, decide
from speckv.integrations.vllm.hasher import LookaheadBlockHasher

SUPPORTED_VERSIONS = ((0, 32), (0, 33))
SUPPORTED_TEXT = "0.32 and 0.33"
_FLAG = "_speckv_lookahead_tokens"  # L on an engine's scheduler, coordinator and block pool
_PATCHED = "_speckv_original"

logger = logging.getLogger("vllm.plugins.speckv")


class PatchTargetMissing(RuntimeError):
    """A function the plugin wraps is missing or has other parameters."""


def version_supported(version: str) -> bool:
    match = re.match(r"(\d+)\.(\d+)", version)
    return match is not None and (int(match[1]), int(match[2])) in SUPPORTED_VERSIONS


@dataclass(frozen=True)
class Targets:
    engine_core: type
    coordinator: type
    scheduler: type
    block_pool: type
    block_stored: type
    kv_cache_utils: Any


_EXPECTED_PARAMS = {
    ("engine_core", "__init__"): ("self", "vllm_config"),
    ("coordinator", "cache_blocks"): ("self", "request", "num_computed_tokens"),
    ("scheduler", "_free_request"): ("self", "request", "delay_free_blocks"),
    ("block_pool", "_build_block_stored_event"): (
        "self", "request", "block_hashes", "parent_block_hash", "start_token_idx",
        "end_token_idx", "block_size", "kv_cache_group_id", "extra_keys_list"),
}


def _attr(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as error:
        raise PatchTargetMissing(f"{module}.{name} ({error})") from None


def resolve_targets() -> Targets:
    """Every vLLM object the plugin touches; PatchTargetMissing names the first that is not
    as expected. Changes nothing."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    for name in ("init_none_hash", "generate_block_hash_extra_keys", "to_event_extra_keys"):
        if not callable(getattr(utils, name, None)):
            raise PatchTargetMissing(f"vllm.v1.core.kv_cache_utils.{name}")
    targets = Targets(
        engine_core=_attr("vllm.v1.engine.core", "EngineCore"),
        coordinator=_attr("vllm.v1.core.kv_cache_coordinator", "KVCacheCoordinator"),
        scheduler=_attr("vllm.v1.core.sched.scheduler", "Scheduler"),
        block_pool=_attr("vllm.v1.core.block_pool", "BlockPool"),
        block_stored=_attr("vllm.distributed.kv_events", "BlockStored"),
        kv_cache_utils=utils,
    )
    for (owner, method), expected in _EXPECTED_PARAMS.items():
        cls = getattr(targets, owner)
        function = getattr(cls, method, None)
        function = getattr(function, _PATCHED, function)
        if function is None:
            raise PatchTargetMissing(f"{cls.__name__}.{method}")
        params = tuple(inspect.signature(function).parameters)[: len(expected)]
        if params != expected:
            raise PatchTargetMissing(f"{cls.__name__}.{method}{params}, expected {expected}")
    spec_config = _attr("vllm.config.speculative", "SpeculativeConfig")
    if "disable_eagle_block_drop" not in getattr(spec_config, "__dataclass_fields__", {}):
        raise PatchTargetMissing("SpeculativeConfig.disable_eagle_block_drop")
    if not hasattr(_attr("vllm.config", "VllmConfig"), "num_prefill_lookahead_tokens"):
        raise PatchTargetMissing("VllmConfig.num_prefill_lookahead_tokens")
    return targets


def _wrap(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(cls, name)
    original = getattr(original, _PATCHED, original)  # idempotent: wrap the original once
    wrapper = make(original)
    wrapper.__name__, wrapper.__doc__ = original.__name__, original.__doc__
    setattr(wrapper, _PATCHED, original)
    setattr(cls, name, wrapper)


def engine_decision(vllm_config: Any, targets: Targets) -> PluginDecision:
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


def _switch_on(engine: Any, vllm_config: Any, decision: PluginDecision,
               targets: Targets) -> None:
    scheduler = engine.scheduler
    lookahead = decision.lookahead_tokens
    engine.request_block_hasher = LookaheadBlockHasher(
        vllm_config.cache_config.prefix_caching_hash_algo,
        targets.kv_cache_utils.NONE_HASH,
        scheduler.hash_block_size,
        lookahead,
    )
    coordinator = scheduler.kv_cache_manager.coordinator
    for owner in (scheduler, coordinator, coordinator.block_pool):
        setattr(owner, _FLAG, lookahead)
    logger.info("speckv: lookahead block hashes with L=%d replace vLLM's EAGLE block drop (%s)",
                lookahead, decision.reason)


def apply(targets: Targets) -> None:
    """Wrap every target. Call only with what `resolve_targets` returned. Mutates vLLM's
    classes (idempotent)."""
    from speckv.integrations.vllm.events import event_with_lookahead

    def engine_init(original):
        def __init__(self, vllm_config, *args, **kwargs):
            decision = engine_decision(vllm_config, targets)
            if decision.active:
                # vLLM's own switch: every drop site (hit lookup, replay boundaries, group
                # annotation) reads it; lookahead hashes make the dropped block safe to keep
                vllm_config.speculative_config.disable_eagle_block_drop = True
            original(self, vllm_config, *args, **kwargs)
            if decision.active and self.request_block_hasher is not None:
                _switch_on(self, vllm_config, decision, targets)
            elif vllm_config.speculative_config is not None:
                logger.info("speckv: plugin off for this engine: %s", decision.reason)
        return __init__

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

    def stored_event(original):
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

    _wrap(targets.engine_core, "__init__", engine_init)
    _wrap(targets.coordinator, "cache_blocks", cache_blocks)
    _wrap(targets.scheduler, "_free_request", free_request)
    _wrap(targets.block_pool, "_build_block_stored_event", stored_event)
