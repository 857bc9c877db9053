"""The standalone greedy speculative loop reproduces the target's greedy output exactly."""

from __future__ import annotations

import pytest

from speckv.models.common.generate import greedy_generate
from speckv.training.evaluate import speculative_generate
from tests.drafters.drafter_test_utils import FLAVOUR_IDS, FLAVOURS, make_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    # A small vocabulary so random drafts are accepted now and then (exercises acceptance).
    return tiny_target(vocab_size=6, init_std=0.5, seed=2)


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
@pytest.mark.parametrize("num_spec", [1, 3, 5])
def test_speculative_equals_greedy(fmt, kw, num_spec, target):
    prompt = [1, 4, 2, 2, 5, 0, 3, 1, 4, 4, 2, 0, 5]
    ref = greedy_generate(target, prompt, 40, block_size=4)
    d = make_drafter(fmt, kw, target)
    res = speculative_generate(
        target,
        d,
        prompt,
        40,
        num_spec,
        block_size=4,
        shuffle_blocks_seed=11,
        prefill_chunk_tokens=5,
    )
    assert res.tokens == ref
    assert res.accepted_per_step, "no verification step ran"


def test_some_drafts_get_accepted(target):
    """Sanity check on the test itself: acceptance paths are exercised, not only rejections."""
    prompt = [1, 4, 2, 2, 5, 0, 3, 1]
    total = 0
    for fmt, kw in FLAVOURS:
        d = make_drafter(fmt, kw, target)
        res = speculative_generate(target, d, prompt, 40, 3, block_size=4)
        total += sum(res.accepted_per_step)
    assert total > 0
