"""Random initialisation of a decoder (tests, benches and the random-init demo models), and the
dtype / device every decoder reports.

Owns one walk over the parameters: the first rule whose name suffix matches sets the
parameter, biases are zeroed, everything else is drawn from normal(0, init_std). A model passes
only what differs from the transformers default (norm weights 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn

from speckv.attention import resolve_dtype

InitRule = tuple[str, Callable[[torch.Tensor], object]]  # (parameter-name suffix, setter)
UNIT_NORMS: tuple[InitRule, ...] = (("norm.weight", lambda p: p.fill_(1.0)),)

M = TypeVar("M", bound=nn.Module)


def random_init(model: M, init_std: float, dtype: torch.dtype | str,
                device: torch.device | str, rules: Sequence[InitRule] = UNIT_NORMS) -> M:
    """`model` with every parameter set (seed torch first), frozen, cast and in eval mode."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            rule = next((setter for suffix, setter in rules if name.endswith(suffix)), None)
            if rule is not None:
                rule(param)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, init_std)
    model.requires_grad_(False)
    return model.to(device=device, dtype=resolve_dtype(dtype)).eval()


class EmbeddingPlacement:
    """`dtype` and `device` of a decoder, read from its token embedding."""

    embed_tokens: nn.Embedding

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device
