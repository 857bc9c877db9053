"""Sampler: next tokens from logits, and verification of draft tokens.

Owns greedy / temperature / top-k / top-p sampling, and draft verification:

- greedy: accept drafts while each equals the target's argmax, then one bonus token (the
  argmax at the first mismatch, or after the last draft);
- temperature > 0: speculative rejection sampling, which keeps the target distribution
  exactly. With a draft distribution q: accept draft x with prob min(1, p(x) / q(x)), else
  sample from norm(max(p - q, 0)) and stop. Proposers here are deterministic (q one-hot):
  accept with prob p(x), else sample from p with x removed. We draw y ~ p and accept x iff
  y == x (else y is the correction): the same law, and y depends only on p and the
  position's own generator (`position_generator(seed, position)`), so a seeded request
  samples the same tokens whatever drafts were verified, including none (speculation off,
  or the adaptive draft length choosing fewer).

Logits in: `[1 + num_drafts, vocab]` fp32 rows of one request (row i predicts the token after
draft i - 1). Out: accepted drafts + one bonus/resampled token, as Python ints.
`accepted_greedy` is `verify_greedy` of a whole batch at once (the runner's hot path): the
accepted count of every request from one comparison of the argmax rows with the drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from speckv.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


def make_generator(seed: int, device: torch.device) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def position_seed(seed: int, position: int) -> int:
    """A well-mixed 63-bit seed of (request seed, token position) (splitmix64)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def position_generator(seed: int, position: int, device: torch.device) -> torch.Generator:
    """The generator of one output position: its draws depend only on (seed, position)."""
    return make_generator(position_seed(seed, position), device)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[n, vocab] logits -> [n, vocab] fp32 probabilities after temperature, top-k, top-p."""
    logits = logits.float() / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token when the tokens before it already reach top_p (keeps at least one)
        exclusive_cum = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = exclusive_cum >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def verify_greedy(argmax_rows: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Accepted drafts + bonus, from the argmax of each row (len(drafts) + 1 rows)."""
    sampled: list[int] = []
    for index, draft in enumerate(drafts):
        target = argmax_rows[index]
        sampled.append(target)
        if target != draft:
            return sampled
    sampled.append(argmax_rows[len(drafts)])
    return sampled


def greedy_tokens(logits: torch.Tensor) -> np.ndarray:
    """[n, vocab] logits -> [n] int64 host array: the argmax of each row (the first of equal
    maxima, NaN counting as the maximum, as `torch.argmax`). Host logits go through numpy,
    whose argmax is several times faster than torch's on CPU."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(-1).astype(np.int64, copy=False)
    return logits.argmax(-1).cpu().numpy()


def accepted_greedy(argmax: np.ndarray, first_rows: np.ndarray, num_drafts: np.ndarray,
                    draft_ids: np.ndarray) -> np.ndarray:
    """`verify_greedy` of a batch: drafts accepted per request, [n] int64. Request i's rows
    are argmax[first_rows[i] : first_rows[i] + num_drafts[i] + 1] (its sampled tokens are the
    first accepted + 1 of them); `draft_ids` [sum(num_drafts)] its drafts, requests in
    order. Pure."""
    n = num_drafts.shape[0]
    total = int(num_drafts.sum()) if n else 0
    if total == 0:
        return np.zeros(n, dtype=np.int64)
    k = int(num_drafts[0])
    if total == n * k and bool((num_drafts == k).all()):  # k drafts each (decode)
        matches = argmax[first_rows[:, None] + np.arange(k)] == draft_ids.reshape(n, k)
        return np.cumprod(matches, axis=1).sum(axis=1)
    # [total] request of every draft, and its index among the request's drafts
    owner = np.repeat(np.arange(n), num_drafts)
    index = np.arange(total) - np.repeat(np.cumsum(num_drafts) - num_drafts, num_drafts)
    matches = np.zeros((n, int(num_drafts.max())), dtype=np.int64)  # 0 past a row's drafts
    matches[owner, index] = argmax[first_rows[owner] + index] == draft_ids
    # accepted: the leading run of matches (cumulative product, summed)
    return np.cumprod(matches, axis=1).sum(axis=1)


def verify_random(
    logits: torch.Tensor,  # [1 + num_drafts, vocab]
    drafts: Sequence[int],
    params: SamplingParams,
    seed: int,
    first_position: int,  # token position that row 0 samples
) -> list[int]:
    """Rejection sampling for one-hot (deterministic) drafts; keeps the target distribution.
    Row i draws y_i ~ p_i from the generator of position first_position + i; draft i is
    accepted iff y_i equals it, else y_i ends the step (p_i without the draft, renormalised:
    the residual distribution)."""
    probs = target_probs(logits, params)  # [1 + num_drafts, vocab]
    sampled: list[int] = []
    for index in range(len(drafts) + 1):
        generator = position_generator(seed, first_position + index, probs.device)
        token = int(torch.multinomial(probs[index], 1, generator=generator).item())
        sampled.append(token)
        if index == len(drafts) or token != drafts[index]:
            break
    return sampled
