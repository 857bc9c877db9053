"""Helpers for the drafter tests: tiny targets, random target states, dense references."""

from __future__ import annotations

import random

import torch

from speckv.attention import PagedKVCache
from speckv.drafters import CatchUpRequest, Drafter, TargetStates, random_drafter
from speckv.models.llama.model import LlamaForCausalLM
from speckv.models.llama.tiny import tiny_model

# (method, kwargs) of every drafter flavour the tests cover; MTP in both checkpoint layouts.
FLAVOURS: list[tuple[str, dict[str, object]]] = [
    ("eagle", {}),
    ("eagle3", {}),
    ("mtp", {"num_modules": 1, "layout": "deepseek"}),
    ("mtp", {"num_modules": 3, "layout": "deepseek"}),
    ("mtp", {"num_modules": 2, "layout": "qwen"}),
]
FLAVOUR_IDS = [f"{f}-{kw.get('layout', '')}-{kw.get('num_modules', 1)}" for f, kw in FLAVOURS]


def tiny_target(vocab_size: int = 61, init_std: float = 0.3, seed: int = 0) -> LlamaForCausalLM:
    return tiny_model(seed, init_std, vocab_size=vocab_size, hidden_size=32,
                      intermediate_size=64, num_hidden_layers=5, max_position_embeddings=512)


def make_drafter(fmt: str, kw: dict[str, object], target: LlamaForCausalLM,
                 seed: int = 1) -> Drafter:
    extra: dict[str, object] = dict(kw)
    if fmt == "eagle3":
        v = target.config.vocab_size
        extra["draft_vocab_size"] = v // 2
    d = random_drafter(fmt, target, init_std=0.2, seed=seed, **extra)
    if fmt == "eagle3":  # a reduced vocabulary: every second target id
        m = d.module  # type: ignore[attr-defined]
        dv = m.d2t.shape[0]
        m.d2t.copy_(torch.arange(dv) * 2 - torch.arange(dv))
        m.t2d.zero_()
        m.t2d[torch.arange(dv) * 2] = True
    return d


def random_states(drafter: Drafter, n: int, hidden: int, seed: int = 0) -> TargetStates:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g)
    aux = tuple(torch.randn(n, hidden, generator=g) for _ in drafter.target_aux_layers)
    return TargetStates(h, aux)


def shuffled_table(num_blocks: int, seed: int) -> list[int]:
    table = list(range(1, num_blocks))
    random.Random(seed).shuffle(table)
    return table


def read_kv(
    kv: PagedKVCache, layer: int, table: list[int], positions: range
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) [len(positions), kv_heads, head_dim] at the given positions through the table."""
    bs = kv.block_size
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions])
    c = kv.layer(layer)
    return (
        c.key.reshape(-1, kv.num_kv_heads, kv.head_dim)[slots],
        c.value.reshape(-1, kv.num_kv_heads, kv.head_dim)[slots],
    )


@torch.no_grad()
def dense_reference(
    drafter: Drafter, states: TargetStates, tokens: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per module j: dense (k, v) [N + 1 - j, kv_heads, d] for positions 0 .. N - j.

    states has N rows (positions 0 .. N - 1); tokens are t[0 .. N].
    """
    n = states.hidden_states.shape[0]
    h = drafter.first_hidden(states)  # [N, hidden]
    out = []
    for j, m in enumerate(drafter.modules_chain, start=1):
        w = n + 1 - j
        ids = torch.tensor(tokens[j : j + w])[None]
        o, k, v = m.dense_forward(ids, h[:w][None], torch.arange(w))
        out.append((k[0], v[0]))
        h = o[0]
    return out


def catch_up_all(
    drafter: Drafter,
    states: TargetStates,
    tokens: list[int],
    table: list[int],
    kv: PagedKVCache,
    chunks: list[int],
    propose_between: int = 0,
    will_propose: bool = True,
) -> None:
    """Catch-up over positions 0 .. N-1 in passes of the given sizes (carries threaded).

    propose_between > 0 also proposes that many drafts after every pass (provisional KV);
    will_propose=False catches up without the outputs only a proposal reads.
    """
    carry = None
    start = 0
    for c in chunks:
        st = states.select(torch.arange(start, start + c))
        req = CatchUpRequest(start, c, tokens[start + 1 : start + c + 1], table, carry)
        state = drafter.write_draft_kv(st, [req], kv, will_propose=will_propose)
        carry = state.carries[0]
        start += c
        if propose_between:
            drafter.propose(state, propose_between, kv)


@torch.no_grad()
def dense_propose(
    drafter: Drafter, states: TargetStates, tokens: list[int], num_spec: int
) -> list[int]:
    """Greedy drafts by dense recomputation: states rows 0 .. n-2, tokens t[0 .. n-1]."""
    n = len(tokens)
    k = len(drafter.modules_chain)
    toks = list(tokens)
    hidden = drafter.first_hidden(states)[: n - 1]  # inputs of module j at 0 .. n-2
    drafts: list[int] = []
    out = hidden
    for j in range(1, min(num_spec, k) + 1):
        m = drafter.modules_chain[j - 1]
        hidden = out
        ids = torch.tensor(toks[j : j + n - 1])[None]
        out = m.dense_forward(ids, hidden[None], torch.arange(n - 1))[0][0]
        drafts.append(int(m.compute_logits(out[-1:]).argmax()))
        toks.append(drafts[-1])
    m = drafter.modules_chain[k - 1]
    while len(drafts) < num_spec:  # module k, one position further per draft
        hidden = torch.cat([hidden, out[-1:]])
        w = hidden.shape[0]
        ids = torch.tensor(toks[k : k + w])[None]
        out = m.dense_forward(ids, hidden[None], torch.arange(w))[0][0]
        drafts.append(int(m.compute_logits(out[-1:]).argmax()))
        toks.append(drafts[-1])
    return drafts
