"""The runner's whole-batch verification against the per-request rules it replaces:
`accepted_greedy` vs `verify_greedy`, `greedy_tokens` vs `torch.argmax`, `may_stop` vs
`first_stop`, and the engine's outputs with speculation (batched verification, drafts on some
requests only, stop tokens, max_tokens and max_model_len cuts, seeded requests mixed in) vs
without it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.engine import runner_sampling
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.messages import StopLimits
from speckv.engine.sampler import accepted_greedy, greedy_tokens, verify_greedy
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.stopping import first_stop, may_stop
from tests.engine.hybrid_engine_utils import OracleProposer

VOCAB_SIZE = 90  # the prompts' and drafts' token ids are below it
VOCAB = 4  # a small vocabulary: drafts often match, stop tokens often occur

# one request of a batch: (its argmax rows: 1 + num_drafts, its drafts)
_request = st.integers(0, 4).flatmap(lambda k: st.tuples(
    st.lists(st.integers(0, VOCAB - 1), min_size=k + 1, max_size=k + 1),
    st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k)))


def _layout(batch):
    """The runner's arrays of a batch: argmax rows, first row and drafts per request, drafts."""
    argmax = np.array([t for rows, _ in batch for t in rows], dtype=np.int64)
    num_drafts = np.array([len(d) for _, d in batch], dtype=np.int64)
    first_rows = np.cumsum(num_drafts + 1) - (num_drafts + 1)
    draft_ids = np.array([t for _, d in batch for t in d], dtype=np.int64)
    return argmax, first_rows, num_drafts, draft_ids


@settings(max_examples=300, deadline=None)
@given(st.lists(_request, min_size=0, max_size=12))
def test_accepted_greedy_is_verify_greedy_per_request(batch):
    argmax, first_rows, num_drafts, draft_ids = _layout(batch)
    accepted = accepted_greedy(argmax, first_rows, num_drafts, draft_ids)
    assert accepted.shape == (len(batch),)
    for (rows, drafts), a, lo in zip(batch, accepted.tolist(), first_rows.tolist()):
        assert argmax[lo : lo + a + 1].tolist() == verify_greedy(rows, drafts)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_request, st.integers(0, 6), st.integers(1, 8), st.integers(1, 14),
                          st.frozensets(st.integers(0, VOCAB + 1), max_size=2)),
                min_size=1, max_size=10))
def test_may_stop_flags_every_request_first_stop_ends(batch):
    """Where `may_stop` is False, `first_stop` keeps every token and names no reason; every
    request `first_stop` ends is flagged."""
    argmax, first_rows, num_drafts, draft_ids = _layout([r for r, *_ in batch])
    accepted = accepted_greedy(argmax, first_rows, num_drafts, draft_ids)
    num_prompt = np.array([p for _, p, *_ in batch], dtype=np.int64)
    limits = [StopLimits(stops, max_tokens, max_model_len)
              for _, _, max_tokens, max_model_len, stops in batch]
    # real tokens so far: the prompt plus some output, still short of both limits
    num_tokens = np.array([min(p + 1, lim.max_model_len - 1, p + lim.max_tokens - 1)
                           for p, lim in zip(num_prompt.tolist(), limits)], dtype=np.int64)
    num_tokens = np.maximum(num_tokens, num_prompt)
    stop_lens = np.array([min(p + lim.max_tokens, lim.max_model_len)
                          for p, lim in zip(num_prompt.tolist(), limits)], dtype=np.int64)
    union = np.array(sorted(set().union(*(lim.stop_token_ids for lim in limits))),
                     dtype=np.int64)
    flags = may_stop(argmax, first_rows, accepted + 1, num_tokens, stop_lens, union)
    for i, lim in enumerate(limits):
        lo, a = int(first_rows[i]), int(accepted[i])
        sampled = argmax[lo : lo + a + 1].tolist()
        kept, reason = first_stop(sampled, int(num_tokens[i]), int(num_prompt[i]), lim)
        if not flags[i]:
            assert (kept, reason) == (len(sampled), None)
        if reason is not None:
            assert flags[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_tokens_is_torch_argmax(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randint(0, 3, (64, 17), generator=generator).to(dtype)  # many ties
    logits[3, 5] = float("nan")
    logits[7, :] = float("-inf")
    got = greedy_tokens(logits)
    assert got.dtype == np.int64
    assert got.tolist() == logits.argmax(-1).tolist()


class _SomeDrafts(OracleProposer):
    """The oracle's drafts (every few wrong) for most requests; none for every `skip_every`-th
    call's request (rows without drafts beside rows with them)."""

    def __init__(self, reference, num_spec_tokens, vocab_size, skip_every=4):
        super().__init__(reference, num_spec_tokens, wrong_every=3, vocab_size=vocab_size)
        self.skip_every = skip_every
        self.asked = 0

    def propose(self, inputs):
        drafts = super().propose(inputs)
        kept = {}
        for request_id, ids in drafts.items():
            self.asked += 1
            if self.asked % self.skip_every:
                kept[request_id] = ids
        return kept


def _outputs(model, requests, proposer=None):
    # a fixed draft length (no adaptive policy): every step drafts what the proposer offers
    spec = {} if proposer is None else dict(
        speculative_method="ngram", num_spec_tokens=proposer.num_spec_tokens,
        adaptive_speculation=False)
    engine = LLMEngine(model, engine_config(block_size=4, num_blocks=400, max_model_len=40,
                                            **spec), proposer=proposer)
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return done


@pytest.mark.exactness
@pytest.mark.parametrize("small_batch", [0, 1000], ids=["batched", "one-by-one"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_verification_keeps_the_outputs_of_no_speculation(tiny_model, seed,
                                                                  small_batch, monkeypatch):
    """Drafts on most requests (accepted in part, rejected in part, none on some), stop
    tokens, max_tokens and max_model_len cuts, seeded sampling mixed with greedy: the outputs
    equal a run without speculation, token for token, reason for reason, whether the runner
    verifies the batch at once or (a small batch) request by request."""
    monkeypatch.setattr(runner_sampling, "_SMALL_BATCH", small_batch)
    rng = random.Random(seed)
    requests = {}
    assert tiny_model.config.vocab_size >= VOCAB_SIZE
    for i in range(24):
        prompt = [rng.randrange(1, 90) for _ in range(rng.randrange(4, 20))]
        stops = tuple(rng.sample(range(1, 90), rng.randrange(0, 20)))
        params = SamplingParams(
            max_tokens=rng.randrange(1, 30), stop_token_ids=stops, ignore_eos=i % 3 != 0,
            temperature=0.8 if i % 5 == 0 else 0.0, seed=i if i % 5 == 0 else None)
        requests[f"r{i}"] = (prompt, params)
    reference = _outputs(tiny_model, requests)
    full = {i: requests[i][0] + list(out.token_ids) for i, out in reference.items()}
    for k in (1, 3):
        got = _outputs(tiny_model, requests, _SomeDrafts(full, k, VOCAB_SIZE))
        assert {i: (o.token_ids, o.finish_reason) for i, o in got.items()} == {
            i: (o.token_ids, o.finish_reason) for i, o in reference.items()}
        for seeded in (False, True):  # both kinds accept drafts in part
            outs = [o for i, o in got.items() if (requests[i][1].seed is not None) == seeded]
            assert 0 < sum(o.num_accepted_tokens for o in outs) < sum(
                o.num_draft_tokens for o in outs)
    reasons = {str(o.finish_reason) for o in reference.values()}
    assert {"stop", "length"} <= reasons
