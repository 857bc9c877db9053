"""Small building blocks of the Llama family: Linear, RMSNorm and the SwiGLU MLP.

Numerics follow transformers exactly (RMSNorm statistics in fp32, weight applied in the input
dtype) so fp32 logits match HF to ~1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# fp32 CPU GEMMs of 2 or 3 rows run slower than of 4 in torch's kernels here (a whole
# SmolLM2-135M step, 1 thread: 1 row 62 ms, 2 rows 98, 3 rows 121, 4 rows 89), while
# W @ x^T for 2..4 rows takes 76 / 88 / 85 ms. Speculative verification steps (1 + k rows)
# and batch-2..4 decode steps are exactly these shapes.
_SMALL_ROWS = range(2, 5)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) that computes 2..4-row fp32 CPU
    inputs as (W @ x^T)^T, the faster kernel for those shapes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] (any leading dims)
        if (x.dim() == 2 and x.shape[0] in _SMALL_ROWS and x.device.type == "cpu"
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
