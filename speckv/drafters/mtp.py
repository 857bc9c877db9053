"""k-module MTP (DeepSeek-V3 / Qwen3-Next style multi-token prediction) on Llama layers.

Owns the MTP draft module and drafter. Module j (1-based) at position p:
    x = eh_proj(cat(enorm(embed(t[p + j])), hnorm(h_{j-1}[p])))    # Linear(2H -> H)
    h_j[p] = decoder_layer_j(x)            # writes module j's draft KV at p (KV layer j - 1)
    logits = head(final_norm_j(h_j[p]))    # predicts t[p + j + 1]
h_0 = the target's post-norm hidden state; module j+1 reads module j's PRE-norm output
(DeepSeek / vLLM `deepseek_mtp.py`). The embedding and LM head are the target's unless the
checkpoint ships its own `shared_head.head`. With `shared_projection=True` (Qwen3-Next `mtp.*`
layout) all modules share one eh_proj / enorm / hnorm / final norm and differ only in the layer.
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
from speckv.models.common.layers import Linear, RMSNorm
from speckv.models.llama.model import LlamaDecoderLayer


class MTPProjection(nn.Module):
    """enorm / hnorm / eh_proj / final norm: shared by all modules in the Qwen layout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.norm = RMSNorm(h, config.rms_norm_eps)


class MTPModule(FuseThenLayerModule):
    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        target: SharedTarget,
        proj: MTPProjection | None = None,
    ) -> None:
        super().__init__()
        self.target = target
        self.proj = proj or MTPProjection(config)
        self.layer = LlamaDecoderLayer(config, layer_idx)
        self.head: nn.Linear | None = None  # own shared_head.head when a checkpoint has one

    def fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.proj.enorm(self.target.embed(input_ids).to(hidden.dtype))
        return self.proj.eh_proj(torch.cat((emb, self.proj.hnorm(hidden)), dim=-1))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = self.proj.norm(hidden)
        if self.head is not None:
            return self.head(normed).float()
        return self.target.logits(normed)


class MTPDrafter(Drafter):
    """k chained MTP modules (L = k); module j proposes draft j."""

    @property
    def policy(self) -> DrafterPolicy:
        return drafter_policy("mtp", self.num_modules)

    def __init__(
        self,
        target_config: ModelConfig,
        target: SharedTarget,
        num_modules: int = 1,
        shared_projection: bool = False,
    ) -> None:
        super().__init__()
        if num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {num_modules}")
        assert target_config.head_dim is not None
        self.config = drafter_layer_config(target_config, num_modules)
        # The mtp_deepseek layout numbers module j's tensors model.layers.{N + j}.
        self.target_num_layers = target_config.num_hidden_layers
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = target_config.head_dim
        shared = MTPProjection(self.config) if shared_projection else None
        self.modules_chain = nn.ModuleList(
            MTPModule(self.config, j, target, shared) for j in range(num_modules)
        )

    @property
    def num_modules(self) -> int:
        return len(self.modules_chain)

    def first_hidden(self, target_states: TargetStates) -> torch.Tensor:
        return target_states.hidden_states.to(self.dtype)
