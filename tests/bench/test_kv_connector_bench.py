"""`speckv bench kv-connector` on a tiny random model: the TTFT cases take their hits from where
they say (local cache, CPU tier, disk tier, the shared store), the step-time engines store
blocks and agree on greedy outputs; bad arguments are refused before a model loads."""

from __future__ import annotations

import argparse
import random

import pytest

from speckv.bench import kv_connector
from speckv.drafters.loaders import random_drafter


@pytest.fixture(scope="module")
def drafter(tiny_model):
    return random_drafter("eagle", tiny_model, init_std=0.2, seed=6)


def test_ttft_cases_hit_where_they_say(tiny_model, drafter, tmp_path):
    prompt = [random.Random(2).randrange(96) for _ in range(96)]
    rows = kv_connector.measure_ttft(tiny_model, drafter, prompt, repeats=2,
                                     directory=str(tmp_path))
    assert [row.case for row in rows] == list(kv_connector.TTFT_CASES)
    assert [(row.cached_tokens, row.tier_tokens) for row in rows] == [
        (0, 0), (80, 0), (80, 80), (80, 80), (80, 80)]
    assert all(row.ttft_ms > 0 for row in rows)


def test_ttft_cases_follow_the_tiers(tiny_model, drafter, tmp_path):
    prompt = [random.Random(2).randrange(96) for _ in range(48)]
    rows = kv_connector.measure_ttft(tiny_model, drafter, prompt, repeats=1,
                                     directory=str(tmp_path), tiers=("store",))
    assert [row.case for row in rows] == ["cold", "local hit", "store hit"]
    assert rows[2].tier_tokens == rows[2].cached_tokens == 32


def test_step_time_engines_store_and_agree(tiny_model, drafter, tmp_path):
    rng = random.Random(3)
    prompts = [[rng.randrange(96) for _ in range(20)] for _ in range(3)]
    rows = kv_connector.measure_steps(tiny_model, drafter, prompts, output_tokens=24, rounds=2,
                                      directory=str(tmp_path))
    assert [row.connector for row in rows] == ["none", "offload", "offload,disk", "store"]
    assert rows[0].stored_blocks == 0 and rows[1].stored_blocks > 0
    assert rows[2].stored_blocks == 2 * rows[1].stored_blocks  # written through to both
    assert rows[3].stored_blocks == rows[1].stored_blocks
    assert rows[0].vs_none == 1.0 and len({row.steps for row in rows}) == 1


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parts": "ttft,speed"}, "--parts"),
    ({"prompt_tokens": 100}, "--prompt-tokens"),
    ({"rounds": 0}, "--rounds"),
    ({"tiers": "offload,tape"}, "--tiers"),
])
def test_bad_arguments_are_refused(overrides, message):
    parser = argparse.ArgumentParser()
    kv_connector.add_arguments(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    with pytest.raises(ValueError, match=message):
        kv_connector.run(args)
