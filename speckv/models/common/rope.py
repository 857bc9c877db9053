"""Rotary position embeddings: inverse frequencies (+ HF scaling variants) and their application.

Owns the numerics of RoPE in the Hugging Face "rotate_half" layout (first half / second half of
each head are the two rotation coordinates). Scaling variants follow transformers'
`modeling_rope_utils`: linear, dynamic (static NTK at max_position_embeddings * factor, as vLLM
does, because HF's stateful per-forward recomputation has no paged equivalent), llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from speckv.models.common import native_pointwise


def rope_inv_freq(
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, attention_factor applied to cos/sin)."""
    dim = head_dim
    base_exp = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim  # [dim // 2]
    pos_freqs = theta**base_exp  # [dim // 2]
    inv_freq = 1.0 / pos_freqs
    if scaling is None:
        return inv_freq, 1.0
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        factor = float(scaling["factor"])
        seq_len = max_position_embeddings * factor
        base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**base_exp), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(dim, theta, pos_freqs, scaling, max_position_embeddings)
    raise ValueError(f"rope_scaling.rope_type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low_freq_factor = float(s["low_freq_factor"])
    high_freq_factor = float(s["high_freq_factor"])
    old_context_len = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the middle band blended smoothly.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    dim: int,
    base: float,
    pos_freqs: torch.Tensor,  # [dim // 2] base ** (2i / dim)
    s: dict[str, Any],
    max_position_embeddings: int,
) -> tuple[torch.Tensor, float]:
    omax = int(s.get("original_max_position_embeddings") or max_position_embeddings)
    factor = s.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / omax

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(omax / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv_freq = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k given absolute positions (one position per token)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_position_embeddings: int,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(
            head_dim, theta, scaling, max_position_embeddings
        )
        self.head_dim = head_dim
        self.attention_factor = attention_factor
        # A plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies.
        self.inv_freq = inv_freq  # [head_dim // 2] fp32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [num_tokens] -> cos, sin each [num_tokens, 1, head_dim] in `dtype`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [n, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, head_dim]
        cos = (emb.cos() * self.attention_factor).to(dtype)[:, None, :]
        sin = (emb.sin() * self.attention_factor).to(dtype)[:, None, :]
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin [num_tokens, 1, head_dim]."""
    fused = native_pointwise.rope(x, cos, sin)
    if fused is not None:
        return fused
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
