"""Small building blocks of the Llama family: Linear, RMSNorm and the SwiGLU MLP.

Numerics follow transformers exactly (RMSNorm statistics in fp32, weight applied in the input
dtype) so fp32 logits match HF to ~1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) that computes fp32 CPU inputs of
    the row counts in `transposed_rows` as (W @ x^T)^T: on some CPUs the faster kernel for the
    2..4-row steps of speculative verification and small-batch decode. Empty (the plain form)
    until a loader measures this machine (`speckv.models.common.small_rows`)."""

    transposed_rows: frozenset[int] = frozenset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] (any leading dims)
        if (x.dim() == 2 and x.shape[0] in self.transposed_rows and x.device.type == "cpu"
                and x.dtype == torch.float32 and self.weight.dtype == torch.float32):
            y = torch.mm(self.weight, x.t()).t().contiguous()  # [n, out]
            return y if self.bias is None else y + self.bias
        return F.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
