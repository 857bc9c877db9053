"""The Gated DeltaNet token mixer of Qwen3-Next / Qwen3.5 over the paged state cache.

Owns one linear-attention layer: input projections (Qwen3-Next's fused, head-grouped
`in_proj_qkvz` / `in_proj_ba`, or Qwen3.5's split `in_proj_qkv` / `in_proj_z` / `in_proj_b` /
`in_proj_a`), the short causal conv over q/k/v, the gated delta rule (kernels in
`speckv.attention.gated_delta`), the gated RMSNorm and `out_proj`. Requests are flattened on
one token axis; projections and the output run over all rows at once, the conv and the delta
rule per request segment (`StateSegment`), reading and writing states in `PagedStateCache`.
A segment is cut at its checkpoints: the delta rule restarts its chunk grid at every
alignment-unit boundary, so a cold run and a prefix hit at that boundary compute the tokens
after it with the same operations (bit-identical in fp32).
Parameter names equal transformers' (`layers.{i}.linear_attn.*` minus "model.").
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from speckv.attention.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from speckv.attention.state_cache import StatePlan, StateSegment
from speckv.models.hybrid.config import HybridConfig


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * weight * silu(gate), statistics in fp32 (Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [n, dim]
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int, state_layer: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.state_layer = state_layer  # this layer's index in the PagedStateCache
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = config.linear_key_dim
        self.value_dim = config.linear_value_dim
        self.conv_dim = config.conv_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        self.fused = config.architecture == "qwen3_next"
        h = config.hidden_size
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, bias=False,
                                groups=self.conv_dim, padding=self.conv_kernel - 1)
        if self.fused:
            self.in_proj_qkvz = nn.Linear(h, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(h, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(h, 2 * self.key_dim + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)

    def _project(self, x: torch.Tensor):
        """[n, hidden] -> mixed q|k|v [n, conv_dim], z [n, Hv, dv], b, a [n, Hv]."""
        n = x.shape[0]
        if not self.fused:
            z = self.in_proj_z(x).view(n, self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        # Qwen3-Next groups the projections per key head: [q, k, v-group, z-group] each
        ratio = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(n, self.num_k_heads, -1)
        q, k, v, z = torch.split(qkvz, [self.head_k_dim, self.head_k_dim,
                                        ratio * self.head_v_dim, ratio * self.head_v_dim], dim=2)
        b, a = torch.split(self.in_proj_ba(x).view(n, self.num_k_heads, 2 * ratio),
                           [ratio, ratio], dim=2)
        mixed = torch.cat((q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)), dim=-1)
        return (mixed, z.reshape(n, self.num_v_heads, self.head_v_dim),
                b.reshape(n, self.num_v_heads), a.reshape(n, self.num_v_heads))

    def forward(self, hidden: torch.Tensor, plan: StatePlan) -> torch.Tensor:
        """hidden [num_tokens, hidden] -> [num_tokens, hidden]; reads/writes plan.cache."""
        mixed, z, b, a = self._project(hidden)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [n, Hv]
        core = torch.empty(hidden.shape[0], self.num_v_heads, self.head_v_dim,
                           dtype=hidden.dtype, device=hidden.device)
        weight = self.conv1d.weight.squeeze(1)  # [C, K]
        # Single-token decodes run as one batch, first: each reads only its own running block
        # (written by nobody else), and a same-step hit may read the checkpoint one completes.
        singles = [i for i, seg in enumerate(plan.segments)
                   if seg.num_tokens == 1 and not seg.record]
        if len(singles) > 1:
            rows = torch.tensor([plan.segments[i].row_start for i in singles],
                                device=hidden.device)
            core[rows] = self._decode_batch([plan.segments[i] for i in singles], plan,
                                            mixed[rows], g[rows], beta[rows], weight)
        batched = set(singles) if len(singles) > 1 else set()
        for index in plan.order():
            if index in batched:
                continue
            segment = plan.segments[index]
            rows = slice(segment.row_start, segment.row_start + segment.num_tokens)
            core[rows] = self._segment(segment, index, plan, mixed[rows], g[rows], beta[rows],
                                       weight)
        out = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.view(hidden.shape[0], self.value_dim))

    def _segment(self, segment: StateSegment, index: int, plan: StatePlan, mixed: torch.Tensor,
                 g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """One request's rows: [T, Hv, dv] core output; states read/written per the segment."""
        cache, layer = plan.cache, self.state_layer
        conv_state, rec_state = cache.read(layer, segment.read_block)
        if segment.record:
            conv_out, padded = causal_conv1d(mixed, conv_state, weight)
            q, k, v = self._split(conv_out)
            out, states = recurrent_gated_delta_rule(
                q[None], k[None], v[None], g[None], beta[None],
                None if rec_state is None else rec_state[None], keep_all_states=True)
            plan.recorded.setdefault(layer, {})[index] = (padded, states[0])
            return out[0]
        cuts = [0, *(n for n, _ in segment.checkpoints if 0 < n < segment.num_tokens),
                segment.num_tokens]
        writes = dict(segment.checkpoints)
        outs = []
        conv_state = None if conv_state is None else conv_state.clone()
        rec = None if rec_state is None else rec_state[None].clone()
        for lo, hi in itertools.pairwise(cuts):
            conv_out, padded = causal_conv1d(mixed[lo:hi], conv_state, weight)
            q, k, v = self._split(conv_out)
            if hi - lo <= plan.recurrent_max_tokens:
                out, rec = recurrent_gated_delta_rule(q[None], k[None], v[None], g[None, lo:hi],
                                                      beta[None, lo:hi], rec)
            else:
                out, rec = chunk_gated_delta_rule(q[None], k[None], v[None], g[None, lo:hi],
                                                  beta[None, lo:hi], rec)
            conv_state = padded[:, padded.shape[1] - (self.conv_kernel - 1):]
            if hi in writes:
                cache.write(layer, writes[hi], conv_state, rec[0])
            outs.append(out[0])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode_batch(self, segments: list[StateSegment], plan: StatePlan, mixed: torch.Tensor,
                      g: torch.Tensor, beta: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """R one-token segments at once: mixed [R, C], g / beta [R, Hv] -> core [R, Hv, dv]."""
        cache, layer = plan.cache, self.state_layer
        kernel = self.conv_kernel
        reads = [seg.read_block for seg in segments]
        conv = torch.zeros(len(segments), self.conv_dim, kernel - 1, dtype=weight.dtype,
                           device=mixed.device)
        rec = torch.zeros(len(segments), self.num_v_heads, self.head_k_dim, self.head_v_dim,
                          dtype=torch.float32, device=mixed.device)
        have = [i for i, block in enumerate(reads) if block is not None]
        if have:
            index = torch.tensor([reads[i] for i in have], device=mixed.device)
            at = torch.tensor(have, device=mixed.device)
            conv[at] = cache.conv[layer, index].to(weight.dtype)
            rec[at] = cache.recurrent[layer, index]
        padded = torch.cat((conv, mixed.to(weight.dtype).unsqueeze(-1)), dim=-1)  # [R, C, K]
        conv_out = F.silu(F.conv1d(padded, weight.unsqueeze(1), groups=self.conv_dim))
        q, k, v = self._split(conv_out[:, :, 0].to(mixed.dtype))  # each [R, heads, dim]
        out, rec = recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None],
                                              beta[:, None], rec)
        writes = torch.tensor([seg.checkpoints[-1][1] for seg in segments], device=mixed.device)
        cache.conv[layer, writes] = padded[:, :, 1:].to(cache.conv.dtype)
        cache.recurrent[layer, writes] = rec
        return out[:, 0]

    def _split(self, conv_out: torch.Tensor):
        """[T, conv_dim] -> q, k [T, Hk, dk], v [T, Hv, dv]."""
        t = conv_out.shape[0]
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(t, self.num_k_heads, self.head_k_dim),
                k.reshape(t, self.num_k_heads, self.head_k_dim),
                v.reshape(t, self.num_v_heads, self.head_v_dim))
