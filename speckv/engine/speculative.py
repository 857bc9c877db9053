"""The engine's speculative-decoding setup: which proposer, which drafter policy.

Owns turning `EngineConfig.speculative_method` (+ a drafter model) into a `Proposer` that
carries its `DrafterPolicy`; the policy then decides lookahead hashes versus the legacy drop
(`speckv.spec.policy.resolve_hash_mode`). Drafter modules live in `speckv.drafters`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from speckv.engine.config import DRAFT_MODEL_METHODS, EngineConfig
from speckv.engine.proposer import NgramProposer, Proposer
from speckv.spec.policy import DrafterPolicy, make_drafter_policy

if TYPE_CHECKING:
    from speckv.drafters.base import Drafter
    from speckv.models import LlamaForCausalLM
else:
    Drafter = object


def policy_for_drafter(drafter: Drafter) -> DrafterPolicy:
    """The policy type of a drafter module: EAGLE, EAGLE3 or k-module MTP."""
    from speckv.drafters.eagle import EagleDrafter
    from speckv.drafters.eagle3 import Eagle3Drafter
    from speckv.drafters.mtp import MTPDrafter

    if isinstance(drafter, Eagle3Drafter):
        return make_drafter_policy("eagle3")
    if isinstance(drafter, EagleDrafter):
        return make_drafter_policy("eagle")
    if isinstance(drafter, MTPDrafter):
        return make_drafter_policy("mtp", drafter.num_modules)
    raise TypeError(f"no drafter policy for {type(drafter).__name__}")


def method_of(drafter: Drafter) -> str:
    """The `EngineConfig.speculative_method` of a drafter module (eagle, eagle3, mtp)."""
    return policy_for_drafter(drafter).name


def speculative_args(drafter: Drafter | None, num_spec_tokens: int) -> dict[str, Any]:
    """The `EngineConfig` speculative fields for running `drafter` (None: no speculation)."""
    if drafter is None:
        return {"speculative_method": None, "num_spec_tokens": 0}
    return {"speculative_method": method_of(drafter), "num_spec_tokens": num_spec_tokens}


def make_proposer(config: EngineConfig, drafter: Drafter | None, num_blocks: int
                  ) -> Proposer | None:
    """The proposer for the config (None: no speculation)."""
    method = config.speculative_method
    if drafter is not None:
        policy = policy_for_drafter(drafter)
        if method not in (None, policy.name):
            raise ValueError(
                f"EngineConfig.speculative_method is {method!r} but the drafter is "
                f"{policy.name}"
            )
        from speckv.drafters.proposer import DrafterProposer

        return DrafterProposer(drafter, config.num_spec_tokens or 3, num_blocks,
                               config.block_size, policy)
    if method == "ngram":
        return NgramProposer(config.num_spec_tokens, config.prompt_lookup_min,
                             config.prompt_lookup_max)
    if method in DRAFT_MODEL_METHODS:
        raise ValueError(
            f"speculative_method {method!r} needs a drafter (EngineConfig.draft_model or "
            "LLMEngine(drafter=...))"
        )
    return None


def load_configured_drafter(config: EngineConfig, model: LlamaForCausalLM) -> Drafter | None:
    """Load `config.draft_model` on `model` (None: no drafter)."""
    return None if config.draft_model is None else load_drafter_model(config.draft_model, model)


def load_drafter_model(draft_model: str, model: LlamaForCausalLM) -> Drafter:
    """A drafter dir (format detected) or "builtin" (the shipped SmolLM2 EAGLE head)."""
    if draft_model == "builtin":
        from speckv.drafters.builtin import load_builtin_eagle

        return load_builtin_eagle(model)
    from speckv.drafters.loaders import load_drafter

    return load_drafter(draft_model, model)
