"""Llama-family loaders: a local Hugging Face directory (safetensors) or a GGUF file -> our model.

Owns turning weights on disk into a ready `LlamaForCausalLM`: the HF name mapping, and writing
a converted HF-style directory. Reading the files (config.json, sharded safetensors, the
checked weight assignment) is shared by every family (`speckv.models.common.weights`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from speckv.attention import AttentionBackend, resolve_dtype
from speckv.models.common.compact_linear import attach_compact
from speckv.models.common.config import ModelConfig
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.common.weights import (
    assign_weights,
    iter_safetensors,
    read_hf_config,
    safetensors_files,
)
from speckv.models.llama.gguf_file import GGUFFile
from speckv.models.llama.model import LlamaForCausalLM

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def our_name(hf_name: str) -> str:
    """HF parameter name -> ours (we drop the leading "model.")."""
    return hf_name.removeprefix("model.")


def build_model(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> LlamaForCausalLM:
    """A model from (HF name, tensor) pairs without a random-init pass (meta device + assign)."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, backend)
    return assign_weights(
        model, tensors, lambda name: None if name.endswith(_IGNORED_SUFFIXES) else our_name(name),
        config.tie_word_embeddings, dtype, device, config.architecture)


def load_hf_dir(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load config.json + *.safetensors (single or sharded) from a local HF directory."""
    d = Path(path)
    config = ModelConfig.from_hf_config(read_hf_config(d))
    model = build_model(config, iter_safetensors(safetensors_files(d)), dtype, device, backend)
    return model, config


def load_gguf(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None]:
    """Load (and dequantize) a GGUF file, its Q4_1 / Q8_0 blocks kept beside the fp32 weights
    for speckv's few-row kernel; the tokenizer too when the file carries one."""
    f = GGUFFile(path)
    config = f.config()
    model = build_model(config, f.tensors(on_tensor), dtype, device, backend)
    attach_compact(model, f.quantized_blocks(), our_name)  # see compact_linear
    tokenizer = None
    if "tokenizer.ggml.tokens" in f.fields:
        tokenizer = Tokenizer.from_gguf_data(f.tokenizer_data())
    return model, config, tokenizer


def save_hf_dir(
    path: str | Path,
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> None:
    """Write config.json + model.safetensors (HF names) (+ tokenizer files) into `path`."""
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    torch_dtype = resolve_dtype(dtype)
    state = {name: t.to(torch_dtype).contiguous() for name, t in tensors}
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_config()
    hf["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(hf, indent=1))
    if tokenizer is not None:
        tokenizer.save(d)
