"""The engine's speculative-decoding setup: which proposer runs, from the config.

Owns turning `EngineConfig.speculative` (its method, + a drafter loaded from its `model`)
into a `Proposer`. The proposer carries its drafter's policy
(`speckv.speculation.policy`), which then decides lookahead hashes versus the legacy drop. Drafter
modules live in `speckv.drafters`; the proposer protocol and the n-gram proposer in
`speckv.speculation`. Also the engine's hash mode from its drafter's policy and its KV connector.
"""

from __future__ import annotations

import time
from typing import Any

from speckv.cache.hash_mode import HashMode
from speckv.connectors.capability import lookahead_blocker
from speckv.drafters.base import Drafter as ChainDrafter
from speckv.drafters.gemma4_assistant import Gemma4Assistant
from speckv.engine.config import DRAFTER_METHODS, EngineConfig
from speckv.models.base import TargetModel, has_state_group
from speckv.speculation.adaptive import Clock
from speckv.speculation.ngram import NgramProposer
from speckv.speculation.policy import DrafterPolicy, resolve_hash_mode
from speckv.speculation.proposer import Proposer

# What `drafter=` takes: a chain of draft modules with its own draft KV (EAGLE, EAGLE3, MTP,
# the GDN hybrid's MTP head), or the Gemma 4 assistant that reads the target's KV. Both say
# their `speculative_method` and build their own proposer.
Drafter = ChainDrafter | Gemma4Assistant

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
    if spec is not None and spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                             spec.prompt_lookup_max, clock)
    if method in DRAFTER_METHODS:
        raise ValueError(
            f"speculative_method {method!r} needs a drafter: set speculative_model (a drafter "
            "directory, or 'builtin' for the built-in model's EAGLE3 head)"
        )
    return None


def load_configured_drafter(config: EngineConfig, model: TargetModel) -> Drafter | None:
    """Load `config.speculative.model` on `model` (None: no drafter)."""
    spec = config.speculative
    if spec is None or spec.model is None:
        return None
    return load_drafter_model(spec.model, model, spec.method)


def load_drafter_model(speculative_model: str, model: TargetModel,
                       method: str | None = None) -> Drafter:
    """A drafter dir (layout detected), "builtin" (the built-in SmolLM2's shipped EAGLE3
    head; `method`, when given, must be the drafter's) or, on a GDN hybrid, "random-mtp" (a
    seeded random-init Qwen3-Next MTP head) or the checkpoint directory whose own `mtp.*` head
    to load. Its few-row CPU matmuls take the form this machine computes fastest, as the
    target's (`speckv.models.common.small_rows`)."""
    from speckv.models.common.small_rows import set_small_row_form, small_row_form_of

    drafter = _load_drafter(speculative_model, model, method)
    set_small_row_form(drafter, small_row_form_of(model))
    return drafter


def _load_drafter(speculative_model: str, model: TargetModel, method: str | None) -> Drafter:
    if has_state_group(model):  # a GDN hybrid: its MTP head
        from speckv.drafters.hybrid_mtp import load_hybrid_drafter

        return load_hybrid_drafter(speculative_model, model)
    from speckv.drafters.gemma4_assistant import RANDOM_ASSISTANT, is_assistant_dir

    if speculative_model == RANDOM_ASSISTANT or is_assistant_dir(speculative_model):
        return _load_assistant(speculative_model, model, method)
    if speculative_model == "builtin":
        from speckv.drafters.builtin import BUILTIN_DRAFTER_METHOD, load_builtin_drafter

        if method is not None and method != BUILTIN_DRAFTER_METHOD:
            raise ValueError(
                f"the built-in model ships an {BUILTIN_DRAFTER_METHOD.upper()} head only, no "
                f"built-in {method.upper()} drafter: use speculative method "
                f"{BUILTIN_DRAFTER_METHOD!r}, or give a {method} drafter directory as the "
                "speculative model (--speculative-model DIR)"
            )
        return load_builtin_drafter(model)
    from speckv.drafters.loaders import load_drafter

    return load_drafter(speculative_model, model)


def _load_assistant(speculative_model: str, model: TargetModel, method: str | None):
    """The Gemma 4 MTP assistant: a `Gemma4AssistantForCausalLM` directory, or
    "random-assistant" (seeded random init) on a Gemma 3 / 4 target."""
    from speckv.drafters.gemma4_assistant import (
        RANDOM_ASSISTANT,
        load_gemma4_assistant,
        random_gemma4_assistant,
    )

    if method is not None and method != "mtp":
        raise ValueError(f"{speculative_model}: a Gemma 4 assistant is an MTP drafter; use "
                         "--speculative-method mtp")
    from speckv.models.gemma.gemma3 import GemmaForCausalLM
    from speckv.models.gemma.gemma4 import Gemma4ForCausalLM

    if not isinstance(model, GemmaForCausalLM | Gemma4ForCausalLM):
        raise ValueError(f"{speculative_model}: a Gemma 4 assistant drafts for a Gemma 3 / 4 "
                         "target (it reads the target's KV); this model is not one")
    if speculative_model == RANDOM_ASSISTANT:
        return random_gemma4_assistant(model)
    return load_gemma4_assistant(speculative_model, model)


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
