"""Qwen3-Next / Qwen3.5 MTP: the checkpoints' own multi-token-prediction head on a GDN hybrid.

Owns the MTP drafter whose weights ship inside a Qwen3-Next / Qwen3.5 checkpoint (`mtp.*`,
ignored by transformers, loaded by vLLM's `qwen3_next_mtp.py`), in speckv's drafter contract
(`base.py`: catch-up writes draft KV, then `propose`). Module j (one per `mtp.layers.{j}`) at
position p, with h_0 the target's post-norm hidden state:

    x = fc(cat(pre_fc_norm_embedding(embed(t[p + j])), pre_fc_norm_hidden(h_{j-1}[p])))
    h_j[p] = layer_j(x)      a full gated-attention decoder layer of the target's kind
                             (q/k norms, partial RoPE, output gate; dense or sparse-MoE MLP)
    logits = lm_head(norm(h_j[p]))                      (the target's LM head)

`fc`, the three zero-centred norms are shared by all modules. The layers are the target's own
classes (`HybridDecoderLayer`), so their numerics are the ones parity-tested against
transformers; module j keeps its KV in layer j of the drafter's paged cache (the target's
full-attention block table). No linear-attention layer: drafting never touches GDN state.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from speckv.attention import AttentionMetadata, PagedKVCache, get_attention_backend
from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.drafters.base import Drafter
from speckv.drafters.draft_state import TargetStates
from speckv.drafters.layers import SharedTarget
from speckv.drafters.modules import DraftModule
from speckv.models.common.rope import RotaryEmbedding
from speckv.models.hybrid.config import HybridConfig
from speckv.models.hybrid.model import HybridDecoderLayer, ZeroCenteredRMSNorm

_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")


class GatedMTPProjection(nn.Module):
    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.norm = ZeroCenteredRMSNorm(h, eps)


class GatedMTPModule(DraftModule):
    def __init__(self, config: HybridConfig, index: int, target: SharedTarget,
                 proj: GatedMTPProjection, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.target = target
        self.proj = proj
        self.layer = HybridDecoderLayer(config, index, get_attention_backend())
        self._rotary = rotary

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
        emb = self.proj.pre_fc_norm_embedding(self.target.embed(input_ids).to(hidden.dtype))
        x = self.proj.fc(torch.cat((emb, self.proj.pre_fc_norm_hidden(hidden)), dim=-1))
        cos_sin = self._rotary.cos_sin(positions, x.dtype)
        return self.layer(x, cos_sin, kv_cache, metadata, None)

    def dense_forward(self, input_ids, hidden, positions):
        raise NotImplementedError("the Qwen3-Next MTP module has no dense training path")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(self.proj.norm(hidden))


class GatedMTPDrafter(Drafter):
    """k MTP modules of a Qwen3-Next / Qwen3.5 checkpoint (L = k)."""

    def __init__(self, target_config: HybridConfig, target: SharedTarget,
                 num_modules: int = 1, moe: bool | None = None) -> None:
        super().__init__()
        if num_modules < 1:
            raise ValueError(f"num_modules must be >= 1, got {num_modules}")
        moe = bool(target_config.moe_layers) if moe is None else moe
        self.config = target_config.replace(
            num_hidden_layers=num_modules, layer_types=("full_attention",) * num_modules,
            moe_layers=tuple(range(num_modules)) if moe else ())
        self.num_kv_heads = target_config.num_key_value_heads
        self.head_dim = target_config.head_dim
        self.proj = GatedMTPProjection(self.config)
        rotary = RotaryEmbedding(self.config.rotary_dim, self.config.rope_theta, None,
                                 self.config.max_position_embeddings)
        self.modules_chain = nn.ModuleList(
            GatedMTPModule(self.config, j, target, self.proj, rotary)
            for j in range(num_modules))

    @property
    def policy(self) -> DrafterPolicy:
        return drafter_policy("mtp", len(self.modules_chain))

    def first_hidden(self, target_states: TargetStates) -> torch.Tensor:
        return target_states.hidden_states.to(self.dtype)

    # ---- weights ---------------------------------------------------------------------------
    def hf_name(self, ours: str) -> str:
        """Our parameter name -> the checkpoint's `mtp.*` name."""
        shared = re.match(r"^(?:modules_chain\.\d+\.)?proj\.(.*)$", ours)
        if shared is not None:  # the shared fc / norms (registered once per module too)
            return "mtp." + shared.group(1)
        match = re.match(r"^modules_chain\.(\d+)\.layer\.(.*)$", ours)
        if match is None:
            raise KeyError(ours)
        return f"mtp.layers.{match.group(1)}.{match.group(2)}"


def mtp_layer_count(names: list[str]) -> int:
    """How many `mtp.layers.{j}` a checkpoint's tensor names hold."""
    indices = {int(m.group(1)) for name in names if (m := _LAYER.match(name))}
    return max(indices) + 1 if indices else 0


def load_gated_mtp(path: str | Path, model) -> GatedMTPDrafter:
    """The MTP head of a Qwen3-Next / Qwen3.5 checkpoint directory (its `mtp.*` tensors) on
    `model` (a `HybridForCausalLM` of that checkpoint)."""
    from safetensors import safe_open

    from speckv.models.common.weights import safetensors_files

    files = safetensors_files(Path(path))
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                if name.startswith("mtp."):
                    where[name] = f
    k = mtp_layer_count(list(where))
    if k == 0:
        raise ValueError(f"{path}: no mtp.layers.* tensors (this checkpoint has no MTP head)")
    moe = any(".mlp.experts." in name for name in where)
    drafter = GatedMTPDrafter(model.config, SharedTarget.of(model), k, moe)
    expected = drafter.state_dict()
    wanted = {ours: drafter.hf_name(ours) for ours in expected}
    missing = sorted(h for h in wanted.values() if h not in where)
    if missing:
        raise ValueError(f"{path}: missing MTP tensors {missing[:6]}")
    state = {}
    for ours, name in wanted.items():
        with safe_open(str(where[name]), framework="pt", device="cpu") as st:
            t = st.get_tensor(name)
        if tuple(t.shape) != tuple(expected[ours].shape):
            raise ValueError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected "
                             f"{tuple(expected[ours].shape)}")
        state[ours] = t
    drafter.load_state_dict(state, strict=True)
    drafter.requires_grad_(False)
    return drafter.to(device=model.device, dtype=model.dtype).eval()


def random_gated_mtp(model, num_modules: int = 1, seed: int = 0,
                     init_std: float = 0.2) -> GatedMTPDrafter:
    """A seeded random-init Qwen3-Next MTP head on `model` (tests, `hybrid-gdn`)."""
    drafter = GatedMTPDrafter(model.config, SharedTarget.of(model), num_modules)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    drafter.requires_grad_(False)
    return drafter.to(device=model.device, dtype=model.dtype).eval()
