"""`speckv bench prefix-repetition --engines 2 --kv-connector store`: two engine processes,
requests alternating between them, one embedded store. Lookahead reaches the single-engine
oracle through the store, the legacy drop loses one block per hit, without the store each
engine misses what the other computed; greedy outputs identical across modes."""

from __future__ import annotations

import pytest

from speckv.bench.prefix_repetition import RunOptions, outputs_identical, run_benchmark
from speckv.cluster.engine_pool import ModelSpec
from speckv.workloads import PrefixRepetitionConfig, oracle_hit_tokens, prefix_repetition
from tests.bench.engine_models import TINY_EAGLE, tiny_eagle


def test_two_engines_share_one_store():
    model, drafter = tiny_eagle()
    # prefix 14: blocks [0, 12) shared, and block [8, 12)'s successor (token 12) is shared too
    workload = prefix_repetition(
        PrefixRepetitionConfig(prefix_len=14, suffix_len=5, num_prefixes=3, output_len=4,
                               num_prompts=9, seed=2), vocab_size=96)
    options = RunOptions(block_size=4, num_blocks=64, num_spec_tokens=2, max_concurrency=1,
                         progress=False, kv_connector="store", kv_store_gib=0.05,
                         num_engines=2)
    no_spec, legacy, lookahead, no_store = run_benchmark(
        model, drafter, workload, options, model_spec=ModelSpec(factory=TINY_EAGLE))
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    assert all(r.num_engines == 2 for r in (no_spec, legacy, lookahead, no_store))
    assert lookahead.tier == "store" and no_store.tier == "-"
    assert (lookahead.hash_mode, legacy.hash_mode) == ("lookahead L=1", "legacy+drop")
    # per prefix: the first prompt misses, the two others hit 12 tokens (legacy: 8), whichever
    # engine computed the prefix
    assert no_spec.hit_rate == pytest.approx(6 * 12 / prompt_tokens)
    assert lookahead.hit_rate == no_spec.hit_rate == lookahead.oracle_hit_rate
    assert legacy.hit_rate == pytest.approx(no_spec.hit_rate - 6 * 4 / prompt_tokens)
    assert lookahead.tier_hit_rate > 0
    # no store: each engine hits only what it computed itself
    alone = oracle_hit_tokens(workload[0::2], 4) + oracle_hit_tokens(workload[1::2], 4)
    assert no_store.hit_rate == pytest.approx(alone / prompt_tokens)
    assert no_store.hit_rate < lookahead.hit_rate
    assert no_store.tier_hit_rate == 0
    assert outputs_identical([no_spec, legacy, lookahead, no_store])
    assert all(len(tokens) == 4 for tokens in lookahead.outputs)
