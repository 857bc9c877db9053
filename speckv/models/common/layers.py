"""Small building blocks of the Llama family: Linear, RMSNorm and the SwiGLU MLP.

Numerics follow transformers exactly (RMSNorm statistics in fp32, weight applied in the input
dtype) so fp32 logits match HF to ~1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common import native_pointwise
from speckv.models.common.compact_weight import CompactWeight

try:
    from speckv.models.common import _rowdot
except ImportError:  # built without a C compiler (see native_linear.py)
    _rowdot = None


def _native_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether speckv's kernels may compute x @ weight^T (+ bias): a contiguous 2-D fp32 CPU
    input of the weight's width, a contiguous fp32 bias, and no gradient wanted."""
    return (x.dim() == 2 and x.shape[1] == weight.shape[1] and x.dtype == torch.float32
            and x.device.type == "cpu" and x.is_contiguous()
            and (bias is None or (bias.is_contiguous() and bias.dtype == torch.float32))
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad
                          or (bias is not None and bias.requires_grad))))


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) that computes fp32 CPU inputs in the
    forms a loader measured fastest on this machine, tried in this order:

        up to compact_max_rows rows           speckv's kernel on the weight as the checkpoint
                                              holds it: GGUF blocks or fp16
                                              (`speckv.models.common.compact_linear`)
        panel_min_rows..panel_max_rows rows   speckv's kernel on panel-packed weights
                                              (`speckv.models.common.panel_linear`)
        up to native_max_rows rows            speckv's kernel on the weight as it is
                                              (`speckv.models.common.native_linear`)
        packed_min_rows rows or more          oneDNN with its weight packed once
                                              (`speckv.models.common.packed_linear`)
        rows in transposed_rows               (W @ x^T)^T (`speckv.models.common.small_rows`)
        anything else                         F.linear

    All stay off (the plain form) until a loader measures. The native and packed forms step
    aside where autograd needs the product, the packed ones (panels, oneDNN) also where the
    weight changed after packing (training, a test that edits weights); the compact one also."""

    # (the weight it widens to, that weight's version then, the weight held narrow)
    compact: tuple[torch.Tensor, int, CompactWeight] | None = None
    compact_max_rows = 0
    native_max_rows = 0
    # (the weight it was packed from, that weight's version then, its panels)
    panel: tuple[torch.Tensor, int, torch.Tensor] | None = None
    panel_min_rows = 0
    panel_max_rows = 0
    transposed_rows: frozenset[int] = frozenset()
    # (the weight it was packed from, that weight's version then, the oneDNN-packed weight)
    packed: tuple[torch.Tensor, int, torch.Tensor] | None = None
    packed_min_rows = 2  # inputs of fewer rows keep the other forms (measured per machine)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out] (any leading dims)
        weight, bias = self.weight, self.bias
        rows = x.shape[0] if x.dim() == 2 else 0
        compact = self.compact
        if (compact is not None and 0 < rows <= self.compact_max_rows and compact[0] is weight
                and compact[1] == weight._version and _native_input(x, weight, bias)):
            return compact[2].product(x, bias)  # [n, out]
        panel = self.panel
        if (panel is not None and self.panel_min_rows <= rows <= self.panel_max_rows
                and panel[0] is weight and panel[1] == weight._version
                and _native_input(x, weight, bias)):
            y = torch.empty((rows, weight.shape[0]), dtype=torch.float32)  # [n, out]
            _rowdot.panel_dot(x.data_ptr(), panel[2].data_ptr(),
                              0 if bias is None else bias.data_ptr(), y.data_ptr(),
                              rows, x.shape[1], weight.shape[0])
            return y
        if (0 < rows <= self.native_max_rows and weight.dtype == torch.float32
                and weight.device.type == "cpu" and weight.is_contiguous()
                and _native_input(x, weight, bias)):
            y = torch.empty((rows, weight.shape[0]), dtype=torch.float32)  # [n, out]
            _rowdot.rowdot(x.data_ptr(), weight.data_ptr(),
                           0 if bias is None else bias.data_ptr(), y.data_ptr(),
                           rows, x.shape[1], weight.shape[0])
            return y
        packed = self.packed
        if (packed is not None and packed[0] is weight and packed[1] == weight._version
                and x.device.type == "cpu" and x.dtype == torch.float32
                and x.numel() >= self.packed_min_rows * x.shape[-1]
                and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
            return torch.ops.mkldnn._linear_pointwise(x, packed[2], bias, "none", [], "")
        if (rows in self.transposed_rows and x.device.type == "cpu"
                and x.dtype == torch.float32 and weight.dtype == torch.float32):
            y = torch.mm(weight, x.t()).t().contiguous()  # [n, out]
            return y if bias is None else y + bias
        return F.linear(x, weight, bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] -> [..., dim]
        fused = native_pointwise.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
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
        gate, up = self.gate_proj(x), self.up_proj(x)
        fused = native_pointwise.silu_mul(gate, up, in_place=True)  # gate: ours, unused after
        return self.down_proj(F.silu(gate) * up if fused is None else fused)
