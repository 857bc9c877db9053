"""Sampling: validation, seeded reproducibility, and rejection sampling that keeps the target
distribution."""

from __future__ import annotations

import pytest
import torch

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampler import position_seed, target_probs, verify_random
from speckv.engine.sampling_params import SamplingParams
from tests.engine.engine_test_utils import run_engine, shared_prefix_prompts


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ("",)}, "stop"),
    ],
)
def test_invalid_sampling_values_are_rejected(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_top_k_top_p_mask():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.4))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_rejection_sampling_keeps_the_target_distribution():
    torch.manual_seed(0)
    vocab = 6
    logits = torch.randn(3, vocab) * 1.5  # rows for: draft 0, draft 1, bonus
    params = SamplingParams(temperature=0.8)
    p = target_probs(logits, params)
    num_samples = 20_000

    def chi_square(counts, probs):
        expected = probs * counts.sum()
        keep = expected > 0
        assert counts[~keep].sum() == 0
        return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())

    # first draft unlikely (almost always rejected), then one of middling probability (often
    # accepted, so the second draft's verification is checked too); second draft likely
    for first_draft in (int(p[0].argmin()), int(p[0].argsort()[vocab // 2])):
        drafts = [first_draft, int(p[1].argmax())]
        first = torch.zeros(vocab)
        second_given_draft = torch.zeros(vocab)
        for seed in range(num_samples):
            sampled = verify_random(logits, drafts, params, seed, 7)
            first[sampled[0]] += 1
            if sampled[0] == drafts[0]:
                second_given_draft[sampled[1]] += 1
        # df = 5: the 0.999 quantile is 20.5
        assert chi_square(first, p[0]) < 20.5
        if first_draft != int(p[0].argmin()):
            assert second_given_draft.sum() > 200
            assert chi_square(second_given_draft, p[1]) < 20.5


def test_same_seed_same_output_and_engine_seed_default(tiny_model):
    prompts = shared_prefix_prompts(3, tiny_model.config.vocab_size, seed=8)

    def run(params, method=None):
        engine = LLMEngine(
            tiny_model,
            engine_config(
                block_size=4, num_blocks=128, speculative_method=method,
                num_spec_tokens=2 if method else 0,
            ),
        )
        final = run_engine(engine, prompts, params)
        return [final[f"r{i}"].token_ids for i in range(len(prompts))]

    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=40, seed=11)
    assert run(seeded) == run(seeded)
    assert run(seeded) != run(SamplingParams(max_tokens=16, temperature=1.0, seed=12))
    unseeded = SamplingParams(max_tokens=16, temperature=1.0)
    assert run(unseeded) == run(unseeded)  # derived from EngineConfig.seed
    assert run(seeded, "ngram") == run(seeded, "ngram")
    # each position samples from its own (seed, position) generator: the drafts verified, or
    # none at all, do not change a seeded request's tokens
    assert run(seeded, "ngram") == run(seeded)


def test_position_seeds_differ_by_seed_and_position():
    seeds = {position_seed(seed, position) for seed in range(50) for position in range(50)}
    assert len(seeds) == 2500 and all(0 <= s < 2**63 for s in seeds)
