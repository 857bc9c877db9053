"""The prefix_repetition generator and JSONL workloads."""

from __future__ import annotations

import json

import pytest

from speckv.workloads import (
    PrefixRepetitionConfig,
    load_jsonl,
    oracle_hit_tokens,
    prefix_repetition,
)


class WordTokenizer:
    """Decoding joins ids as words; encoding splits and may merge "1 2" pairs, so a round
    trip can change the length, as a real BPE tokenizer's does."""

    vocab_size = 1000

    def decode(self, token_ids):
        return " ".join(str(token) for token in token_ids)

    def encode(self, text):
        words = text.split()
        return [int(word) % 997 for word in words if word != "7"]


def test_shape_and_prefix_sharing():
    config = PrefixRepetitionConfig(prefix_len=20, suffix_len=7, num_prefixes=3,
                                    output_len=5, num_prompts=12, seed=1)
    requests = prefix_repetition(config, vocab_size=1000, tokenizer=WordTokenizer())
    assert len(requests) == 12
    assert all(len(r.prompt_token_ids) == 27 and r.output_len == 5 for r in requests)
    by_prefix: dict[int, set] = {}
    for request in requests:
        by_prefix.setdefault(request.prefix_index, set()).add(tuple(request.prompt_token_ids[:20]))
    assert sorted(by_prefix) == [0, 1, 2]
    assert all(len(prefixes) == 1 for prefixes in by_prefix.values())
    suffixes = {tuple(r.prompt_token_ids[20:]) for r in requests}
    assert len(suffixes) == 12


def test_deterministic_by_seed_and_shuffled():
    config = PrefixRepetitionConfig(prefix_len=8, suffix_len=4, num_prefixes=2, num_prompts=8)
    first = prefix_repetition(config, 500)
    assert first == prefix_repetition(config, 500)
    other = prefix_repetition(PrefixRepetitionConfig(prefix_len=8, suffix_len=4, num_prefixes=2,
                                                     num_prompts=8, seed=3), 500)
    assert first != other
    unshuffled = prefix_repetition(
        PrefixRepetitionConfig(prefix_len=8, suffix_len=4, num_prefixes=2, num_prompts=8,
                               shuffle=False), 500)
    assert [r.prefix_index for r in unshuffled] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_oracle_counts_whole_shared_blocks():
    config = PrefixRepetitionConfig(prefix_len=16, suffix_len=5, num_prefixes=2,
                                    num_prompts=6, shuffle=False)
    requests = prefix_repetition(config, 1000)
    # per prefix: the first prompt hits nothing, the two others 16 tokens each (B = 4)
    assert oracle_hit_tokens(requests, 4) == 2 * 2 * 16
    assert oracle_hit_tokens(requests, 32) == 0


@pytest.mark.parametrize("field,value", [("num_prefixes", 0), ("output_len", 0),
                                         ("prefix_len", -1), ("num_prompts", 1)])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=field):
        PrefixRepetitionConfig(**{"num_prefixes": 2, "num_prompts": 4, field: value})


def test_jsonl(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "1 2 3"}) + "\n\n"
                    + json.dumps({"prompt_token_ids": [4, 5], "output_len": 3}) + "\n")
    requests = load_jsonl(path, WordTokenizer(), default_output_len=9)
    assert [(r.prompt_token_ids, r.output_len) for r in requests] == [([1, 2, 3], 9), ([4, 5], 3)]
    path.write_text("{oops\n")
    with pytest.raises(ValueError, match="not JSON"):
        load_jsonl(path, WordTokenizer(), 1)
