"""`speckv bench kv-tiers` and `speckv bench kv-store` on a small prompt: every tier stores the
prompt's target + draft KV and loads it back bit-exact into other blocks (the shared harness
asserts it), and the store's rows carry its peer, the redis-py GET loop of the same values."""

from __future__ import annotations

import pytest
import torch

from speckv.bench import kv_store, kv_tiers


@pytest.mark.parametrize("tier", ["offload", "disk"])
def test_a_tier_loads_what_it_stored(tier, tmp_path):
    row = kv_tiers.measure(tier, "float32", 64, 16, 1, torch.device("cpu"), str(tmp_path))
    assert row["blocks"] == 4 and row["load_gbps"] > 0 and row["copy_gbps"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_store_loads_what_it_stored_beside_a_get_loop(dtype):
    row = kv_store.measure_embedded(dtype, 64, 16, 1, torch.device("cpu"))
    assert row["blocks"] == 4
    # a value is the codec header plus the raw target + draft KV of its block
    assert row["value_mb"] > row["mb"]
    assert row["load_gbps"] > 0 and row["get_gbps"] > 0 and row["mget_gbps"] > 0
