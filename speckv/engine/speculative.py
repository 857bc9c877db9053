"""The engine's speculative-decoding setup: which proposer runs, from the config.

Owns turning `EngineConfig.speculative` (its method, + a drafter loaded from its `model`)
into a `Proposer`: a drafter model's own (any `Drafter`, `speckv.speculation.methods`), or a
model-free method's from the registry `METHODS`. The proposer carries its drafter's policy
(`speckv.cache.drafter_policy`), which then decides lookahead hashes versus the legacy drop.
Which drafter a speculative model names is `speckv.drafters.resolve`. Also the engine's hash
mode from its drafter's policy and its KV connector.
"""

from __future__ import annotations

import time
from typing import Any

from speckv.cache.drafter_policy import DrafterPolicy, resolve_hash_mode
from speckv.cache.hash_mode import HashMode
from speckv.connectors.capability import lookahead_blocker
from speckv.drafters.resolve import load_drafter_model
from speckv.engine.config import EngineConfig
from speckv.models.base import TargetModel
from speckv.speculation.adaptive import Clock
from speckv.speculation.methods import METHODS, Drafter
from speckv.speculation.proposer import Proposer

__all__ = ["Drafter", "load_configured_drafter", "load_drafter_model", "make_proposer",
           "resolve_connector_hash_mode", "speculative_args"]


def speculative_args(drafter: Drafter | None, num_spec_tokens: int) -> dict[str, Any]:
    """The `EngineArgs` speculative fields for running `drafter` (None: no speculation)."""
    if drafter is None:
        return {"speculative_method": None, "num_spec_tokens": 0}
    # the Gemma 4 assistant's policy is gemma4_mtp; users ask for it as "mtp"
    return {"speculative_method": drafter.speculative_method, "num_spec_tokens": num_spec_tokens}


def make_proposer(config: EngineConfig, drafter: Drafter | None, num_blocks: int,
                  clock: Clock = time.perf_counter) -> Proposer | None:
    """The proposer for the config (None: no speculation), timing itself with `clock`."""
    spec = config.speculative
    method = spec.method if spec is not None else None
    if drafter is not None:
        if method != drafter.speculative_method:
            raise ValueError(
                f"the drafter is {drafter.policy.name} (an {drafter.speculative_method.upper()} "
                f"drafter) but speculative_method is {method!r}; "
                f"set speculative_method={drafter.speculative_method!r} (and num_spec_tokens)"
            )
        assert spec is not None
        return drafter.make_proposer(spec.num_speculative_tokens, num_blocks,
                                     config.cache.block_size, clock)
    if spec is None:
        return None
    registered = METHODS[spec.method]
    if registered.make_proposer is None:
        raise ValueError(
            f"speculative_method {method!r} needs a drafter: set speculative_model (a drafter "
            "directory, or 'builtin' for the built-in model's EAGLE3 head)"
        )
    return registered.make_proposer(spec, clock)


def load_configured_drafter(config: EngineConfig, model: TargetModel) -> Drafter | None:
    """Load `config.speculative.model` on `model` (None: no drafter)."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    return load_drafter_model(spec.model, model, spec.method)


def resolve_connector_hash_mode(
    drafter: DrafterPolicy,
    *,
    enable_prefix_caching: bool = True,
    disable_lookahead_block_hashes: bool = False,
    connector: Any | None = None,
    reuse_divergent_blocks: bool = True,
) -> HashMode:
    """The engine's hash mode given its drafter and connector (no divergent block reuse
    under a connector), decided in one call of `resolve_hash_mode` with the connector's
    blocker named. Pure."""
    return resolve_hash_mode(
        drafter,
        enable_prefix_caching=enable_prefix_caching,
        disable_lookahead_block_hashes=disable_lookahead_block_hashes,
        connector=connector,
        reuse_divergent_blocks=reuse_divergent_blocks,
        connector_blocker=lookahead_blocker(connector),
    )
