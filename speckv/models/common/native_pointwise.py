"""speckv's one-pass element-wise steps of a decoder layer: SiLU(gate) * up, RMSNorm, RoPE.

Owns the calls into `_pointwise.c` (built at install like the hash chain; absent, torch's
element-wise ops run) and the rule for when they apply: contiguous fp32 CPU tensors with no
gradient wanted. Eager torch spends 2-6 calls on each step (SiLU then a product; square, mean,
add, rsqrt and two products; a concatenation, a negation and three more for RoPE). On
SmolLM2-135M, 1 thread, they took ~0.7 s of a 5.4 s prefill of 8 x 256 tokens, and ~10 ms of
a ~55 ms decode step of 8 requests, mostly in calls.

Each function returns None where it does not apply, and the caller runs torch's ops: whether it
applies depends only on dtype, device, layout and autograd, never on the batch, and each row's
result only on that row, so a cold run and a hit compute the same positions the same way.
"""

from __future__ import annotations

import torch

try:
    from speckv.models.common import _pointwise
except ImportError:  # built without a C compiler: torch's ops
    _pointwise = None


def pointwise_available() -> bool:
    return _pointwise is not None


def _applies(*tensors: torch.Tensor) -> bool:
    return (_pointwise is not None
            and all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                    for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, in_place: bool = False
             ) -> torch.Tensor | None:
    """SiLU(gate) * up (same shapes), written over `gate` with `in_place` (a temporary the
    caller no longer needs: a prefill's activations are megabytes, and a fresh output's
    first touch costs as much as the pass), or None where the kernel does not apply."""
    if gate.shape != up.shape or not _applies(gate, up):
        return None
    out = gate if in_place else torch.empty_like(gate)
    _pointwise.silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel())
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2, -1) + eps) over x [..., dim], weight [dim]; or None."""
    if x.dim() == 0 or weight.dim() != 1 or x.shape[-1] != weight.shape[0] \
            or not _applies(x, weight):
        return None
    out = torch.empty_like(x)
    dim = x.shape[-1]
    _pointwise.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // dim,
                        dim, float(eps))
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin for x [tokens, heads, head_dim] and cos, sin
    [tokens, 1, head_dim] (one row per token); or None."""
    if (x.dim() != 3 or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape
            or x.shape[2] % 2 or not _applies(x, cos, sin)):
        return None
    out = torch.empty_like(x)
    tokens, heads, dim = x.shape
    _pointwise.rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), tokens,
                    heads, dim)
    return out
