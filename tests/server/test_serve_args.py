"""`speckv serve`'s engine flags: sizes, speculative defaults (as `speckv generate`), vLLM's
--speculative-config, and the flags -> command line -> flags round trip `bench serve` relies
on to launch a server with the same engine it builds in process."""

from __future__ import annotations

import argparse

import pytest

from speckv.engine.cli_args import (
    engine_args_from_cli,
    engine_flags,
    parse_size,
    speculative_kwargs,
)
from speckv.server.cli import add_arguments


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_sizes():
    assert parse_size("536870912") == 512 * 1024**2
    assert parse_size("512M") == parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5g") == int(1.5 * 1024**3)
    for bad in ("", "12Q", "-1M", "M"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)


def test_speculative_defaults_follow_generate(tmp_path):
    from speckv.drafters.builtin import builtin_speculation_pays

    shipped = {"speculative_method": "eagle3", "num_spec_tokens": 3,
               "speculative_model": "builtin"}
    # the shipped head is on by default only where its recorded benchmark is faster
    assert speculative_kwargs("builtin", None, None, 3, None) == (
        shipped if builtin_speculation_pays() else {})
    assert speculative_kwargs("builtin", "eagle3", None, 3, None) == shipped
    with pytest.raises(ValueError, match="no built-in EAGLE drafter"):
        speculative_kwargs("builtin", "eagle", None, 3, None)
    assert speculative_kwargs("/some/dir", None, None, 3, None) == {}
    assert speculative_kwargs("builtin", "none", None, 3, None) == {}
    assert speculative_kwargs("/d", "ngram", None, 2, None) == {
        "speculative_method": "ngram", "num_spec_tokens": 2, "speculative_model": None}
    with pytest.raises(ValueError, match="needs --speculative-model"):
        speculative_kwargs("/some/dir", "mtp", None, 3, None)
    head = str(tmp_path)  # the drafter's path is checked before any model loads
    config = {"method": "eagle3", "model": head, "num_speculative_tokens": 5}
    assert speculative_kwargs("/d", None, None, 3, config) == {
        "speculative_method": "eagle3", "num_spec_tokens": 5, "speculative_model": head}
    with pytest.raises(ValueError, match="--speculative-model /heads/e3: no such file"):
        speculative_kwargs("/d", None, None, 3, {**config, "model": "/heads/e3"})
    for bad in ({"model": "x"}, {"method": "eagle", "temperature": 1}, {"method": "medusa"}):
        with pytest.raises(ValueError, match="speculative-config"):
            speculative_kwargs("/d", None, None, 3, bad)


def test_engine_flags_round_trip():
    args = _parse("/models/m", "--port", "9000", "--block-size", "32", "--kv-cache-memory-bytes",
                  "1G", "--max-model-len", "4096", "--drafter", "ngram", "--num-spec-tokens",
                  "4", "--no-enable-prefix-caching", "--prefix-caching-hash-algo", "xxhash",
                  "--kv-events-endpoint", "tcp://*:5557", "--threads", "1",
                  "--prefill-threads", "2", "--disable-lookahead-block-hashes")
    again = _parse(*engine_flags(args))
    assert engine_args_from_cli(again) == engine_args_from_cli(args)
    engine_args = engine_args_from_cli(args)
    assert engine_args.kv_cache_memory_bytes == 1024**3
    assert engine_args.enable_prefix_caching is False and engine_args.hash_algo == "xxhash"
    assert engine_args.kv_events_endpoint == "tcp://*:5557"
    assert again.threads == 1 and again.model == "/models/m"
    assert engine_args.threads == 1 and engine_args.prefill_threads == 2


def test_kv_connector_flags_reach_the_engine_and_round_trip(tmp_path):
    args = _parse("--kv-connector", "offload,disk", "--kv-offload-dir", str(tmp_path),
                  "--kv-offload-gib", "0.5", "--hash-seed", "0")
    engine_args = engine_args_from_cli(args)
    connector = engine_args.kv_connector_config
    assert connector is not None and connector.names == ("offload", "disk")
    assert connector.offload_gib == 0.5 and connector.offload_dir == str(tmp_path)
    assert engine_args.hash_seed == "0"
    assert engine_args_from_cli(_parse(*engine_flags(args))) == engine_args
    config = engine_args.create_engine_config()
    assert config.kv_connector == connector
    with pytest.raises(ValueError, match="--kv-connector"):
        engine_args_from_cli(_parse("--kv-connector", "tape"))
    with pytest.raises(ValueError, match="--kv-offload-dir needs --kv-connector disk"):
        engine_args_from_cli(_parse("--kv-offload-dir", str(tmp_path)))


def test_serve_leaves_one_core_to_the_http_server() -> None:
    from speckv.server.cli import serve_threads

    assert serve_threads(None, 2) == 1  # this 2-core machine: one compute thread, as vLLM
    assert serve_threads(None, 16) == 15
    assert serve_threads(None, 1) == 1
    assert serve_threads(3, 2) == 3  # --threads wins
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        serve_threads(0, 2)


def test_serve_prefills_on_every_core() -> None:
    from speckv.server.cli import serve_prefill_threads

    assert serve_prefill_threads(None, 1, 2) == 2  # the server's core computes prefills
    assert serve_prefill_threads(None, 4, 2) == 4  # never fewer than --threads
    assert serve_prefill_threads(1, 1, 2) == 1  # --prefill-threads wins
    assert serve_prefill_threads(3, 1, 2) == 3
