"""The held-out speculation prompts share nothing with the head's training prompts or the
prompts its training and the adaptive policy were evaluated on, and are the same every run."""

from __future__ import annotations

import re

import pytest

from speckv.drafters import heldout_prompts as heldout
from speckv.training.prompts import FOLLOW_UPS, eval_prompts, train_prompts


def _four_grams(text: str) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i : i + 4]) for i in range(len(words) - 3)}


def _all_text(family: str) -> list[str]:
    return heldout.text_prompts(family, heldout.family_size(family))


@pytest.mark.parametrize("family", ["chat", "code", "list"])
def test_no_heldout_prompt_shares_four_words_with_a_seen_prompt(family):
    seen: set[tuple[str, ...]] = set()
    for text in [*train_prompts(0, "wide"), *train_prompts(1, "wide"), *eval_prompts(None),
                 *FOLLOW_UPS]:
        seen |= _four_grams(text)
    prompts = _all_text(family)
    assert len(set(prompts)) == len(prompts) >= 32  # one batch of 32 distinct prompts
    for prompt in prompts:
        shared = _four_grams(prompt) & seen
        assert not shared, f"{prompt!r} shares {sorted(shared)[:3]} with a seen prompt"


def test_a_shared_phrase_would_be_caught():
    # the check above can fail: a training template's phrase is found in a prompt using it
    seen = set().union(*(_four_grams(t) for t in train_prompts(0)))
    assert _four_grams("Write a Python function that sorts socks.") & seen


def test_random_token_prompts_are_seeded_and_avoid_excluded_ids():
    a = heldout.random_token_prompts(8, 100, exclude=range(10))
    assert a == heldout.random_token_prompts(8, 100, exclude=range(10))
    assert all(32 <= len(p) <= 96 and min(p) >= 10 and max(p) < 100 for p in a)
    assert heldout.random_token_prompts(8, 100, seed=1) != a


def test_families_and_sizes_are_checked():
    assert heldout.text_prompts("code", 3) == _all_text("code")[:3]
    with pytest.raises(ValueError, match="unknown prompt family"):
        heldout.text_prompts("poetry", 2)
    with pytest.raises(ValueError, match="asked for"):
        heldout.text_prompts("list", heldout.family_size("list") + 1)


def test_the_wide_prompt_set_extends_the_shipped_one_without_changing_it():
    base = train_prompts(0)
    wide = train_prompts(0, "wide")
    assert len(base) == 1671  # the set the shipped head was trained on (train_summary.json)
    assert wide[: len(base)] == base and train_prompts(0, "new") == wide[len(base) :]
    new = wide[len(base) :]
    assert len(set(new)) == len(new) > 4000 and not set(new) & set(base)
    with pytest.raises(ValueError, match="prompt set"):
        train_prompts(0, "huge")
