"""Which drafter a `--speculative-model` names, loaded on its target.

Owns `load_drafter_model`: a drafter directory (its layout detected: EAGLE, EAGLE3, MTP),
"builtin" (the built-in SmolLM2's shipped EAGLE3 head), a Gemma 4 assistant directory or
"random-assistant" on a Gemma 3 / 4 target, and a GDN hybrid's own MTP head. What each family
of drafter needs of its target is checked here, so the engine asks no target its family.
"""

from __future__ import annotations

from speckv.models.base import TargetModel, has_state_group
from speckv.speculation.methods import Drafter


def load_drafter_model(speculative_model: str, model: TargetModel,
                       method: str | None = None) -> Drafter:
    """A drafter dir (layout detected), "builtin" (the built-in SmolLM2's shipped EAGLE3
    head; `method`, when given, must be the drafter's) or, on a GDN hybrid, "random-mtp" (a
    seeded random-init Qwen3-Next MTP head) or the checkpoint directory whose own `mtp.*` head
    to load. Its few-row CPU matmuls take the forms this machine computes fastest, as the
    target's (`small_rows`, `native_linear`, `panel_linear` in `speckv.models.common`), and
    its fp16-exact weights are read as fp16 for the row counts where that measured faster
    (`compact_linear`)."""
    from speckv.models.common.compact_linear import attach_half, use_compact_where_faster
    from speckv.models.common.native_linear import native_max_rows_of, set_native_max_rows
    from speckv.models.common.panel_linear import panel_rows_of, set_panels
    from speckv.models.common.small_rows import (
        cpu_fp32_linears,
        set_small_row_form,
        small_row_form_of,
    )

    drafter = _load_drafter(speculative_model, model, method)
    set_small_row_form(drafter, small_row_form_of(model))
    set_native_max_rows(cpu_fp32_linears(drafter), native_max_rows_of(model))
    set_panels(cpu_fp32_linears(drafter), panel_rows_of(model))
    # an fp16 checkpoint (the built-in EAGLE3 head) read as fp16 where that measured faster
    attach_half(drafter)
    use_compact_where_faster(drafter, min_bytes=0)
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


def _load_assistant(speculative_model: str, model: TargetModel, method: str | None
                    ) -> Drafter:
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
