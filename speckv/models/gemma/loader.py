"""Loading Gemma 3 / Gemma 4 text checkpoints: HF config.json + safetensors -> our model.

Owns the HF name mapping for Gemma (`model.` prefix dropped; a `model.language_model.` prefix
of a multimodal checkpoint is refused with the config check), tied embeddings, dtype/device
placement, and writing a directory back (config.json + model.safetensors) for tests and the
tiny `hybrid-swa` model. Never unpickles anything.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from speckv.attention import AttentionBackend, resolve_dtype
from speckv.models.common.weights import (
    assign_weights,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from speckv.models.gemma.gemma3 import GemmaConfig, GemmaForCausalLM
from speckv.models.gemma.gemma4 import Gemma4Config, Gemma4ForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embed_scale")


def build_gemma(
    config: GemmaConfig | Gemma4Config,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
):
    """A model (Gemma 3 or 4, by the config's type) from (HF name, tensor) pairs, without a
    random-init pass."""
    tied = config.base.tie_word_embeddings
    # KV-shared Gemma 4 layers have no K/V weights; checkpoints may still carry them
    shared = set()
    if isinstance(config, Gemma4Config):
        shared = {f"layers.{i}.self_attn." for i, mode in enumerate(config.kv_sharing_modes)
                  if mode == "reuse"}
    model_type = Gemma4ForCausalLM if isinstance(config, Gemma4Config) else GemmaForCausalLM
    with torch.device("meta"):
        model = model_type(config, backend)
    ours = set(model.state_dict())

    def rename(name: str) -> str | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        key = name.removeprefix("model.")
        if key not in ours and any(key.startswith(prefix) for prefix in shared):
            return None  # a KV-shared layer's own K/V projections: it reads its owner's cache
        return key

    return assign_weights(model, tensors, rename, tied, dtype, device, "a Gemma text model")


def gemma_config_of(cfg: dict) -> GemmaConfig | Gemma4Config:
    """The Gemma 3 or Gemma 4 config of a HF config.json dict (errors name what is missing)."""
    model_type = str(cfg.get("model_type", "")).lower()
    archs = [str(a) for a in cfg.get("architectures") or []]
    if model_type.startswith("gemma4") or any(a.startswith("Gemma4") for a in archs):
        return Gemma4Config.from_hf_config(cfg)
    return GemmaConfig.from_hf_config(cfg)


def load_gemma_dir(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
):
    """Load a local Gemma 3 / 4 text checkpoint (config.json + *.safetensors)."""
    d = Path(path)
    config = gemma_config_of(read_hf_config(d))
    return build_gemma(config, iter_safetensors(safetensors_files(d)), dtype, device, backend)


def hf_state_items(model: GemmaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every weight, as `Gemma3ForCausalLM` names them."""
    items = []
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            if not model.config.tie_word_embeddings:
                items.append((name, t))
            continue
        items.append((f"model.{name}", t))
    return items


def save_gemma_dir(path: str | Path, model: GemmaForCausalLM,
                   dtype: torch.dtype | str | None = None) -> None:
    """Write config.json + model.safetensors (HF names) into `path`."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    torch_dtype = resolve_dtype(dtype) if dtype is not None else model.dtype
    state = {name: t.to(torch_dtype).contiguous() for name, t in hf_state_items(model)}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = model.gemma.to_hf_config()
    hf["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(hf, indent=1))
