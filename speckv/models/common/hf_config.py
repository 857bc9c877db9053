"""Reading and writing the fields every family's HF `config.json` shares: required keys, the
activation, the EOS ids (an int or a list), the dtype (`torch_dtype`, or `dtype` in newer
transformers). Each family's config parses its own fields on top (`from_hf_config`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def require_keys(cfg: Mapping[str, Any], names: Iterable[str]) -> None:
    """ValueError naming the first key `cfg` lacks."""
    for name in names:
        if name not in cfg:
            raise ValueError(f"{name} is missing from the HF config")


def check_silu(cfg: Mapping[str, Any]) -> None:
    """The SwiGLU families' `hidden_act` (silu / swish; default silu)."""
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act must be silu, got {act!r}")


def eos_token_ids(cfg: Mapping[str, Any], default: int | None = None) -> tuple[int, ...]:
    """`eos_token_id` as a tuple (an int, a list, or absent: `default`, None for none)."""
    eos = cfg.get("eos_token_id", default)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def eos_field(ids: tuple[int, ...]) -> int | list[int]:
    """The `eos_token_id` value HF writes: the id for one, a list otherwise."""
    return ids[0] if len(ids) == 1 else list(ids)


def torch_dtype(cfg: Mapping[str, Any]) -> str:
    """The checkpoint's dtype name (float32 when it says none)."""
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32")
