"""The nested engine configuration: flat `EngineArgs` (what `LLM(...)` and the CLI set) ->
validated `EngineConfig` sub-configs, the KV cache plan and the start-up engine check."""

from __future__ import annotations

import pytest

from speckv.attention import bytes_per_block
from speckv.connectors.config import CONNECTORS, ConnectorConfig
from speckv.engine.config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from speckv.engine.engine_args import EngineArgs
from speckv.engine.kv_plan import plan_kv_cache
from speckv.engine.llm_engine import LLMEngine


def test_flat_args_become_the_nested_config():
    config = EngineArgs(block_size=8, num_blocks=64, max_num_seqs=5, speculative_method="ngram",
                        num_spec_tokens=2, kv_connector="offload", kv_offload_gib=0.5,
                        kv_events_endpoint="inproc://e").create_engine_config()
    assert config.cache == CacheConfig(block_size=8, num_blocks=64)
    assert config.scheduler == SchedulerConfig(max_num_seqs=5)
    assert config.speculative == SpeculativeConfig("ngram", 2)
    assert config.kv_connector == ConnectorConfig(("offload",), offload_gib=0.5)
    assert config.events is not None and config.events.endpoint == "inproc://e"
    assert config.num_spec_tokens == 2


def test_no_speculation_is_none_and_defaults_are_the_default_config():
    assert EngineArgs().create_engine_config() == EngineConfig()
    assert EngineConfig().speculative is None and EngineConfig().num_spec_tokens == 0


def test_a_parsed_connector_config_is_taken_whole():
    connector = ConnectorConfig(("offload",), offload_gib=0.25)
    config = EngineArgs(kv_connector_config=connector).create_engine_config()
    assert config.kv_connector is connector
    with pytest.raises(ValueError, match="not both"):
        EngineArgs(kv_connector_config=connector, kv_connector="offload").create_engine_config()


def test_sub_configs_validate_themselves():
    with pytest.raises(ValueError, match="mamba_block_size"):
        CacheConfig(block_size=16, mamba_block_size=24)
    with pytest.raises(ValueError, match="num_spec_tokens must be <= 16"):
        SpeculativeConfig("eagle", 17)
    with pytest.raises(ValueError, match="max_num_batched_tokens must fit one decode step"):
        EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=2),
                     speculative=SpeculativeConfig("ngram", 3))


def test_the_test_connector_is_not_a_user_facing_name():
    # tests/conftest.py registers "offload-nolookahead"; the shipped table has the three tiers
    shipped = {name for name, entry in CONNECTORS.items()
               if entry.build.__module__ == "speckv.connectors.config"}
    assert shipped == {"offload", "disk", "store"}


def test_kv_cache_plan_counts_the_drafters_layers(tiny_model):
    c = tiny_model.config
    per_block = bytes_per_block(c.num_hidden_layers + 1, 4, c.num_key_value_heads, c.head_dim,
                                tiny_model.dtype)
    plan = plan_kv_cache(tiny_model, block_size=4, num_blocks=None,
                         budget_bytes=10 * per_block + 1, state_block_size=None,
                         num_draft_layers=1)
    assert (plan.num_blocks, plan.bytes_per_block, plan.budget_bytes) == (10, per_block,
                                                                           10 * per_block + 1)
    assert plan.token_capacity(4) == 9 * 4
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        plan_kv_cache(tiny_model, block_size=4, num_blocks=None, budget_bytes=per_block,
                      state_block_size=None, num_draft_layers=1)


def test_engine_check_speaks_the_users_words(tiny_model):
    config = EngineArgs(block_size=4, num_blocks=16, mamba_block_size=8).create_engine_config()
    with pytest.raises(ValueError, match="mamba_block_size applies to models with a GDN"):
        LLMEngine(tiny_model, config)
    too_long = EngineArgs(num_blocks=16, max_model_len=10**6).create_engine_config()
    with pytest.raises(ValueError, match="more than the model's context"):
        LLMEngine(tiny_model, too_long)
