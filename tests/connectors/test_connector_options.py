"""The connector options are spelled once (`ConnectorConfig`'s field metadata): each one's CLI
flag, its `EngineArgs` keyword and its config field stay the same option."""

from __future__ import annotations

import argparse
from dataclasses import fields

from speckv.connectors.config import (
    add_connector_arguments,
    connector_config_from_args,
    connector_flags,
    option_default,
    options,
)
from speckv.engine.engine_args import EngineArgs, engine_config

VALUES = {"offload_gib": 0.5, "offload_dir": "/tmp/kv", "disk_gib": 3.0,
          "store_url": "redis://127.0.0.1:1/0", "store_gib": 2.0, "store_cluster": True,
          "store_optional": True, "store_timeout_s": 0.25}


def test_every_option_is_a_flag_and_an_engine_keyword_with_one_default():
    engine_defaults = {f.name: f.default for f in fields(EngineArgs)}
    assert {option.name for option in options()} == set(VALUES)
    for option in options():
        assert engine_defaults[option.metadata["arg"]] == option_default(option), option.name


def test_flags_and_keywords_set_the_same_config():
    parser = argparse.ArgumentParser()
    add_connector_arguments(parser)
    line = ["--kv-connector", "offload,disk,store"]
    for option in options():
        value = VALUES[option.name]
        line += [option.metadata["flag"]] if value is True else [option.metadata["flag"],
                                                                  str(value)]
    from_flags = connector_config_from_args(parser.parse_args(line))
    from_keywords = engine_config(kv_connector="offload,disk,store", hash_seed="0", **{
        option.metadata["arg"]: VALUES[option.name] for option in options()}).kv_connector
    assert from_flags == from_keywords
    assert {name: getattr(from_flags, name) for name in VALUES} == VALUES
    # what `engine_flags` writes back parses to the same config
    again = parser.parse_args(["--kv-connector", "offload,disk,store",
                               *connector_flags(parser.parse_args(line))])
    assert connector_config_from_args(again) == from_flags
    alias = parser.parse_args(["--kv-connector", "offload", "--kv-offloading-size", "1.5"])
    assert connector_config_from_args(alias).offload_gib == 1.5  # vLLM's name
