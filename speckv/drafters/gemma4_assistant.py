"""The Gemma 4 MTP assistant (`Gemma4AssistantForCausalLM`): a drafter that reads the target's KV.

Owns the assistant's config (`gemma4_assistant` config.json: a Gemma 4 text decoder whose every
layer shares KV, `backbone_hidden_size`, the optional centroid-masked head), its weights in the
transformers layout, and one draft step over the target's paged KV. It writes no KV of its own,
so its policy is `gemma4_mtp` (L = 0): no lookahead hashes and never the trailing-block drop.

One request with n real tokens (t[n-1] just sampled; the target's KV is final at 0 .. n-2)::

    x_1 = pre_projection([target_embed(t[n-1]) ; h_target[n-2]])      [backbone * 2 -> hidden]
    every step d = 1 .. S, at the fixed query position n-1:
        y_d = norm(layers(x_d))     layer of type T attends the target's KV of the last
                                    KV-owning target layer of type T: full layers keys
                                    0 .. n-2, sliding layers the last W of them (n-1-W .. n-2)
        draft d = argmax head(y_d)  (lm_head, or the centroid-masked head)
        x_{d+1} = pre_projection([target_embed(draft d) ; post_projection(y_d)])

h_target is the target's hidden state after its final norm (transformers' `hidden_states[-1]`).
The position stays n-1 for every step, as transformers' candidate generator keeps it.

Sliding layers read W keys, the target's own window for a query at n-1 without that query's
key. transformers' bidirectional sliding mask (|q - kv| <= W) would take W + 1 when handed a
longer tail; the sliding-window manager keeps only keys a target query still reads (the first
query of a step reads n_old - W onward), so key n-2-W may already be back in the pool.

The centroid-masked head (`use_ordered_embeddings`): the top `centroid_intermediate_top_k` of
`num_centroids` centroid logits pick `vocab / num_centroids` tokens each (`token_ordering`), only
those are scored with the LM head; the rest get (the lowest scored logit - 1), as transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from speckv.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from speckv.attention.kv_cache import LayerKVCache
from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.drafters.layers import SharedTarget
from speckv.models.common.config import ModelConfig
from speckv.models.common.rope import RotaryEmbedding, apply_rope
from speckv.models.gemma.gemma3 import GemmaMLP
from speckv.models.gemma.gemma4 import Gemma4Config, Gemma4RMSNorm, _proportional_inv_freq

if TYPE_CHECKING:  # the assistant builds its proposer (`make_proposer`), which binds TargetKV
    from speckv.drafters.gemma4_assistant_proposer import TargetKV

ASSISTANT_MODEL_TYPE = "gemma4_assistant"
RANDOM_ASSISTANT = "random-assistant"  # the speculative_model name of a random-init one
KINDS = ("sliding_attention", "full_attention")
CosSin = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class AssistantConfig:
    """`text`: the assistant's decoder (its layers own no KV; `num_kv_shared_layers` is 0
    here because every layer reads the target's)."""

    text: Gemma4Config
    backbone_hidden_size: int
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_intermediate_top_k: int = 32

    def __post_init__(self) -> None:
        vocab = self.text.base.vocab_size
        if self.use_ordered_embeddings:
            if self.num_centroids < 1 or vocab % self.num_centroids:
                raise ValueError(f"num_centroids {self.num_centroids} must divide the "
                                 f"vocabulary ({vocab})")
            if not 1 <= self.centroid_intermediate_top_k <= self.num_centroids:
                raise ValueError("centroid_intermediate_top_k must be in [1, num_centroids]")

    @classmethod
    def from_hf_config(cls, cfg: Mapping[str, Any]) -> AssistantConfig:
        if not is_assistant_config(cfg):
            raise ValueError("not a Gemma 4 assistant config (model_type gemma4_assistant)")
        text = dict(cfg.get("text_config") or {})
        if not text:
            raise ValueError("gemma4_assistant config.json has no text_config")
        for key in ("hidden_size_per_layer_input", "vocab_size_per_layer_input"):
            if text.get(key):
                raise ValueError(f"text_config.{key} must be 0 in a Gemma 4 assistant")
        for key in ("enable_moe_block", "use_double_wide_mlp"):
            if text.get(key):
                raise ValueError(f"text_config.{key} must be false in a Gemma 4 assistant")
        shared = text.get("num_kv_shared_layers")
        if shared and int(shared) != int(text["num_hidden_layers"]):
            raise ValueError("every layer of a Gemma 4 assistant reads the target's KV "
                             f"(num_kv_shared_layers {shared} != num_hidden_layers)")
        text.update(model_type="gemma4_text", num_kv_shared_layers=0,
                    tie_word_embeddings=cfg.get("tie_word_embeddings", True))
        return cls(text=Gemma4Config.from_hf_config(text),
                   backbone_hidden_size=int(cfg.get("backbone_hidden_size", 1536)),
                   use_ordered_embeddings=bool(cfg.get("use_ordered_embeddings", False)),
                   num_centroids=int(cfg.get("num_centroids", 2048)),
                   centroid_intermediate_top_k=int(cfg.get("centroid_intermediate_top_k", 32)))


def is_assistant_config(cfg: Mapping[str, Any]) -> bool:
    archs = [str(a) for a in cfg.get("architectures") or []]
    return (str(cfg.get("model_type", "")).lower() == ASSISTANT_MODEL_TYPE
            or "Gemma4AssistantForCausalLM" in archs)


def is_assistant_dir(path: str | Path) -> bool:
    config = Path(path) / "config.json"
    return config.is_file() and is_assistant_config(json.loads(config.read_text()))


class AssistantAttention(nn.Module):
    """q projection, q norm, RoPE; keys and values are the target's (scale 1, as Gemma 4)."""

    def __init__(self, text: Gemma4Config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = text.base
        self.num_heads = base.num_attention_heads
        self.head_dim, self.num_kv_heads = text.layer_shape(layer_idx)
        self.sliding_window = base.layer_sliding_window(layer_idx)
        self.backend = backend
        h, d = base.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=base.attention_bias)
        self.q_norm = Gemma4RMSNorm(d, base.rms_norm_eps)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=base.attention_bias)

    def forward(self, hidden: torch.Tensor, cos_sin: CosSin, cache: LayerKVCache,
                metadata: AttentionMetadata) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        n = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(n, self.num_heads, self.head_dim))
        q = apply_rope(q, *cos_sin)
        o = self.backend.forward(q, cache.key, cache.value, metadata, 1.0, self.sliding_window)
        return self.o_proj(o.reshape(n, self.num_heads * self.head_dim))


class AssistantLayer(nn.Module):
    """A Gemma 4 decoder layer without K/V projections (HF parameter names)."""

    def __init__(self, text: Gemma4Config, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        base = text.base
        h, eps = base.hidden_size, base.rms_norm_eps
        self.kind = KINDS[int(text.is_global(layer_idx))]
        self.self_attn = AssistantAttention(text, layer_idx, backend)
        self.mlp = GemmaMLP(h, base.intermediate_size)
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, hidden, cos_sin, cache, metadata):
        h = hidden + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(hidden), cos_sin, cache, metadata))
        h = h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        return h * self.layer_scalar


class MaskedEmbedder(nn.Module):
    """The centroid-masked LM head (transformers' `Gemma4AssistantMaskedEmbedder`)."""

    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        base = config.text.base
        self.top_k = config.centroid_intermediate_top_k
        self.num_centroids = config.num_centroids
        self.vocab_size = base.vocab_size
        self.per_centroid = base.vocab_size // config.num_centroids
        self.centroids = nn.Linear(base.hidden_size, config.num_centroids, bias=False)
        self.register_buffer("token_ordering", torch.arange(base.vocab_size, dtype=torch.long))

    def scored(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, hidden] -> (token ids [n, top_k * per_centroid], their logits, same shape)."""
        n = hidden.shape[0]
        top = torch.topk(self.centroids(hidden), k=self.top_k, dim=-1).indices  # [n, top_k]
        ids = self.token_ordering.long().view(self.num_centroids, self.per_centroid)[top]
        ids = ids.reshape(n, -1)
        weights = lm_head_weight[ids.reshape(-1)].view(n, ids.shape[1], -1)  # [n, m, hidden]
        logits = (hidden.unsqueeze(-2) @ weights.transpose(-1, -2)).squeeze(-2)  # [n, m]
        return ids, logits

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab]; unscored tokens get (min scored logit - 1)."""
        ids, logits = self.scored(hidden, lm_head_weight)
        out = torch.full((hidden.shape[0], self.vocab_size), logits.min().item() - 1.0,
                         dtype=logits.dtype, device=logits.device)
        return out.scatter_(-1, ids, logits)


class Gemma4Assistant(nn.Module):
    """The assistant's weights and one draft step; `Gemma4AssistantProposer` drives it."""

    speculative_method = "mtp"  # the flag a user passes (`--speculative-method mtp`)
    num_kv_layers = 0  # no draft KV: nothing in the cache budget, no drafter cache
    target_aux_layers: tuple[int, ...] = ()

    def __init__(self, config: AssistantConfig, target: nn.Module,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        text, base = config.text, config.text.base
        target_hidden = target.config.hidden_size
        if config.backbone_hidden_size != target_hidden:
            raise ValueError(f"assistant backbone_hidden_size {config.backbone_hidden_size} != "
                             f"the target's hidden_size {target_hidden}")
        if base.vocab_size != target.config.vocab_size:
            raise ValueError(f"assistant vocab_size {base.vocab_size} != the target's "
                             f"{target.config.vocab_size}")
        self.config = config
        self.target = SharedTarget.of(target)  # its token embedding (not registered)
        self.target_layers = target_kv_layers(target)
        backend = backend or get_attention_backend()
        self.rotary = {"sliding_attention": RotaryEmbedding(
            base.head_dim, text.rope_local_theta, None, base.max_position_embeddings)}
        full = RotaryEmbedding(text.global_head_dim, base.rope_theta, None,
                               base.max_position_embeddings)
        if text.global_rope_proportional:
            full.inv_freq = _proportional_inv_freq(text.global_head_dim, base.rope_theta,
                                                   text.global_partial_rotary_factor,
                                                   text.global_rope_factor)
        self.rotary["full_attention"] = full
        b = config.backbone_hidden_size
        self.pre_projection = nn.Linear(2 * b, base.hidden_size, bias=False)
        self.post_projection = nn.Linear(base.hidden_size, b, bias=False)
        self.layers = nn.ModuleList(AssistantLayer(text, i, backend)
                                    for i in range(base.num_hidden_layers))
        self.norm = Gemma4RMSNorm(base.hidden_size, base.rms_norm_eps)
        self.lm_head = nn.Linear(base.hidden_size, base.vocab_size, bias=False)
        self.masked_embedding = MaskedEmbedder(config) if config.use_ordered_embeddings else None
        missing = {layer.kind for layer in self.layers} - set(self.target_layers)
        if missing:
            raise ValueError(f"the assistant has {sorted(missing)} layers; the target has no "
                             "KV-owning layer of that type")

    @property
    def policy(self) -> DrafterPolicy:
        return drafter_policy("gemma4_mtp")

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_projection.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.pre_projection.weight.device

    def make_proposer(self, num_spec_tokens: int, num_blocks: int, block_size: int,
                      clock: Any = None):
        """The assistant's proposer: no KV of its own (it reads the target's), so the block
        count, block size and clock of a KV-owning drafter's proposer do not apply."""
        from speckv.drafters.gemma4_assistant_proposer import Gemma4AssistantProposer

        return Gemma4AssistantProposer(self, num_spec_tokens)

    # ---- one step --------------------------------------------------------------------------
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's (scaled) token embedding, [n] -> [n, backbone_hidden]."""
        return self.target.embed(token_ids).to(self.dtype)

    def step(
        self,
        token_embeds: torch.Tensor,  # [n, backbone_hidden] target embedding of the last token
        hidden: torch.Tensor,  # [n, backbone_hidden] target hidden / previous post_projection
        positions: torch.Tensor,  # [n] int64 query positions (n-1 of each request)
        kv: TargetKV,
        metadata: Mapping[str, AttentionMetadata],  # kind -> one query per request
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (y [n, hidden] after the final norm, post_projection(y) [n, backbone_hidden])."""
        x = self.pre_projection(torch.cat((token_embeds, hidden.to(self.dtype)), dim=-1))
        cos_sin = {kind: rotary.cos_sin(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for layer in self.layers:
            x = layer(x, cos_sin[layer.kind], kv.caches[layer.kind], metadata[layer.kind])
        y = self.norm(x)
        return y, self.post_projection(y)

    def compute_logits(self, y: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32 (the masked head when the config has one)."""
        if self.masked_embedding is not None:
            return self.masked_embedding(y, self.lm_head.weight).float()
        return self.lm_head(y).float()

    def draft_token_ids(self, y: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n] int64 greedy drafts (the masked head scores its tokens only)."""
        if self.masked_embedding is not None:
            ids, logits = self.masked_embedding.scored(y, self.lm_head.weight)
            return ids.gather(-1, logits.argmax(-1, keepdim=True)).squeeze(-1)
        return self.lm_head(y).argmax(-1)


def target_kv_layers(target: nn.Module) -> dict[str, int]:
    """kind -> the last KV-owning target layer of that kind (transformers' "store" layer: its
    `shared_kv_states`)."""
    base: ModelConfig = target.config
    gemma = getattr(target, "gemma", None)
    owns = (lambda i: gemma.kv_source(i) == i) if isinstance(gemma, Gemma4Config) else (
        lambda i: True)
    out: dict[str, int] = {}
    for i in range(base.num_hidden_layers):
        if owns(i):
            out[KINDS[int(base.layer_sliding_window(i) is None)]] = i
    return out


# ---- weights ---------------------------------------------------------------------------------
def _hf_name(ours: str) -> str:
    if ours.startswith("layers.") or ours.startswith("norm."):
        return "model." + ours
    return ours


def build_assistant(config: AssistantConfig, target: nn.Module,
                    tensors: Mapping[str, torch.Tensor], where: str = "the assistant"
                    ) -> Gemma4Assistant:
    """The assistant from (HF name -> tensor); the LM head falls back to the tied
    `model.embed_tokens.weight` (the assistant's own table: only its LM head reads it)."""
    assistant = Gemma4Assistant(config, target)
    state = {}
    for ours, expected in assistant.state_dict().items():
        name = _hf_name(ours)
        tensor = tensors.get(name)
        if tensor is None and ours == "lm_head.weight":
            tensor = tensors.get("model.embed_tokens.weight")
        if tensor is None and ours.endswith("layer_scalar"):
            tensor = torch.ones(1)
        if tensor is None:
            raise ValueError(f"{where}: missing tensor {name}")
        if tuple(tensor.shape) != tuple(expected.shape):
            raise ValueError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected.shape)}")
        state[ours] = tensor
    assistant.load_state_dict(state, strict=True)
    assistant.requires_grad_(False)
    return assistant.to(device=target.device, dtype=target.dtype).eval()


def load_gemma4_assistant(path: str | Path, target: nn.Module) -> Gemma4Assistant:
    """A `Gemma4AssistantForCausalLM` directory (config.json + *.safetensors) for `target`."""
    from safetensors import safe_open

    from speckv.models.common.weights import safetensors_files

    d = Path(path)
    config = AssistantConfig.from_hf_config(json.loads((d / "config.json").read_text()))
    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(d):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                tensors[name] = st.get_tensor(name)
    return build_assistant(config, target, tensors, str(d))


def assistant_config_for(target: nn.Module, num_layers: int = 2, hidden_size: int | None = None,
                         use_ordered_embeddings: bool = False, num_centroids: int = 8,
                         centroid_intermediate_top_k: int = 2) -> AssistantConfig:
    """A small assistant shape for `target` (Gemma 3 or 4): the target's head sizes, KV heads,
    RoPE and window; layers alternate sliding / full, ending with full."""
    base: ModelConfig = target.config
    if base.rope_scaling is not None:
        raise ValueError("a random assistant needs a target without RoPE scaling")
    gemma = target.gemma
    hidden = hidden_size or base.hidden_size
    kinds = [KINDS[(num_layers - 1 - i) % 2 == 0] for i in range(num_layers)]
    text_base = replace(base, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=num_layers, layer_types=tuple(kinds),
                        architecture="gemma4", tie_word_embeddings=True)
    if isinstance(gemma, Gemma4Config):
        text = replace(gemma, base=text_base, hidden_size_per_layer_input=0,
                       vocab_size_per_layer_input=0, num_kv_shared_layers=0,
                       use_double_wide_mlp=False, final_logit_softcapping=None)
    else:  # Gemma 3: one head size, default RoPE on both layer kinds
        text = Gemma4Config(base=text_base, global_head_dim=base.head_dim or 0,
                            global_kv_heads=base.num_key_value_heads,
                            rope_local_theta=gemma.rope_local_theta,
                            global_rope_proportional=False)
    return AssistantConfig(text, base.hidden_size, use_ordered_embeddings, num_centroids,
                           centroid_intermediate_top_k)


def random_gemma4_assistant(target: nn.Module, seed: int = 0, init_std: float = 0.2,
                            **shape: Any) -> Gemma4Assistant:
    """A seeded random-init assistant on `target` (tests, `hybrid-swa`, the tiny Gemma 4)."""
    config = assistant_config_for(target, **shape)
    assistant = Gemma4Assistant(config, target)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in assistant.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.1)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
        if assistant.masked_embedding is not None:
            assistant.masked_embedding.token_ordering.copy_(
                torch.randperm(config.text.base.vocab_size, generator=gen))
    assistant.requires_grad_(False)
    return assistant.to(device=target.device, dtype=target.dtype).eval()


def hf_assistant_config(config: AssistantConfig) -> dict[str, Any]:
    """A `Gemma4AssistantConfig`-shaped dict of `config` (save / tests)."""
    text, base = config.text, config.text.base
    full_rope: dict[str, Any] = {"rope_type": "proportional" if text.global_rope_proportional
                                 else "default", "rope_theta": base.rope_theta}
    if text.global_rope_proportional:
        full_rope.update(partial_rotary_factor=text.global_partial_rotary_factor,
                         factor=text.global_rope_factor)
    return {
        "architectures": ["Gemma4AssistantForCausalLM"], "model_type": ASSISTANT_MODEL_TYPE,
        "backbone_hidden_size": config.backbone_hidden_size,
        "use_ordered_embeddings": config.use_ordered_embeddings,
        "num_centroids": config.num_centroids,
        "centroid_intermediate_top_k": config.centroid_intermediate_top_k,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "gemma4_text", "vocab_size": base.vocab_size,
            "hidden_size": base.hidden_size, "intermediate_size": base.intermediate_size,
            "num_hidden_layers": base.num_hidden_layers,
            "num_attention_heads": base.num_attention_heads,
            "num_key_value_heads": base.num_key_value_heads, "head_dim": base.head_dim,
            "global_head_dim": text.global_head_dim,
            "num_global_key_value_heads": text.global_kv_heads,
            "attention_k_eq_v": text.global_kv_heads != base.num_key_value_heads,
            "sliding_window": base.sliding_window, "layer_types": list(base.layer_types or ()),
            "rms_norm_eps": base.rms_norm_eps,
            "max_position_embeddings": base.max_position_embeddings,
            "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
            "num_kv_shared_layers": base.num_hidden_layers,
            "rope_parameters": {"full_attention": full_rope, "sliding_attention": {
                "rope_type": "default", "rope_theta": text.rope_local_theta}},
        },
    }


def save_gemma4_assistant(path: str | Path, assistant: Gemma4Assistant) -> None:
    """config.json + model.safetensors in the transformers layout (tests, demos)."""
    from safetensors.torch import save_file

    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    state = {_hf_name(k): v.contiguous() for k, v in assistant.state_dict().items()}
    state["model.embed_tokens.weight"] = state.pop("lm_head.weight")
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(hf_assistant_config(assistant.config), indent=1))
