"""EAGLE (EAGLE-1 / EAGLE-2 heads): fc over cat(embed(t[p+1]), target hidden[p]) + one layer.

Owns the EAGLE draft module and drafter. Layout follows the public EAGLE release (cnets.py) and
vLLM's `llama_eagle.py`: `fc: Linear(2H -> H)` over `cat(inputs_embeds, hidden_states)` (embedding
FIRST), one Llama decoder layer whose input layernorm is absent in EAGLE-1 checkpoints (the
layer sees the fused vector directly), no final norm, and the target's LM head and embeddings.
The target hidden state is the target's post-final-norm output (what its LM head reads).
"""

from __future__ import annotations

import torch
from torch import nn

from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.drafters.base import Drafter
from speckv.drafters.draft_state import TargetStates
from speckv.drafters.layers import SharedTarget, drafter_layer_config
from speckv.drafters.modules import FuseThenLayerModule
from speckv.models.common.config import ModelConfig
from speckv.models.common.layers import Linear
from speckv.models.llama.model import LlamaDecoderLayer


class EagleModule(FuseThenLayerModule):
    def __init__(
        self, config: ModelConfig, target: SharedTarget, input_layernorm: bool, fc_bias: bool
    ) -> None:
        super().__init__()
        h = config.hidden_size
        self.target = target
        self.fc = Linear(2 * h, h, bias=fc_bias)
        self.layer = LlamaDecoderLayer(config, 0)
        if not input_layernorm:
            self.layer.input_layernorm = nn.Identity()  # type: ignore[assignment]

    def fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.target.embed(input_ids).to(hidden.dtype)  # [..., hidden]
        return self.fc(torch.cat((emb, hidden), dim=-1))  # [..., hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden)  # EAGLE-1 has no final norm


class EagleDrafter(Drafter):
    """EAGLE head on a Llama-family target (L = 1)."""

    @property
    def policy(self) -> DrafterPolicy:
        return drafter_policy("eagle")

    def __init__(
        self,
        target_config: ModelConfig,
        target: SharedTarget,
        input_layernorm: bool = False,
        fc_bias: bool = True,
    ) -> None:
        super().__init__()
        assert target_config.head_dim is not None
        self.config = drafter_layer_config(target_config, 1)
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = target_config.head_dim
        self.modules_chain = nn.ModuleList(
            [EagleModule(self.config, target, input_layernorm, fc_bias)]
        )

    @property
    def module(self) -> EagleModule:
        return self.modules_chain[0]  # type: ignore[return-value]

    def first_hidden(self, target_states: TargetStates) -> torch.Tensor:
        return target_states.hidden_states.to(self.dtype)
