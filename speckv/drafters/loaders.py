"""Drafter weights on disk: public tensor names <-> our modules, safetensors only.

Owns loading and saving every drafter format from / to a local Hugging Face-style directory
(config.json + *.safetensors, sharded via model.safetensors.index.json; .bin pickles are never
read) and random initialisation for tests. Formats (tensor names of the public releases):

| format        | tensors                                                                      |
|---------------|------------------------------------------------------------------------------|
| eagle         | fc.weight, fc.bias?, layers.0.{self_attn,mlp,post_attention_layernorm}.*,    |
|               | layers.0.input_layernorm.weight? (absent in EAGLE-1), embed_tokens.weight?   |
| eagle3        | fc.weight, midlayer.{self_attn,mlp,input_layernorm,hidden_norm,              |
|               | post_attention_layernorm}.*, norm.weight, lm_head.weight, d2t, t2d           |
| mtp_deepseek  | model.layers.{N+j}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head?,  |
|               | self_attn.*,mlp.*,input_layernorm,post_attention_layernorm} (N = target      |
|               | layers; config num_nextn_predict_layers = k); other target tensors ignored   |
| mtp_qwen      | mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}.weight,               |
|               | mtp.layers.{j}.* (config mtp_num_hidden_layers = k)                          |

Embeddings (and the EAGLE / MTP LM head) are always the target's: shipped copies are ignored.
The decoder layers are Llama layers; checkpoints whose MTP layers are MoE / MLA / gated
attention (the real DeepSeek-V3, Qwen3-Next) share the names but not the shapes and are refused
with a shape error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speckv.attention import resolve_dtype
from speckv.drafters.base import Drafter
from speckv.drafters.eagle import EagleDrafter
from speckv.drafters.eagle3 import Eagle3Drafter, vllm_aux_to_ours
from speckv.drafters.layers import SharedTarget
from speckv.drafters.mtp import MTPDrafter
from speckv.models.base import TargetModel
from speckv.models.common.weights import safetensors_files

METHODS: tuple[str, ...] = ("eagle", "eagle3", "mtp")  # SpeculativeConfig.method
MTP_LAYOUTS: tuple[str, ...] = ("deepseek", "qwen")  # where an MTP checkpoint keeps its tensors
# The loader's own key per (method, layout): the tensor-name table and the config.json tag.
FORMATS: tuple[str, ...] = ("eagle", "eagle3", "mtp_deepseek", "mtp_qwen")


def format_key(method: str, layout: str | None = None) -> str:
    """The loader's key of a drafter method (+ MTP checkpoint layout, default deepseek)."""
    if method not in METHODS:
        raise ValueError(f"drafter method must be one of {METHODS}, got {method!r}")
    if method != "mtp":
        if layout is not None:
            raise ValueError(f"{method} has one checkpoint layout; got layout={layout!r}")
        return method
    layout = layout or "deepseek"
    if layout not in MTP_LAYOUTS:
        raise ValueError(f"mtp layout must be one of {MTP_LAYOUTS}, got {layout!r}")
    return f"mtp_{layout}"


def _method_and_layout(fmt: str) -> tuple[str, str | None]:
    method, _, layout = fmt.partition("_")
    return method, layout or None


# ---- name maps: our state_dict name -> public tensor name ------------------------------------


def _sub(prefix_ours: str, prefix_hf: str) -> Callable[[str], str | None]:
    def f(name: str) -> str | None:
        return prefix_hf + name[len(prefix_ours) :] if name.startswith(prefix_ours) else None

    return f


def hf_name(drafter: Drafter, fmt: str, ours: str) -> str:
    """The public tensor name of our parameter/buffer `ours` in format `fmt`."""
    rules: list[Callable[[str], str | None]]
    if fmt == "eagle":
        rules = [_sub("modules_chain.0.fc.", "fc."), _sub("modules_chain.0.layer.", "layers.0.")]
    elif fmt == "eagle3":
        rules = [
            _sub("fc.", "fc."),
            _sub("modules_chain.0.midlayer.", "midlayer."),
            _sub("modules_chain.0.norm.", "norm."),
            _sub("modules_chain.0.lm_head.", "lm_head."),
            _sub("modules_chain.0.d2t", "d2t"),
            _sub("modules_chain.0.t2d", "t2d"),
        ]
    elif fmt == "mtp_deepseek":
        n = _target_layers(drafter)
        rules = []
        for j in range(len(drafter.modules_chain)):
            pre, hf = f"modules_chain.{j}.", f"model.layers.{n + j}."
            rules += [
                _sub(pre + "proj.enorm.", hf + "enorm."),
                _sub(pre + "proj.hnorm.", hf + "hnorm."),
                _sub(pre + "proj.eh_proj.", hf + "eh_proj."),
                _sub(pre + "proj.norm.", hf + "shared_head.norm."),
                _sub(pre + "head.", hf + "shared_head.head."),
                _sub(pre + "layer.", hf),
            ]
    elif fmt == "mtp_qwen":
        rules = []
        for j in range(len(drafter.modules_chain)):
            pre = f"modules_chain.{j}."
            rules += [
                _sub(pre + "proj.enorm.", "mtp.pre_fc_norm_embedding."),
                _sub(pre + "proj.hnorm.", "mtp.pre_fc_norm_hidden."),
                _sub(pre + "proj.eh_proj.", "mtp.fc."),
                _sub(pre + "proj.norm.", "mtp.norm."),
                _sub(pre + "layer.", f"mtp.layers.{j}."),
            ]
    else:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    for rule in rules:
        out = rule(ours)
        if out is not None:
            return out
    raise ValueError(f"no {fmt} name for parameter {ours!r}")


def _target_layers(drafter: Drafter) -> int:
    if not isinstance(drafter, MTPDrafter):
        raise ValueError(
            f"the mtp_deepseek layout needs an MTPDrafter, got {type(drafter).__name__}"
        )
    return drafter.target_num_layers


# ---- config.json ------------------------------------------------------------------------------


def _config_json(drafter: Drafter, fmt: str) -> dict[str, Any]:
    cfg = drafter.config.to_hf_config()  # type: ignore[attr-defined]
    cfg["speckv_drafter_format"] = fmt
    if fmt == "eagle":
        cfg["architectures"] = ["EagleLlamaForCausalLM"]
        assert isinstance(drafter, EagleDrafter)
        cfg["bias"] = drafter.module.fc.bias is not None
    elif fmt == "eagle3":
        assert isinstance(drafter, Eagle3Drafter)
        cfg["architectures"] = ["LlamaForCausalLMEagle3"]
        cfg["draft_vocab_size"] = drafter.draft_vocab_size
        # Stored in vLLM's convention (layer INPUT index).
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in drafter.aux_layers]
        }
    else:
        n = _target_layers(drafter)
        cfg["num_hidden_layers"] = n
        cfg["layer_types"] = ["full_attention"] * n
        key = "num_nextn_predict_layers" if fmt == "mtp_deepseek" else "mtp_num_hidden_layers"
        cfg[key] = len(drafter.modules_chain)
    return cfg


def detect_format(path: str | Path) -> tuple[str, str | None]:
    """(method, MTP layout or None) of a drafter directory."""
    from speckv.drafters.gemma4_assistant import is_assistant_dir

    if is_assistant_dir(path):  # Gemma4AssistantForCausalLM: an MTP drafter of its own kind
        return "mtp", None
    return _method_and_layout(_detect_key(path))


def _detect_key(path: str | Path) -> str:
    """Which of FORMATS a directory holds (speckv's own tag, else the tensor names)."""
    d = Path(path)
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("speckv_drafter_format") in FORMATS:
        return str(cfg["speckv_drafter_format"])
    keys = set(_tensor_index(d))
    if any(k.startswith("midlayer.") for k in keys):
        return "eagle3"
    if any(k.startswith("mtp.") for k in keys):
        return "mtp_qwen"
    if any(k.endswith(".eh_proj.weight") for k in keys):
        return "mtp_deepseek"
    if "fc.weight" in keys:
        return "eagle"
    raise ValueError(f"{d}: not an EAGLE / EAGLE3 / MTP checkpoint")


# ---- safetensors ------------------------------------------------------------------------------


def _tensor_index(d: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for f in safetensors_files(d):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a dict)
                out[name] = f
    return out


def _read(index: dict[str, Path], names: set[str]) -> dict[str, torch.Tensor]:
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(index[n], []).append(n)
    out: dict[str, torch.Tensor] = {}
    for f, ns in by_file.items():
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for n in ns:
                out[n] = st.get_tensor(n)
    return out


# ---- public API -------------------------------------------------------------------------------


def save_drafter(
    drafter: Drafter, path: str | Path, layout: str | None = None,
    dtype: torch.dtype | str | None = None,
) -> Path:
    """Write config.json + model.safetensors under the public names of the drafter's method
    (and, for MTP, the checkpoint `layout`: deepseek or qwen)."""
    fmt = format_key(drafter.policy.name, layout)
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    torch_dtype = resolve_dtype(dtype) if dtype is not None else drafter.dtype
    state: dict[str, torch.Tensor] = {}
    for ours, t in drafter.state_dict().items():
        name = hf_name(drafter, fmt, ours)
        if name in state:
            continue  # shared projection in the Qwen layout: stored once
        if t.is_floating_point():
            t = t.to(torch_dtype)
        state[name] = t.detach().cpu().contiguous()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = _config_json(drafter, fmt)
    cfg["torch_dtype"] = str(torch_dtype).removeprefix("torch.")
    (d / "config.json").write_text(json.dumps(cfg, indent=1))
    return d


def build_drafter(method: str, target: TargetModel, *, layout: str | None = None,
                  **kwargs: Any) -> Drafter:
    """An (uninitialised) drafter of `method` (eagle, eagle3, mtp; MTP in checkpoint `layout`)
    on `target`'s config, fp32 on CPU."""
    return _build(format_key(method, layout), target, **kwargs)


def _build(fmt: str, target: TargetModel, **kwargs: Any) -> Drafter:
    shared = SharedTarget.of(target)
    if fmt == "eagle":
        return EagleDrafter(target.config, shared, **kwargs)
    if fmt == "eagle3":
        return Eagle3Drafter(target.config, shared, **kwargs)
    if fmt in ("mtp_deepseek", "mtp_qwen"):
        kwargs.setdefault("shared_projection", fmt == "mtp_qwen")
        return MTPDrafter(target.config, shared, **kwargs)
    raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")


def random_drafter(
    method: str,
    target: TargetModel,
    init_std: float = 0.02,
    seed: int | None = None,
    *,
    layout: str | None = None,
    **kwargs: Any,
) -> Drafter:
    """Random init like `LlamaForCausalLM.from_config` (normal weights, unit norms, zero bias)."""
    drafter = build_drafter(method, target, layout=layout, **kwargs)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    return _finish(drafter, target.dtype, target.device)


def load_drafter(
    path: str | Path,
    target: TargetModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Drafter:
    """Load any drafter directory for `target` (dtype/device default to the target's)."""
    d = Path(path)
    fmt = _detect_key(d)
    cfg = json.loads((d / "config.json").read_text())
    hidden = target.config.hidden_size
    if int(cfg.get("hidden_size", hidden)) != hidden:
        raise ValueError(f"{fmt} drafter hidden_size {cfg['hidden_size']} != target's {hidden}")
    index = _tensor_index(d)
    keys = set(index)
    kwargs: dict[str, Any] = {}
    if fmt == "eagle":
        kwargs["input_layernorm"] = "layers.0.input_layernorm.weight" in keys
        kwargs["fc_bias"] = "fc.bias" in keys
    elif fmt == "eagle3":
        kwargs["draft_vocab_size"] = int(
            cfg.get("draft_vocab_size") or cfg.get("vocab_size") or target.config.vocab_size
        )
        ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if ids:
            kwargs["aux_layers"] = vllm_aux_to_ours(ids)
    elif fmt == "mtp_deepseek":
        kwargs["num_modules"] = int(cfg.get("num_nextn_predict_layers") or 1)
        if int(cfg.get("num_hidden_layers", -1)) != target.config.num_hidden_layers:
            raise ValueError("mtp_deepseek: config num_hidden_layers differs from the target's")
    elif fmt == "mtp_qwen":
        kwargs["num_modules"] = int(cfg.get("mtp_num_hidden_layers") or 1)
    drafter = _build(fmt, target, **kwargs)
    if fmt == "mtp_deepseek":
        n = target.config.num_hidden_layers
        for j, m in enumerate(drafter.modules_chain):
            if f"model.layers.{n + j}.shared_head.head.weight" in keys:
                m.head = torch.nn.Linear(hidden, target.config.vocab_size, bias=False)
    wanted = {ours: hf_name(drafter, fmt, ours) for ours in drafter.state_dict()}
    missing = sorted({h for h in wanted.values() if h not in keys})
    if missing:
        raise ValueError(f"{d}: missing {fmt} tensors {missing[:6]}")
    tensors = _read(index, set(wanted.values()))
    state = {}
    expected = drafter.state_dict()
    for ours, name in wanted.items():
        t = tensors[name]
        if tuple(t.shape) != tuple(expected[ours].shape):
            raise ValueError(
                f"{d}: tensor {name} has shape {tuple(t.shape)}, expected "
                f"{tuple(expected[ours].shape)} (only Llama-shaped drafter layers are supported)"
            )
        state[ours] = t.to(expected[ours].dtype)
    drafter.load_state_dict(state, strict=True)
    return _finish(drafter, dtype or target.dtype, device or target.device)


def _finish(drafter: Drafter, dtype: torch.dtype | str, device: torch.device | str) -> Drafter:
    drafter.requires_grad_(False)
    return drafter.to(device=device, dtype=resolve_dtype(dtype)).eval()
