"""`--kv-transfer-config` in vLLM's shape: one JSON names any registered connector (the NIXL
transfer, a tier, or a MultiConnector of them), the load-failure policy once; the engine
builds what it names exactly as the equivalent flags would."""

from __future__ import annotations

import json

import pytest

from speckv.connectors.nixl.transport import nixl_available
from speckv.connectors.transfer_config import KVTransferConfig
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine


def _multi(*children: dict, **top) -> str:
    return json.dumps({"kv_connector": "MultiConnector", "kv_role": "kv_consumer",
                       "kv_connector_extra_config": {"connectors": list(children)}, **top})


def test_a_tier_named_in_the_json_is_the_same_as_its_flags():
    text = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"kv_offload_gib": 0.5}})
    config = engine_config(kv_transfer_config=text)
    assert config.kv_transfer is None
    assert config.kv_connector == engine_config(kv_connector="offload",
                                                kv_offload_gib=0.5).kv_connector


def test_a_multi_connector_splits_into_tiers_and_one_transfer_with_one_policy():
    text = _multi({"kv_connector": "offload", "kv_connector_extra_config": {
                       "kv_offload_gib": 0.25}},
                  {"kv_connector": "disk", "kv_connector_extra_config": {
                      "kv_offload_dir": "/tmp/kv", "kv_offload_disk_gib": 2}},
                  {"kv_connector": "nixl", "kv_lease_s": 5},
                  kv_load_failure_policy="fail")
    config = engine_config(kv_transfer_config=text, hash_seed="0")
    assert config.kv_connector.names == ("offload", "disk")
    assert (config.kv_connector.offload_gib, config.kv_connector.offload_dir,
            config.kv_connector.disk_gib) == (0.25, "/tmp/kv", 2.0)
    assert config.kv_transfer.kv_connector == "nixl" and config.kv_transfer.is_consumer
    assert config.kv_transfer.options.lease_s == 5
    assert config.kv_load_failure_policy == "fail"


@pytest.mark.parametrize(("text", "words"), [
    ('{"kv_connector": "lmcache", "kv_role": "kv_both"}', "'nixl', 'NixlConnector'"),
    ('{"kv_connector": "offload", "kv_role": "kv_both", "kv_connector_extra_config": '
     '{"kv_offload_gb": 1}}', r"unknown key\(s\) \['kv_offload_gb'\] for offload"),
    ('{"kv_connector": "offload", "kv_role": "kv_both", "kv_connector_extra_config": '
     '{"kv_offload_gib": -1}}', "--kv-offload-gib must be a number > 0"),
    (_multi({"kv_connector": "nixl"}, {"kv_connector": "NixlConnector"}),
     "one transfer connector at most"),
    (_multi({"kv_connector": "MultiConnector", "kv_connector_extra_config": {
        "connectors": [{"kv_connector": "offload"}]}}), "nest one level"),
    ('{"kv_connector": "MultiConnector", "kv_role": "kv_both"}', "needs kv_connector_extra"),
    ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_load_failure_policy": "drop"}',
     "kv_load_failure_policy must be one of recompute, fail"),
    # the generic checks, shared with the nixl connector's own parse
    ("{not json", "--kv-transfer-config is not JSON"),
    ('["nixl"]', "--kv-transfer-config must be a JSON object"),
    ('{"kv_connector": "disk"}', "needs kv_role"),
    ('{"kv_connector": "nixl", "kv_role": "both"}', "kv_role must be one of kv_producer"),
    ('{"kv_connector": "disk", "kv_role": "kv_both", "kv_connector_extra_config": [1]}',
     "kv_connector_extra_config must be a JSON object"),
    ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_connector_extra_config": 3}',
     "kv_connector_extra_config must be a JSON object"),
    ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_connector_extra_config": '
     '{"kv_peer": []}}', r"extra_config: unknown key\(s\) \['kv_peer'\]; known: kv_peers"),
    ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_lease": 5}',
     r"config: unknown key\(s\) \['kv_lease'\]; known: kv_connector"),
])
def test_a_bad_json_is_refused_naming_its_key(text, words):
    with pytest.raises(ValueError, match=words):
        KVTransferConfig.parse(text)


def test_tiers_in_the_json_and_in_the_flags_are_refused_together():
    text = json.dumps({"kv_connector": "offload", "kv_role": "kv_both"})
    with pytest.raises(ValueError, match="and --kv-connector too"):
        engine_config(kv_transfer_config=text, kv_connector="offload")


@pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")
def test_the_engine_builds_what_a_multi_connector_json_names(tiny_model):
    text = _multi({"kv_connector": "offload", "kv_connector_extra_config": {
        "kv_offload_gib": 0.01}}, {"kv_connector": "nixl"})
    config = engine_config(block_size=4, num_blocks=32, hash_seed="0",
                           kv_transfer_config=text)
    with LLMEngine(tiny_model, config, detokenize=False) as engine:
        assert set(engine.kv_connector_stats()) == {"offload", "nixl"}
        assert any("kv_consumer" in line for line in engine.connector.startup_lines())
