"""Model loaders: a local Hugging Face directory (safetensors) or a GGUF file -> our model.

Owns turning weights on disk into a ready `LlamaForCausalLM` (and the checked weight assignment
every decoder's loader shares, `assign_weights`): HF name mapping, sharded
safetensors (model.safetensors.index.json), dtype/device placement, tied embeddings, and
writing a converted HF-style directory. Never unpickles anything (.bin files are refused).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from speckv.attention import AttentionBackend, resolve_dtype
from speckv.models.config import ModelConfig
from speckv.models.gguf_file import GGUFFile
from speckv.models.llama import LlamaForCausalLM
from speckv.models.model_files import read_json_file, reading
from speckv.models.tokenizer import Tokenizer

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

M = TypeVar("M", bound=nn.Module)


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


def assign_weights(
    model: M,
    tensors: Iterable[tuple[str, torch.Tensor]],
    rename: Callable[[str], str | None],
    tied: bool,
    dtype: torch.dtype | str,
    device: torch.device | str,
    model_name: str,
) -> M:
    """`model`, built on the meta device, with its weights from (HF name, tensor) pairs:
    `rename` gives our name (None: not ours, skipped); every weight must arrive with its shape;
    a tied head is the embedding. Frozen (serving weights; autograd would only cost memory)."""
    torch_dtype = resolve_dtype(dtype)
    expected = dict(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        key = rename(name)
        if key is None or (key == "lm_head.weight" and tied):
            continue  # tied: the embedding is the head
        if key not in expected:
            raise ValueError(f"unexpected weight {name!r} for {model_name}")
        if tuple(t.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(t.shape)}, expected {tuple(expected[key].shape)}"
            )
        state[key] = t.to(device=device, dtype=torch_dtype)
    if tied and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"missing weights: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    model.requires_grad_(False)
    return model.eval()


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = read_json_file(index)["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(path.glob("*.bin"))
        hint = " (found .bin pickles, which we never load; convert to safetensors)" if bins else ""
        raise FileNotFoundError(f"no *.safetensors in {path}{hint}")
    return files


def _iter_safetensors(files: list[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    for f in files:
        with reading(f, "safetensors file"):
            handle = safe_open(str(f), framework="pt", device="cpu")
            names = list(handle.keys())
        with handle as st:
            for name in names:
                with reading(f, "safetensors file"):
                    tensor = st.get_tensor(name)
                yield name, tensor


def load_hf_dir(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load config.json + *.safetensors (single or sharded) from a local HF directory."""
    d = Path(path)
    cfg_path = d / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"no config.json in {d}")
    config = ModelConfig.from_hf_config(read_json_file(cfg_path))
    model = build_model(config, _iter_safetensors(_safetensors_files(d)), dtype, device, backend)
    return model, config


def load_hf_tokenizer(path: str | Path, config: ModelConfig | None = None) -> Tokenizer | None:
    """The directory's tokenizer.json as a `Tokenizer`, or None when there is none."""
    d = Path(path)
    if not (d / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(d, config.eos_token_ids if config else ())


def load_gguf(
    path: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    backend: AttentionBackend | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig, Tokenizer | None]:
    """Load (and dequantize) a GGUF file; the tokenizer too when the file carries one."""
    f = GGUFFile(path)
    config = f.config()
    model = build_model(config, f.tensors(on_tensor), dtype, device, backend)
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
