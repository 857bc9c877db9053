"""DrafterProposer (the engine's Proposer seam) drives a drafter like the standalone loop."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.drafters.proposer import DrafterProposer
from speckv.speculation.proposer import ProposerInput
from speckv.training.evaluate import speculative_generate
from tests.drafters.drafter_test_utils import (
    FLAVOUR_IDS,
    FLAVOURS,
    make_drafter,
    shuffled_table,
    tiny_target,
)


@pytest.fixture(scope="module")
def target():
    return tiny_target(vocab_size=6, init_std=0.5, seed=2)


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_proposer_loop_matches_standalone_loop(fmt, kw, target):
    bs, S, new_tokens = 4, 3, 24
    prompt = [1, 4, 2, 2, 5, 0, 3, 1, 4, 4, 2]
    d = make_drafter(fmt, kw, target)
    ref = speculative_generate(target, d, prompt, new_tokens, S, block_size=bs)
    table = shuffled_table(16, seed=1)
    kv = target.make_kv_cache(16, bs)
    prop = DrafterProposer(d, S, 16, bs)
    aux = prop.aux_layers

    def run(ids, start):
        md = AttentionMetadata.build([len(ids)], [start + len(ids)], [table], bs)
        out = target(torch.tensor(ids), md.positions(), kv, md, aux)
        return target.compute_logits(out.hidden_states).argmax(-1).tolist(), out

    def item(tokens, start, end, out, rows, wants):
        return ProposerInput(
            "r",
            list(tokens),
            start,
            end,
            out.hidden_states[:rows],
            out.prenorm_hidden[:rows],
            tuple(a[:rows] for a in out.aux_hidden_states),
            table,
            torch.empty(0),
            wants,
            S,
        )

    tokens = list(prompt)
    _, out = run(tokens[:6], 0)  # prefill chunk 1: no drafts yet
    assert prop.propose([item(tokens, 0, 6, out, 6, False)]) == {}
    g, out = run(tokens[6:], 6)
    tokens.append(g[-1])
    drafts = prop.propose([item(tokens, 6, len(prompt), out, 5, True)])["r"]
    accepted = []
    while len(tokens) - len(prompt) < new_tokens:
        n = len(tokens)
        g, out = run([tokens[-1], *drafts], n - 1)
        a = 0
        while a < S and drafts[a] == g[a]:
            a += 1
        accepted.append(a)
        tokens += [*drafts[:a], g[a]]
        drafts = prop.propose([item(tokens, n - 1, n + a, out, a + 1, True)])["r"]
    assert tokens[len(prompt) :][:new_tokens] == ref.tokens
    assert accepted == ref.accepted_per_step


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_proposer_caps_drafts_at_max_drafts(fmt, kw, target):
    """max_drafts < num_spec_tokens: that many drafts, the prefix of the uncapped ones."""
    bs, S = 4, 4
    prompt = [1, 4, 2, 2, 5, 0, 3, 1, 4, 4, 2]
    d = make_drafter(fmt, kw, target)
    table = list(range(1, 8))
    kv = target.make_kv_cache(8, bs)
    md = AttentionMetadata.build([len(prompt)], [len(prompt)], [table], bs)
    out = target(torch.tensor(prompt), md.positions(), kv, md, d.target_aux_layers)
    tokens = [*prompt, int(target.compute_logits(out.hidden_states[-1:]).argmax())]
    got = {}
    for max_drafts in (S, 2, 1):
        prop = DrafterProposer(d, S, 8, bs)
        x = ProposerInput(
            "r", tokens, 0, len(prompt), out.hidden_states, out.prenorm_hidden,
            out.aux_hidden_states, table, torch.empty(0), True, max_drafts,
        )  # fmt: skip
        got[max_drafts] = prop.propose([x])["r"]
    assert len(got[S]) == S
    assert got[2] == got[S][:2] and got[1] == got[S][:1]


def test_proposer_times_its_step_on_its_clock(target):
    """last_timing is the catch-up's and the drafts' span on the proposer's clock, whatever
    the positions: the adaptive policy divides by these (a negative cost makes every draft
    length look free)."""
    bs, S = 4, 2
    prompt = [1, 4, 2, 2, 5, 0, 3, 1, 4, 4, 2, 1, 3]  # 13 tokens: position 12 opens block 3
    d = make_drafter("eagle3", {}, target)
    table = list(range(1, 8))
    kv = target.make_kv_cache(8, bs)
    md = AttentionMetadata.build([len(prompt)], [len(prompt)], [table], bs)
    out = target(torch.tensor(prompt), md.positions(), kv, md, d.target_aux_layers)
    tokens = [*prompt, int(target.compute_logits(out.hidden_states[-1:]).argmax())]
    ticks = iter(100.0 + 0.25 * i for i in range(100))  # exact in binary floating point
    prop = DrafterProposer(d, S, 8, bs, clock=lambda: next(ticks))

    def item(start, wants):
        return ProposerInput(
            "r", tokens, start, len(prompt), out.hidden_states[start:], out.prenorm_hidden[start:],
            tuple(a[start:] for a in out.aux_hidden_states), table, torch.empty(0), wants, S,
        )  # fmt: skip

    assert len(prop.propose([item(0, True)])["r"]) == S  # catch-up, then the drafts
    assert (prop.last_timing.catch_up_s, prop.last_timing.draft_s) == (0.25, 0.25)
    prop = DrafterProposer(d, S, 8, bs, clock=lambda: next(ticks))
    assert prop.propose([item(12, False)]) == {}  # open block only: deferred, no drafter pass
    assert prop.num_deferred_positions("r") == 1
    assert (prop.last_timing.catch_up_s, prop.last_timing.draft_s) == (0.25, 0.0)
