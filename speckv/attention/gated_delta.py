"""Gated delta rule kernels in plain PyTorch: the chunked form (prefill), the recurrent form
(decode, verification windows) and the short causal depthwise conv1d that feeds them.

Owns the numerics of Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), following
transformers' torch fallbacks (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn/update`) so no flash-linear-attention or causal-conv1d package is needed.
One recurrent state per (sequence, value head):

    S_t = exp(g_t) * S_{t-1}                      decay        S: [k_dim, v_dim]
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T  delta update (k, q L2-normalised)
    o_t = S_t^T q_t / sqrt(k_dim)

The chunked form computes the same thing `chunk_size` tokens at a time (a UT transform per
chunk, one sequential scan over chunks); both are fp32 inside whatever the input dtype.
Shapes: q, k [B, T, Hk, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state [B, Hv, dk, dv].
Hv must be a multiple of Hk (each q/k head serves Hv / Hk consecutive value heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), as flash-linear-attention and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _prepare(q, k, v, g, beta):
    """Expand q/k heads to the value heads, fp32, [B, H, T, d], L2-normalised, q scaled."""
    num_k_heads, num_v_heads = k.shape[2], v.shape[2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of key heads "
                         f"({num_k_heads})")
    if num_k_heads != num_v_heads:
        q = q.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        k = k.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    q, k, v, beta, g = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format)
        for x in (q, k, v, beta, g)
    )
    q = l2norm(q)
    k = l2norm(k)
    return q, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,  # [B, T, Hk, dk]
    k: torch.Tensor,  # [B, T, Hk, dk]
    v: torch.Tensor,  # [B, T, Hv, dv]
    g: torch.Tensor,  # [B, T, Hv] log decay (<= 0)
    beta: torch.Tensor,  # [B, T, Hv]
    initial_state: torch.Tensor | None = None,  # [B, Hv, dk, dv]; None: zeros
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, T, Hv, dv] in q's dtype, final state [B, Hv, dk, dv] fp32)."""
    out_dtype = q.dtype
    batch, seq_len = k.shape[0], k.shape[1]
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    num_heads, k_dim, v_dim = v.shape[1], k.shape[-1], v.shape[-1]
    q = q * k_dim**-0.5
    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    num_chunks = (seq_len + pad) // chunk_size
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (
        x.reshape(batch, num_heads, num_chunks, chunk_size, x.shape[-1])
        for x in (q, k, k_beta, v_beta)
    )
    g = g.reshape(batch, num_heads, num_chunks, chunk_size)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)  # log decay from the chunk start to each position
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut_system = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, decayed_k_beta, upper=False, unitriangular=True
    )
    if initial_state is None:
        state = torch.zeros(batch, num_heads, k_dim, v_dim, dtype=torch.float32, device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(new_values)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(num_chunks):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    out = out.reshape(batch, num_heads, -1, v_dim)[:, :, :seq_len]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # [B, T, Hk, dk]
    k: torch.Tensor,  # [B, T, Hk, dk]
    v: torch.Tensor,  # [B, T, Hv, dv]
    g: torch.Tensor,  # [B, T, Hv]
    beta: torch.Tensor,  # [B, T, Hv]
    initial_state: torch.Tensor | None = None,  # [B, Hv, dk, dv]; None: zeros
    keep_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token. (out [B, T, Hv, dv], final state [B, Hv, dk, dv] fp32), or with
    `keep_all_states` the state after every token [B, T, Hv, dk, dv] fp32 instead."""
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta)
    batch, num_heads, seq_len, k_dim = k.shape
    q = q / (k_dim**0.5)
    if initial_state is None:
        state = torch.zeros(batch, num_heads, k_dim, v.shape[-1], dtype=torch.float32,
                            device=q.device)
    else:
        state = initial_state.to(torch.float32)
    out = torch.zeros_like(v)
    states = []
    for t in range(seq_len):
        q_t, k_t, v_t = q[:, :, t], k[:, :, t], v[:, :, t]
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k_t.unsqueeze(-1)).sum(dim=-2)
        delta = (v_t - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
        if keep_all_states:
            states.append(state)
    out = out.transpose(1, 2).contiguous().to(out_dtype)
    if keep_all_states:
        if not states:
            raise ValueError("keep_all_states needs at least one token")
        return out, torch.stack(states, dim=1)
    return out, state


def causal_conv1d(
    x: torch.Tensor,  # [T, C] new inputs of one sequence
    conv_state: torch.Tensor | None,  # [C, K - 1] the K - 1 inputs before them; None: zeros
    weight: torch.Tensor,  # [C, K] depthwise kernel
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(depthwise causal conv) of one sequence: (out [T, C], padded inputs [C, K-1+T]).

    The conv state after the first i tokens is `padded[:, i : i + K - 1]` (the K - 1 inputs
    ending at token i - 1); after all of them `padded[:, -(K - 1):]`.
    """
    channels, kernel = weight.shape
    xt = x.transpose(0, 1).to(weight.dtype)  # [C, T]
    if conv_state is None:
        conv_state = torch.zeros(channels, kernel - 1, dtype=weight.dtype, device=x.device)
    padded = torch.cat((conv_state.to(weight.dtype), xt), dim=-1)  # [C, K - 1 + T]
    out = F.conv1d(padded.unsqueeze(0), weight.unsqueeze(1), groups=channels)[0]  # [C, T]
    return F.silu(out).transpose(0, 1).to(x.dtype), padded
