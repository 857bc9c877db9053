"""Training-time test (TTT) for the EAGLE3 head: batches of distilled sequences, the head's
forward where steps 2..S read its own previous output and attend to the real positions' draft
KV plus their own earlier steps' keys, the loss against the target's distribution, and the
held-out metrics (per-step top-1 accuracy, the expected acceptance length from it).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from speckv.drafters.eagle3 import Eagle3Drafter
from speckv.models.common.rope import apply_rope
from speckv.training.distill import (
    DistillSequence,
)

if TYPE_CHECKING:
    pass


class Batch:
    """Sequences padded at the end: tokens [b, T + 1], features [b, T, 4, hidden], answer
    start per row, valid length per row (T = longest sequence - 1)."""

    def __init__(self, seqs: Sequence[DistillSequence]) -> None:
        T = max(len(s.tokens) for s in seqs) - 1
        b = len(seqs)
        hidden = seqs[0].features.shape[-1]
        self.tokens = torch.zeros(b, T + 1, dtype=torch.int64)
        self.features = torch.zeros(b, T, seqs[0].features.shape[1], hidden,
                                    dtype=torch.bfloat16)
        self.lengths = torch.tensor([len(s.tokens) - 1 for s in seqs])  # feature rows
        self.answer_start = torch.tensor([s.num_prompt_tokens for s in seqs])
        for i, s in enumerate(seqs):
            self.tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
            self.features[i, : len(s.tokens) - 1] = s.features


def make_batches(data: Sequence[DistillSequence], batch_tokens: int, rng: random.Random
                 ) -> list[list[int]]:
    """Index lists of similar lengths, at most `batch_tokens` padded tokens each, shuffled."""
    order = sorted(range(len(data)), key=lambda i: len(data[i].tokens))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        if cur and len(data[i].tokens) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def _ttt_attention(attn, x: torch.Tensor, positions: torch.Tensor, rotary,
                   prev_k: list[torch.Tensor], prev_v: list[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of drafting step u = len(prev_k) + 1 at every anchor i.

    x [b, T, 2H] is step u's input at anchors 0..T-1 (position i + u - 1). Anchor i sees the
    step-1 keys of positions 0..i (the real positions' draft KV) and its own keys from steps
    2..u (the draft positions before it), exactly as drafts at inference do. Returns
    (out [b, T, H], k, v [b, kv_heads, T, d]).
    """
    b, T, _ = x.shape
    d, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    q = attn.q_proj(x).view(b, T, nh, d)
    k = attn.k_proj(x).view(b, T, nkv, d)
    v = attn.v_proj(x).view(b, T, nkv, d)
    cos, sin = rotary.cos_sin(positions, q.dtype)  # each [T, 1, d]
    q, k = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2)
    v = v.transpose(1, 2)
    keys = torch.cat([*prev_k, k], dim=2)  # [b, nkv, u * T, d]
    values = torch.cat([*prev_v, v], dim=2)
    u = len(prev_k) + 1
    i = torch.arange(T)
    mask = torch.zeros(T, u * T, dtype=torch.bool)
    mask[:, :T] = i[None, :] <= i[:, None]  # step 1: causal over real positions
    for s in range(1, u):
        mask[i, s * T + i] = True  # steps 2..u: the anchor's own draft positions
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.scale,
                                       enable_gqa=nh != nkv)  # [b, nh, T, d]
    return attn.o_proj(o.transpose(1, 2).reshape(b, T, nh * d)), k, v


def ttt_outputs(drafter: Eagle3Drafter, tokens: torch.Tensor, features: torch.Tensor,
                num_steps: int, aux_scale: torch.Tensor) -> list[torch.Tensor]:
    """The head's pre-norm output of drafting steps 1..num_steps at every anchor, each
    [b, T, H], computed densely over whole sequences (training-time test).

    tokens [b, T + 1] int64, features [b, T, 4, H] (aux low / mid / high, final; see
    distill.py). Step u at anchor i sits at position i + u - 1, reads token t[i + u] and the
    previous step's output at the same anchor (step 1: fc over the target's aux features at
    i, which fc reads divided by `aux_scale` [3H]), and predicts t[i + u + 1]: exactly what
    draft u computes at inference after a catch-up through position i that accepted every
    draft before it (tests/drafters/test_train.py checks this against `Drafter.propose`).
    """
    m = drafter.module
    layer = m.midlayer
    T = features.shape[1]
    aux = features[:, :, :3].flatten(2).float() / aux_scale  # [b, T, 3H]
    hidden = drafter.fc(aux)  # [b, T, H]: h_0
    pos = torch.arange(T)
    prev_k: list[torch.Tensor] = []
    prev_v: list[torch.Tensor] = []
    outputs = []
    for u in range(1, num_steps + 1):
        tok_in = tokens[:, u : u + T]  # t[i + u], [b, T] (zero past the end)
        if tok_in.shape[1] < T:
            tok_in = F.pad(tok_in, (0, T - tok_in.shape[1]))
        emb = layer.input_layernorm(m.target.embed(tok_in).to(hidden.dtype))
        x = torch.cat((emb, layer.hidden_norm(hidden)), dim=-1)  # [b, T, 2H]
        a, k, v = _ttt_attention(layer.self_attn, x, pos + (u - 1), layer._rotary, prev_k,
                                 prev_v)
        prev_k.append(k)
        prev_v.append(v)
        r = hidden + a
        hidden = r + layer.mlp(layer.post_attention_layernorm(r))  # [b, T, H] pre-norm
        outputs.append(hidden)
    return outputs


def ttt_forward(drafter: Eagle3Drafter, batch: Batch, target_head: torch.Tensor,
                num_steps: int, step_weights: Sequence[float], aux_scale: torch.Tensor,
                feature_weight: float = 0.0
                ) -> tuple[torch.Tensor, list[tuple[int, int]], list[float]]:
    """(weighted loss, per step (top-1 hits, counted positions), per-step token losses).

    Step u at anchor i predicts t[i + u + 1], whose target distribution is
    softmax(target_head @ final[i + u]) over the draft vocabulary. Only anchors whose
    predicted token is part of the target's answer count (drafts never guess a prompt).
    `feature_weight` > 0 adds EAGLE-1's feature regression: smooth-L1 between the head's
    normed output and the target's final hidden state at i + u (what the target's LM head
    reads; the head's norm starts as the target's), a dense signal that speeds learning.
    """
    m = drafter.module
    final = batch.features[:, :, 3].float()  # [b, T, H] post-norm, predicts the next token
    T = final.shape[1]
    outputs = ttt_outputs(drafter, batch.tokens, batch.features, num_steps, aux_scale)
    loss = final.new_zeros(())
    hits: list[tuple[int, int]] = []
    step_losses: list[float] = []
    for u, hidden in enumerate(outputs, start=1):
        n_valid = T - u  # anchors i with a target at i + u (feature rows i + u < T)
        if n_valid <= 0:
            break
        predicted_pos = torch.arange(n_valid)[None, :] + u + 1  # position of t[i + u + 1]
        valid = (predicted_pos - 1 < batch.lengths[:, None]) & (
            predicted_pos >= batch.answer_start[:, None])  # [b, n_valid]
        if not bool(valid.any()):
            hits.append((0, 0))
            continue
        normed = m.norm(hidden[:, :n_valid][valid])  # [m, H]
        logits = m.lm_head(normed)  # [m, K]
        target_f = final[:, u : u + n_valid][valid]  # [m, H]
        with torch.no_grad():
            target_p = F.linear(target_f, target_head).float().softmax(-1)
        step_loss = F.cross_entropy(logits.float(), target_p)
        loss = loss + step_weights[u - 1] * step_loss
        if feature_weight > 0:
            feature_loss = F.smooth_l1_loss(normed.float(), target_f)
            loss = loss + step_weights[u - 1] * feature_weight * feature_loss
        step_losses.append(float(step_loss.detach()))
        with torch.no_grad():
            # acceptance proxy: does the draft equal the token the target produced?
            truth = batch.tokens[:, u + 1 : u + 1 + n_valid][valid]  # [m]
            guess = logits.argmax(-1)
            hits.append((int((guess + m.d2t[guess] == truth).sum()), int(truth.numel())))
    return loss, hits, step_losses


def expected_acceptance_length(accuracies: Sequence[float]) -> float:
    """1 + p1 + p1 p2 + ...: tokens per verification if step u is right with prob p_u given
    steps before it were (what the TTT accuracies estimate)."""
    total, run = 1.0, 1.0
    for p in accuracies:
        run *= p
        total += run
    return total


@torch.no_grad()
def heldout_metrics(drafter, batches: list[Batch], target_head, num_steps: int,
                    aux_scale: torch.Tensor, dtype: torch.dtype = torch.float32
                    ) -> tuple[float, list[float]]:
    """(mean step-1..S loss, per-step top-1 accuracy on answer positions) on held-out data,
    in bfloat16 autocast where `dtype` is bfloat16."""
    hits = [[0, 0] for _ in range(num_steps)]
    losses = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        for batch in batches:
            _, h, step_losses = ttt_forward(drafter, batch, target_head, num_steps,
                                            [1.0] * num_steps, aux_scale)
            losses.append(sum(step_losses) / len(step_losses))
            for u, (a, n) in enumerate(h):
                hits[u][0] += a
                hits[u][1] += n
    return sum(losses) / len(losses), [a / max(1, n) for a, n in hits]
