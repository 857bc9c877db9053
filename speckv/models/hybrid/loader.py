"""Loader of Gated DeltaNet hybrids: a local HF directory (config.json + safetensors) of
Qwen3-Next or Qwen3.5 -> `HybridForCausalLM`, and the random-init tiny hybrid the engine serves
as `--model hybrid-gdn`.

Owns the HF name mapping of these families (hub per-expert MoE names load as they are):
"model." (Qwen3-Next, Qwen3.5 text) or "model.language_model." (the Qwen3.5 multimodal
checkpoint) is dropped; the vision tower
(`model.visual.*`) and the MTP head (`mtp.*`) are skipped (text only; speckv's MTP drafter
is built separately). Never unpickles (.bin files are refused by the shared file lister).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from speckv.attention import AttentionBackend
from speckv.models.common.weights import (
    assign_weights,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from speckv.models.hybrid.config import HybridConfig
from speckv.models.hybrid.model import HybridForCausalLM

_SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

# The `--model hybrid-gdn` shape: 2 GDN layers per full-attention layer (Qwen3-Next's 3:1
# interval shortened), small enough for CPU tests, with Qwen3-Next's head grouping (Hv = 2 Hk).
TINY_HYBRID_SHAPE: dict[str, Any] = dict(
    architecture="qwen3_next",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=("linear_attention", "linear_attention", "full_attention"),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    partial_rotary_factor=0.5,
    max_position_embeddings=4096,
)
HYBRID_MODEL_NAMES: tuple[str, ...] = ("hybrid-gdn",)


def our_hybrid_name(hf_name: str) -> str | None:
    """HF parameter name -> ours; None for tensors we skip (vision tower, MTP head)."""
    if hf_name.startswith(_SKIPPED_PREFIXES) or hf_name.endswith(_IGNORED_SUFFIXES):
        return None
    for prefix in ("model.language_model.", "model."):
        if hf_name.startswith(prefix):
            return hf_name[len(prefix):]
    return hf_name


def build_hybrid(config: HybridConfig, tensors: Iterable[tuple[str, torch.Tensor]],
                 dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                 backend: AttentionBackend | None = None) -> HybridForCausalLM:
    """A model from (HF name, tensor) pairs (meta device + assign, no random-init pass)."""
    with torch.device("meta"):
        model = HybridForCausalLM(config, backend)
    return assign_weights(model, tensors, our_hybrid_name, config.tie_word_embeddings, dtype,
                          device, config.architecture)


def load_hybrid_dir(path: str | Path, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu",
                    backend: AttentionBackend | None = None
                    ) -> tuple[HybridForCausalLM, HybridConfig]:
    """config.json + *.safetensors (single or sharded) of a Qwen3-Next / Qwen3.5 directory."""
    d = Path(path)
    config = HybridConfig.from_hf_config(read_hf_config(d))
    model = build_hybrid(config, iter_safetensors(safetensors_files(d)), dtype, device,
                         backend)
    return model, config


def tiny_hybrid_config(**overrides: Any) -> HybridConfig:
    return HybridConfig(**{**TINY_HYBRID_SHAPE, **overrides})


def tiny_hybrid(seed: int = 1234, init_std: float = 0.2, dtype: str = "float32",
                device: str = "cpu", **overrides: Any) -> HybridForCausalLM:
    """The random-init tiny GDN hybrid (`--model hybrid-gdn`), seeded. A large init std gives
    peaked, input-dependent logits (greedy outputs without long argmax ties)."""
    torch.manual_seed(seed)
    return HybridForCausalLM.from_config(tiny_hybrid_config(**overrides), dtype, device,
                                         init_std)
