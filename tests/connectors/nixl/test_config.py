"""`--kv-transfer-config` and the P/D router's flags: bad input is refused in the user's words."""

import argparse

import pytest

from speckv.commands.router import add_arguments, build_pd_router
from speckv.connectors.nixl.config import NixlConfig
from speckv.engine.engine_args import engine_config
from speckv.router.pd import PDConfig, prefill_body


def test_the_transfer_config_parses_and_names_a_bad_key() -> None:
    config = NixlConfig.parse('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_port": 0}',
                              host="10.0.0.2")
    assert config.is_producer and config.is_consumer and config.host == "10.0.0.2"
    for text, words in [('{"kv_connector": "nixl"}', "kv_role"),
                        ('{"kv_connector": "lmcache", "kv_role": "kv_both"}', "kv_connector"),
                        ('{"kv_connector": "nixl", "kv_role": "both"}', "kv_role"),
                        ('{"kv_connector": "nixl", "kv_role": "kv_both", "x": 1}', "x"),
                        ('{"kv_connector": "nixl", "kv_role": "kv_both", "kv_lease_s": 0}',
                         "kv_lease_s"),
                        ("{not json", "not JSON")]:
        with pytest.raises(ValueError, match=words):
            NixlConfig.parse(text)


def test_the_engine_needs_a_reproducible_hash_seed_and_takes_the_jsons_policy(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    text = '{"kv_connector": "nixl", "kv_role": "kv_consumer", "kv_load_failure_policy": "fail"}'
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        engine_config(kv_transfer_config=text)
    assert engine_config(kv_transfer_config=text, hash_seed="0").kv_load_failure_policy == "fail"


def test_the_pd_router_flags_and_the_prefill_body() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="--decode"):
        build_pd_router(parser.parse_args(["--prefill", "http://127.0.0.1:1"]))
    with pytest.raises(ValueError, match="--prefill 'localhost'"):
        build_pd_router(parser.parse_args(["--prefill", "localhost", "--decode",
                                           "http://127.0.0.1:2"]))
    with pytest.raises(ValueError, match="names must be unique"):
        build_pd_router(parser.parse_args(["--prefill", "x=http://127.0.0.1:1", "--decode",
                                           "x=http://127.0.0.1:2"]))
    with pytest.raises(ValueError, match="expected \\[NAME=\\]http://HOST:PORT"):
        build_pd_router(parser.parse_args(["--prefill", "=http://127.0.0.1:1", "--decode",
                                           "http://127.0.0.1:2"]))
    config = PDConfig(("http://127.0.0.1:1",), ("http://127.0.0.1:2", "http://127.0.0.1:3"),
                      decode_names=("fast", "slow"))
    assert (config.prefill_names, config.decode_names) == (("prefill0",), ("fast", "slow"))
    body = prefill_body({"prompt": "x", "max_tokens": 50, "stream": True,
                         "stream_options": {"include_usage": True}})
    assert body == {"prompt": "x", "max_tokens": 1,
                    "kv_transfer_params": {"do_remote_decode": True}}
