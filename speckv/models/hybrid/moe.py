"""The sparse MoE MLP of Qwen3-Next / Qwen3.5-MoE in plain PyTorch: a top-k softmax router,
per-expert SwiGLU experts and a sigmoid-gated shared expert.

Owns the numerics of `Qwen3NextSparseMoeBlock` (router probabilities in fp32, top-k, renormalised
when `norm_topk_prob`, cast back; each routed token's expert output weighted and summed in
expert order; plus sigmoid(shared_expert_gate(x)) * shared_expert(x)). Parameter names equal
the hub checkpoints' (`mlp.gate.weight`, `mlp.experts.{e}.{gate,up,down}_proj.weight`,
`mlp.shared_expert.*`, `mlp.shared_expert_gate.weight`). Experts run as a python loop over the
experts a batch routes to (fine for CPU tests and small batches; no grouped GEMM).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common.layers import SwiGLUMLP


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, hidden] -> (weights [n, k] in x's dtype, expert ids [n, k] int64)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), index


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, top_k: int, moe_intermediate_size: int,
                 shared_expert_intermediate_size: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k, norm_topk_prob)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, moe_intermediate_size)
                                     for _ in range(num_experts))
        self.shared_expert = SwiGLUMLP(hidden_size, shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, hidden]
        weights, index = self.gate(x)
        out = torch.zeros_like(x)
        for expert in index.unique().tolist():
            token, slot = torch.where(index == expert)
            y = self.experts[expert](x[token]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
