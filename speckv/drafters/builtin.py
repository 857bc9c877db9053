"""The shipped EAGLE head for the built-in SmolLM2-135M-Instruct (`speckv/assets/smollm2-eagle`).

Owns locating and loading the trained head that `speckv train-draft --install-asset` writes, so
the demo can speculate without training first. The head stores only fc + its decoder layer
(fp16); embeddings and LM head are the target's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from speckv.drafters.eagle import EagleDrafter
from speckv.drafters.loaders import load_drafter
from speckv.models.llama import LlamaForCausalLM

BUILTIN_EAGLE_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-eagle"


def builtin_eagle_available() -> bool:
    return (BUILTIN_EAGLE_DIR / "config.json").is_file() and (
        BUILTIN_EAGLE_DIR / "model.safetensors"
    ).is_file()


def load_builtin_eagle(
    model: LlamaForCausalLM,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> EagleDrafter:
    """The shipped EAGLE head on `model` (the built-in SmolLM2); dtype/device default to its."""
    if not builtin_eagle_available():
        raise FileNotFoundError(
            f"no shipped EAGLE head in {BUILTIN_EAGLE_DIR}; train one with "
            "`speckv train-draft --install-asset`"
        )
    drafter = load_drafter(BUILTIN_EAGLE_DIR, model, dtype, device)
    assert isinstance(drafter, EagleDrafter)
    return drafter
