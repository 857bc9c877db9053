"""Which vLLM engines get lookahead block hashes, decided by speckv's drafter policy table.

Owns the mapping from a vLLM engine configuration (speculative method, prefix caching, KV
connector) to one `PluginDecision`. Pure apart from reading the plugin's switch from the
environment; imports no vLLM module, so it is tested without vLLM.

| vLLM `speculative_config.method`   | speckv drafter     | plugin                                |
|------------------------------------|--------------------|---------------------------------------|
| eagle, eagle3                      | eagle, eagle3      | L = 1                                 |
| mtp (k chained modules)            | mtp, k modules     | L = k (vLLM's num_prefill_lookahead)  |
| dflash, dspark, ngram, draft_model | L = 0 in the table | off: vLLM's own behaviour stays       |

With a KV connector the legacy hashes and vLLM's drop stay (its tiers key blocks by legacy
hashes), as `resolve_hash_mode` decides for speckv's own engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from speckv.cache.drafter_policy import DRAFTER_LOOKAHEAD, drafter_policy, resolve_hash_mode

# The plugin's own off switch (besides vLLM's VLLM_PLUGINS list, which it honours too).
SWITCH_ENV = "SPECKV_VLLM_PLUGIN"
_OFF_VALUES = frozenset({"0", "off", "false", "no"})


@dataclass(frozen=True)
class PluginDecision:
    lookahead_tokens: int  # L: successor tokens hashed into each block (0: the plugin is off)
    reason: str  # in an operator's words, logged at engine start

    @property
    def active(self) -> bool:
        return self.lookahead_tokens > 0


def switched_off() -> bool:
    """Whether `SPECKV_VLLM_PLUGIN` turns the plugin off (0, off, false, no)."""
    return os.environ.get(SWITCH_ENV, "").strip().lower() in _OFF_VALUES


def decide(method: str | None, num_prefill_lookahead: int, enable_prefix_caching: bool,
           has_kv_connector: bool) -> PluginDecision:
    """The plugin's decision for one engine. `num_prefill_lookahead` is vLLM's own count of
    tokens after a position that its drafter reads (1 for EAGLE, k for k-module MTP)."""
    if switched_off():
        return PluginDecision(0, f"{SWITCH_ENV} turns the speckv plugin off")
    if method is None:
        return PluginDecision(0, "no speculative decoding: vLLM's hashes need no lookahead")
    if method not in DRAFTER_LOOKAHEAD:
        return PluginDecision(0, f"speculative method {method!r} is not in speckv's drafter "
                                 "table: vLLM's own behaviour stays")
    modules = max(1, num_prefill_lookahead) if method == "mtp" else 1
    mode = resolve_hash_mode(
        drafter_policy(method, modules),
        enable_prefix_caching=enable_prefix_caching,
        connector_blocker="a KV connector is configured" if has_kv_connector else None,
        reuse_divergent_blocks=False,
    )
    if not mode.lookahead_tokens:
        return PluginDecision(0, f"{mode.reason}: vLLM's own behaviour stays")
    return PluginDecision(mode.lookahead_tokens, mode.reason)
