"""Drafters on a Gated DeltaNet hybrid target: which one a name means, and random-init ones.

Owns the dispatch for `speculative_model` on a `HybridForCausalLM`: "random-mtp" is a seeded
random-init Qwen3-Next MTP head (`gated_mtp.py`: the checkpoint format's gated-attention MTP
layer), a directory is a Qwen3-Next / Qwen3.5 checkpoint whose own `mtp.*` head is loaded.
Also seeded random EAGLE / EAGLE3 drafters on a hybrid (speckv's Llama-layer drafters with the
hybrid's attention shapes, `HybridConfig.drafter_base_config`) for the draft-KV checks.
Drafters have attention layers only: their KV follows the hybrid's full-attention block table
and speculation never touches the target's recurrent state (the runner commits only verified
states, `speckv.engine.hybrid_state`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from speckv.drafters.base import Drafter
from speckv.drafters.gated_mtp import GatedMTPDrafter, load_gated_mtp, random_gated_mtp
from speckv.drafters.loaders import random_drafter

RANDOM_MTP = "random-mtp"  # the speculative_model name of a random-init MTP head


class _DraftTarget:
    """What drafter builders read of a target: a Llama-layer config, embedding, LM head."""

    def __init__(self, model) -> None:
        self.config = model.config.drafter_base_config()
        self.embed_tokens = model.embed_tokens
        self.lm_head = model.lm_head
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device


def random_hybrid_drafter(method: str, model, num_modules: int = 1, seed: int = 0,
                          init_std: float = 0.2) -> Drafter:
    """A seeded random EAGLE / EAGLE3 / MTP (Qwen3-Next format) drafter on a GDN hybrid."""
    if method == "mtp":
        return random_gated_mtp(model, num_modules, seed, init_std)
    return random_drafter(method, _DraftTarget(model), init_std, seed)


def load_hybrid_drafter(speculative_model: str, model) -> GatedMTPDrafter:
    """`speculative_model` on a GDN hybrid: "random-mtp", or a checkpoint dir with `mtp.*`."""
    if speculative_model == RANDOM_MTP:
        return random_gated_mtp(model)
    if Path(speculative_model).is_dir():
        return load_gated_mtp(speculative_model, model)
    raise ValueError(f"speculative_model {speculative_model!r}: on a GDN hybrid use "
                     f"{RANDOM_MTP!r} (a random-init MTP head) or a Qwen3-Next / Qwen3.5 "
                     "checkpoint directory whose mtp.* head to load")
