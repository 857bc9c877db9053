"""The patches the plugin applies to vLLM's scheduler-side code, all or none.

Owns the list of vLLM functions the plugin wraps and the check that each exists with the
parameters the wrapper expects. `resolve_targets` finds every one first; `apply` wraps them
only after all were found, so a vLLM that changed any of them is left untouched. Each wrapper
behaves exactly as the original unless its engine was switched on at start (an attribute the
patched `Scheduler.__init__` sets on that engine's objects; the wrappers are wrappers.py):

| wrapped                              | with lookahead hashes on                                |
|--------------------------------------|---------------------------------------------------------|
| Scheduler.__init__                   | decides (decision.py); sets disable_eagle_block_drop    |
|                                      | before its KV cache manager exists                      |
| core.get_request_block_hasher        | speckv's lookahead hasher for that engine's requests    |
| KVCacheCoordinator.cache_blocks      | caches a block only once its hash exists                |
| Scheduler._free_request              | caches what the last token completed, then frees        |
| BlockPool._build_block_stored_event  | BlockStored gets lookahead_token_ids and E(s, e + L)    |
| KVCacheManager.get_computed_blocks   | reuses a block cached under another successor (reuse.py)|
| BlockPool.cache_full_blocks          | indexes what it cached for that reuse                   |

All of it runs in the engine-core process, the scheduler side: the model runner (CPU or GPU)
is not touched.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

SUPPORTED_VERSIONS = ((0, 32), (0, 33))
SUPPORTED_TEXT = "0.32 and 0.33"
_PATCHED = "_speckv_original"


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
    kv_cache_manager: type
    single_type_manager: type
    full_attention_manager: type
    kv_cache_utils: Any


_EXPECTED_PARAMS = {
    ("engine_core", "__init__"): ("self", "vllm_config"),
    ("scheduler", "__init__"): ("self", "vllm_config", "kv_cache_config"),
    ("coordinator", "cache_blocks"): ("self", "request", "num_computed_tokens"),
    ("scheduler", "_free_request"): ("self", "request", "delay_free_blocks"),
    ("block_pool", "_build_block_stored_event"): (
        "self", "request", "block_hashes", "parent_block_hash", "start_token_idx",
        "end_token_idx", "block_size", "kv_cache_group_id", "extra_keys_list"),
    ("kv_cache_manager", "get_computed_blocks"): ("self", "request"),
    ("block_pool", "cache_full_blocks"): (
        "self", "request", "blocks", "num_cached_blocks", "num_full_blocks", "block_size",
        "kv_cache_group_id"),
}


def native_lookahead_hashes() -> str | None:
    """What makes this vLLM hash with lookahead tokens on its own (vLLM 0.33:
    `VllmConfig.num_hash_lookahead_tokens`, the same key layout as speckv's), or None."""
    config = _attr("vllm.config", "VllmConfig")
    if hasattr(config, "num_hash_lookahead_tokens"):
        return "VllmConfig.num_hash_lookahead_tokens"
    return None


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
        kv_cache_manager=_attr("vllm.v1.core.kv_cache_manager", "KVCacheManager"),
        single_type_manager=_attr("vllm.v1.core.single_type_kv_cache_manager",
                                  "SingleTypeKVCacheManager"),
        full_attention_manager=_attr("vllm.v1.core.single_type_kv_cache_manager",
                                     "FullAttentionManager"),
        kv_cache_utils=utils,
    )
    # the copy-on-write path a hit ending inside a block takes (reuse.py relies on it)
    for name in ("_has_partial_local_hit", "_apply_cow", "take_pending_cow_copies"):
        if not hasattr(targets.single_type_manager, name):
            raise PatchTargetMissing(f"SingleTypeKVCacheManager.{name}")
    # what the wrappers call
    for name in ("cache_blocks", "prefix_cache_lookup_enabled", "create_kv_cache_blocks"):
        if not hasattr(targets.kv_cache_manager, name):
            raise PatchTargetMissing(f"KVCacheManager.{name}")
    for (owner, method), expected in _EXPECTED_PARAMS.items():
        cls = getattr(targets, owner)
        function = getattr(cls, method, None)
        function = getattr(function, _PATCHED, function)
        if function is None:
            raise PatchTargetMissing(f"{cls.__name__}.{method}")
        params = tuple(inspect.signature(function).parameters)[: len(expected)]
        if params != expected:
            raise PatchTargetMissing(f"{cls.__name__}.{method}{params}, expected {expected}")
    hasher = getattr(importlib.import_module("vllm.v1.engine.core"), "get_request_block_hasher",
                     None)
    hasher = getattr(hasher, _PATCHED, hasher)
    if hasher is None or tuple(inspect.signature(hasher).parameters)[:2] != (
            "hash_block_size", "caching_hash_fn"):
        raise PatchTargetMissing("vllm.v1.engine.core.get_request_block_hasher")
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


def apply(targets: Targets) -> None:
    """Wrap every target. Call only with what `resolve_targets` returned. Mutates vLLM's
    classes (idempotent)."""
    from speckv.integrations.vllm import wrappers

    core = importlib.import_module("vllm.v1.engine.core")
    original = getattr(core.get_request_block_hasher, _PATCHED, core.get_request_block_hasher)
    factory = wrappers.block_hasher_factory(targets, original)
    setattr(factory, _PATCHED, original)
    core.get_request_block_hasher = factory
    _wrap(targets.scheduler, "__init__", wrappers.scheduler_init(targets))
    _wrap(targets.kv_cache_manager, "get_computed_blocks", wrappers.computed_blocks)
    _wrap(targets.block_pool, "cache_full_blocks", wrappers.cache_full)
    _wrap(targets.coordinator, "cache_blocks", wrappers.cache_blocks)
    _wrap(targets.scheduler, "_free_request", wrappers.free_request)
    _wrap(targets.block_pool, "_build_block_stored_event", wrappers.stored_event(targets))
