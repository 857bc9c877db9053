"""A Qwen3-Next-style MTP drafter for a Gated DeltaNet hybrid target (random init).

Owns building speckv's k-module MTP drafter (`mtp.py`, Qwen layout: one shared enorm / hnorm /
eh_proj / final norm, one decoder layer per module) on a `HybridForCausalLM`: the drafter
shares the hybrid's embedding and LM head and gets full-attention layers with the hybrid's
attention shapes (`HybridConfig.drafter_base_config`), so its draft KV lives in the hybrid's
full-attention block table. Draft modules have no linear-attention layers, so speculation never
touches the target's recurrent state; the runner commits only verified states
(`speckv.engine.hybrid_state`).

Random init only: a real Qwen3-Next `mtp.*` checkpoint has a gated-attention layer (q_proj
with an output gate, partial RoPE, zero-centred norms) that speckv's Llama-layer MTP module
does not load yet.
"""

from __future__ import annotations

import torch

from speckv.drafters.base import Drafter
from speckv.drafters.loaders import random_drafter
from speckv.drafters.mtp import MTPDrafter

RANDOM_MTP = "random-mtp"  # the speculative_model name of this drafter


class _DraftTarget:
    """What drafter builders read of a target: a Llama-layer config, embedding, LM head."""

    def __init__(self, model) -> None:
        self.config = model.config.drafter_base_config()
        self.embed_tokens = model.embed_tokens
        self.lm_head = model.lm_head
        self.dtype: torch.dtype = model.dtype
        self.device: torch.device = model.device


def random_hybrid_mtp(model, num_modules: int = 1, seed: int = 0,
                      init_std: float = 0.2) -> MTPDrafter:
    """A seeded random MTP drafter (Qwen layout, `num_modules` modules) on a GDN hybrid."""
    drafter = random_drafter("mtp", _DraftTarget(model), init_std, seed, layout="qwen",
                             num_modules=num_modules)
    assert isinstance(drafter, MTPDrafter)
    return drafter


def random_hybrid_drafter(method: str, model, num_modules: int = 1, seed: int = 0,
                          init_std: float = 0.2) -> Drafter:
    """A seeded random EAGLE / EAGLE3 / MTP drafter on a GDN hybrid (Llama-shaped layers)."""
    if method == "mtp":
        return random_hybrid_mtp(model, num_modules, seed, init_std)
    return random_drafter(method, _DraftTarget(model), init_std, seed)
