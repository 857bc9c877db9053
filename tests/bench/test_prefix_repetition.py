"""The prefix_repetition benchmark on a tiny random model with a random EAGLE drafter."""

from __future__ import annotations

import pytest

from speckv.bench.prefix_repetition import (
    RunOptions,
    outputs_identical,
    run_benchmark,
    write_chart,
)
from speckv.drafters.loaders import random_drafter
from speckv.models.llama.tiny import tiny_model
from speckv.workloads import PrefixRepetitionConfig, prefix_repetition


@pytest.fixture(scope="module")
def model_and_drafter():
    model = tiny_model(seed=7)
    return model, random_drafter("eagle", model, init_std=0.2, seed=3)


def test_four_modes_hit_rates_and_identical_outputs(model_and_drafter, tmp_path):
    model, drafter = model_and_drafter
    # prefix 10 is not block aligned: lookahead keeps block [4, 8) (its successor token 8
    # is still in the shared prefix); the legacy drop recomputes it
    workload = prefix_repetition(
        PrefixRepetitionConfig(prefix_len=10, suffix_len=5, num_prefixes=2, output_len=6,
                               num_prompts=6, seed=1), vocab_size=96)
    options = RunOptions(block_size=4, num_blocks=64, num_spec_tokens=2,
                         max_concurrency=1, progress=False)
    no_spec, legacy, lookahead, reuse = run_benchmark(model, drafter, workload, options)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    # per prefix: the first prompt misses, the two others hit 8 tokens (legacy: 4)
    assert no_spec.hit_rate == pytest.approx(4 * 8 / prompt_tokens)
    assert lookahead.hit_rate == no_spec.hit_rate == no_spec.oracle_hit_rate
    assert reuse.hit_rate == lookahead.hit_rate  # nothing diverges at a boundary here
    assert legacy.hit_rate == pytest.approx(no_spec.hit_rate - 4 * 4 / prompt_tokens)
    assert (lookahead.hash_mode, legacy.hash_mode) == ("lookahead L=1", "legacy+drop")
    assert outputs_identical([no_spec, legacy, lookahead, reuse])
    assert all(len(tokens) == 6 for tokens in no_spec.outputs)
    assert lookahead.acceptance_rate is not None and no_spec.acceptance_rate is None
    write_chart([no_spec, legacy, lookahead, reuse], tmp_path / "chart.png", "4 modes")
    assert (tmp_path / "chart.png").stat().st_size > 1000


def test_block_reuse_hits_a_prefix_of_whole_blocks(model_and_drafter):
    """Prefix 8 = two whole blocks: block [4, 8)'s successor differs between prompts, so
    lookahead alone hits one block, as the legacy drop; block reuse copies it and recomputes
    its last position: the no-spec hit minus one token. Greedy outputs identical."""
    model, drafter = model_and_drafter
    workload = prefix_repetition(
        PrefixRepetitionConfig(prefix_len=8, suffix_len=5, num_prefixes=2, output_len=6,
                               num_prompts=6, seed=1), vocab_size=96)
    options = RunOptions(block_size=4, num_blocks=64, num_spec_tokens=2,
                         max_concurrency=1, progress=False)
    no_spec, legacy, lookahead, reuse = run_benchmark(model, drafter, workload, options)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    # per prefix: the first prompt misses, the two others hit 8 (lookahead, legacy: 4;
    # block reuse: 7)
    assert no_spec.hit_rate == pytest.approx(4 * 8 / prompt_tokens) == no_spec.oracle_hit_rate
    assert lookahead.hit_rate == legacy.hit_rate == pytest.approx(4 * 4 / prompt_tokens)
    assert reuse.hit_rate == pytest.approx(4 * 7 / prompt_tokens)
    assert outputs_identical([no_spec, legacy, lookahead, reuse])


@pytest.mark.parametrize("tier", ["offload", "disk"])
def test_a_tier_brings_the_hit_rate_back_to_the_oracle(model_and_drafter, tier, tmp_path):
    """A local cache that holds about one request: evicted prefixes come back from the tier.
    Lookahead = oracle = no spec; the legacy drop loses one block per hit; without the tier,
    the lookahead hit rate falls. Greedy outputs identical across all four."""
    model, drafter = model_and_drafter
    # prefix 14: blocks [0, 12) shared, and block [8, 12)'s successor (token 12) is shared too
    workload = prefix_repetition(
        PrefixRepetitionConfig(prefix_len=14, suffix_len=5, num_prefixes=3, output_len=4,
                               num_prompts=9, seed=2), vocab_size=96)
    options = RunOptions(block_size=4, num_blocks=9, num_spec_tokens=2, max_concurrency=1,
                         progress=False, kv_connector=tier, kv_offload_gib=0.01,
                         kv_offload_disk_gib=0.01,
                         kv_offload_dir=str(tmp_path) if tier == "disk" else None)
    no_spec, legacy, lookahead, no_tier = run_benchmark(model, drafter, workload, options)
    assert no_tier.mode == "lookahead, no tier" and no_tier.tier == "-"
    assert lookahead.tier == tier and lookahead.hash_mode == "lookahead L=1"
    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    # per prefix: the first prompt misses, the two others hit 12 tokens (legacy: 8)
    assert no_spec.hit_rate == pytest.approx(6 * 12 / prompt_tokens)
    assert lookahead.hit_rate == no_spec.hit_rate == lookahead.oracle_hit_rate
    assert legacy.hit_rate == pytest.approx(no_spec.hit_rate - 6 * 4 / prompt_tokens)
    assert no_tier.hit_rate < lookahead.hit_rate
    assert lookahead.tier_hit_rate > 0 and no_tier.tier_hit_rate == 0
    assert outputs_identical([no_spec, legacy, lookahead, no_tier])
