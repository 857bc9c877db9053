"""Reading a checkpoint directory, for every family's loader: its config.json, its safetensors
files (single or sharded, in `model.safetensors.index.json` order), its tokenizer, and the
checked assignment of (HF name, tensor) pairs onto a model built on the meta device.

Never unpickles anything: a directory with only `.bin` files is refused with a hint.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from torch import nn

from speckv.attention import resolve_dtype
from speckv.models.common.model_files import read_json_file, reading
from speckv.models.common.tokenizer import Tokenizer

M = TypeVar("M", bound=nn.Module)


def read_hf_config(directory: Path) -> dict[str, Any]:
    """The parsed config.json of an HF model directory (FileNotFoundError: none)."""
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {directory}")
    return read_json_file(path)


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


def safetensors_files(path: Path) -> list[Path]:
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


def iter_safetensors(files: list[Path]) -> Iterable[tuple[str, torch.Tensor]]:
    for f in files:
        with reading(f, "safetensors file"):
            handle = safe_open(str(f), framework="pt", device="cpu")
            names = list(handle.keys())
        with handle as st:
            for name in names:
                with reading(f, "safetensors file"):
                    tensor = st.get_tensor(name)
                yield name, tensor


def load_hf_tokenizer(path: str | Path, config: Any | None = None) -> Tokenizer | None:
    """The directory's tokenizer.json as a `Tokenizer`, or None when there is none."""
    d = Path(path)
    if not (d / "tokenizer.json").is_file():
        return None
    return Tokenizer.from_dir(d, config.eos_token_ids if config else ())
