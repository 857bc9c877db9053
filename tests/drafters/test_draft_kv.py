"""Draft KV written by the catch-up pass: paged == dense, depends on t[p+j], incremental == cold."""

from __future__ import annotations

import pytest
import torch

from speckv.drafters import CatchUpRequest, TargetStates
from tests.drafters.drafter_test_utils import (
    FLAVOUR_IDS,
    FLAVOURS,
    catch_up_all,
    dense_propose,
    dense_reference,
    make_drafter,
    random_states,
    read_kv,
    shuffled_table,
    tiny_target,
)

BS = 4
N = 23  # target rows (positions 0 .. N-1); tokens t[0 .. N]


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _setup(fmt, kw, target, seed=0):
    d = make_drafter(fmt, kw, target)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.config.vocab_size, (N + 1,), generator=g).tolist()
    states = random_states(d, N, target.config.hidden_size, seed)
    return d, tokens, states


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_paged_catch_up_equals_dense_reference(fmt, kw, target):
    d, tokens, states = _setup(fmt, kw, target)
    table = shuffled_table(N // BS + 3, seed=7)
    kv = d.make_kv_cache(len(table) + 1, BS)
    catch_up_all(d, states, tokens, table, kv, [N])
    ref = dense_reference(d, states, tokens)
    for j, (rk, rv) in enumerate(ref, start=1):
        k, v = read_kv(kv, j - 1, table, range(N + 1 - j))
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_incremental_catch_up_equals_one_pass(fmt, kw, target):
    """Prefill in chunks, then one token per pass (proposing in between): same draft KV as one
    cold pass, so a prefix hit reads exactly what a cold run wrote."""
    d, tokens, states = _setup(fmt, kw, target)
    table = shuffled_table(N // BS + 3, seed=3)
    cold = d.make_kv_cache(len(table) + 1, BS)
    inc = d.make_kv_cache(len(table) + 1, BS)
    catch_up_all(d, states, tokens, table, cold, [N])
    # Propose 4 drafts after every pass: provisional KV must be overwritten by later passes.
    catch_up_all(
        d, states, tokens, table, inc, [5, 6, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1], propose_between=4
    )
    for j in range(1, d.draft_kv_lookahead_tokens + 1):
        a = read_kv(cold, j - 1, table, range(N + 1 - j))
        b = read_kv(inc, j - 1, table, range(N + 1 - j))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_catch_up_without_proposals_writes_the_same_draft_kv(fmt, kw, target):
    """Steps that draft nothing (the adaptive draft length chose 0) skip the outputs only a
    proposal reads, and still write exactly the draft KV of a full catch-up."""
    d, tokens, states = _setup(fmt, kw, target)
    table = shuffled_table(N // BS + 3, seed=5)
    full = d.make_kv_cache(len(table) + 1, BS)
    lean = d.make_kv_cache(len(table) + 1, BS)
    chunks = [5, 6, 1, 1, 2, 1, 1, 1, 1, 1, 1, 1, 1]
    catch_up_all(d, states, tokens, table, full, chunks)
    catch_up_all(d, states, tokens, table, lean, chunks, will_propose=False)
    for j in range(1, d.draft_kv_lookahead_tokens + 1):
        a = read_kv(full, j - 1, table, range(N + 1 - j))
        b = read_kv(lean, j - 1, table, range(N + 1 - j))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    if len(d.modules_chain) == 1:  # its only module's outputs were skipped: no proposals
        state = d.write_draft_kv(states.select(torch.arange(0, 4)),
                                 [CatchUpRequest(0, 4, tokens[1:5], table)], lean,
                                 will_propose=False)
        with pytest.raises(ValueError, match="will_propose=False"):
            d.propose(state, 2, lean)


@pytest.mark.exactness
@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_draft_kv_at_p_depends_on_token_p_plus_j(fmt, kw, target):
    """Module j's KV at p changes with t[p + j] and not with later tokens: the reason block
    hashes carry L lookahead tokens."""
    d, tokens, states = _setup(fmt, kw, target)
    table = list(range(1, N // BS + 3))
    base = d.make_kv_cache(len(table) + 1, BS)
    catch_up_all(d, states, tokens, table, base, [N])
    p = 9
    for j in range(1, d.draft_kv_lookahead_tokens + 1):
        changed = list(tokens)
        changed[p + j] = (tokens[p + j] + 1) % target.config.vocab_size
        kv = d.make_kv_cache(len(table) + 1, BS)
        catch_up_all(d, states, changed, table, kv, [N])
        k0, _ = read_kv(base, j - 1, table, range(p + 1))
        k1, _ = read_kv(kv, j - 1, table, range(p + 1))
        assert torch.equal(k0[:p], k1[:p])  # positions before p never see t[p + j]
        assert (k0[p] - k1[p]).abs().max() > 1e-3, f"module {j} KV at p ignores t[p+{j}]"


@pytest.mark.exactness
def test_batched_requests_equal_single(target):
    """Two requests in one catch-up pass write what each writes alone."""
    fmt, kw = "mtp", {"num_modules": 3}
    d, tokens, states = _setup(fmt, kw, target)
    _, tokens2, states2 = _setup(fmt, kw, target, seed=5)
    t1, t2 = list(range(1, 8)), list(range(8, 15))
    kv = d.make_kv_cache(16, BS)
    n2 = 17
    both = TargetStates(torch.cat([states.hidden_states, states2.hidden_states[:n2]]))
    d.write_draft_kv(
        both,
        [
            CatchUpRequest(0, N, tokens[1 : N + 1], t1),
            CatchUpRequest(0, n2, tokens2[1 : n2 + 1], t2),
        ],
        kv,
    )
    for st, toks, table, n in ((states, tokens, t1, N), (states2, tokens2, t2, n2)):
        alone = d.make_kv_cache(16, BS)
        catch_up_all(d, st.select(torch.arange(n)), toks[: n + 1], table, alone, [n])
        for j in range(1, 4):
            torch.testing.assert_close(
                read_kv(kv, j - 1, table, range(n + 1 - j)),
                read_kv(alone, j - 1, table, range(n + 1 - j)),
                rtol=1e-5,
                atol=1e-5,
            )


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
@pytest.mark.parametrize("num_spec", [1, 2, 3, 5])
def test_propose_equals_dense_drafting(fmt, kw, num_spec, target):
    """Module j proposes draft j (then module k autoregressively), as a dense recomputation."""
    d, tokens, states = _setup(fmt, kw, target)
    n = 17  # real tokens t[0 .. n-1]; target rows 0 .. n-2
    table = shuffled_table(N // BS + 4, seed=5)
    kv = d.make_kv_cache(len(table) + 1, BS)
    st = states.select(torch.arange(n - 1))
    carry = None
    for a, b in ((0, 9), (9, 12), (12, n - 1)):  # three passes, so carries are exercised
        req = CatchUpRequest(a, b - a, tokens[a + 1 : b + 1], table, carry)
        state = d.write_draft_kv(st.select(torch.arange(a, b)), [req], kv)
        carry = state.carries[0]
    got = d.propose(state, num_spec, kv)[0].tolist()
    assert got == dense_propose(d, st, tokens[:n], num_spec)


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_propose_refuses_a_catch_up_short_of_the_last_real_token(fmt, kw, target):
    """A pass given more next tokens than positions (a non-final prefill chunk) cannot draft."""
    d, tokens, states = _setup(fmt, kw, target)
    kv = d.make_kv_cache(N // BS + 3, BS)
    req = CatchUpRequest(0, 9, tokens[1:11], list(range(1, N // BS + 3)))
    state = d.write_draft_kv(states.select(torch.arange(9)), [req], kv)
    with pytest.raises(ValueError, match="last real token"):
        d.propose(state, 2, kv)
