"""`speckv events` and `speckv route`: publish-sample feeds tail over real sockets; user errors
exit 2 with one line on stderr; the events benchmark runs small and prints JSON."""

from __future__ import annotations

import argparse
import json
import threading

import pytest

from speckv import cli
from speckv.bench import events as bench
from speckv.commands import events
from speckv.events.endpoints import loopback_endpoint
from tests.patience import WATCHDOG_S


def parse(add, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)


def test_publish_sample_then_tail(capsys):
    pub, replay = loopback_endpoint(), loopback_endpoint()
    publish_args = parse(events.add_publish_sample_arguments, [
        "--endpoint", pub, "--replay-endpoint", replay, "--block-size", "8", "--num-blocks", "24",
        "--requests", "6", "--lookahead", "3", "--linger", "3", "--delay", "0", "--seed", "0",
    ])
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(events.run_publish_sample(publish_args)))
    thread.start()
    try:
        tail_args = parse(events.add_tail_arguments, [
            "--endpoint", pub, "--replay-endpoint", replay, "--timeout", "1.5",
        ])
        assert events.run_tail(tail_args) == 0
    finally:
        thread.join(timeout=WATCHDOG_S)
    assert codes == [0]
    lines = capsys.readouterr().out.splitlines()
    printed = [line for line in lines if line.startswith("seq=")]
    assert any("BlockStored" in line and "lookahead=[[" in line for line in printed)
    assert any("BlockRemoved" in line for line in printed)
    assert printed[-1].endswith("AllBlocksCleared")
    assert any("lora=sample-adapter" in line for line in printed)


@pytest.mark.parametrize(("argv", "message"), [
    (["events", "tail", "--endpoint", "localhost:1"], "not a ZeroMQ"),
    (["events", "tail", "--count", "0"], "--count"),
    (["events", "publish-sample", "--lookahead", "-1", "--endpoint", "tcp://127.0.0.1:1",
      "--replay-endpoint", "tcp://127.0.0.1:2", "--seed", "0"], "lookahead"),
    (["events", "publish-sample", "--endpoint", "tcp://256.1.1.1:1", "--replay-endpoint",
      "tcp://127.0.0.1:2", "--seed", "0"], "ZeroMQ"),
    (["route", "--engines", "a", "--block-size", "16", "--seed", "0"], "NAME=PUB"),
    (["route", "--engines", "a=tcp://127.0.0.1:1", "--block-size", "0", "--seed", "0"],
     "--block-size"),
    (["route", "--engines", "a=tcp://127.0.0.1:1", "--block-size", "16", "--seed", "0",
      "--lora", "x"], "NAME=PATH"),
])
def test_user_errors_exit_2_with_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("speckv: error:") and message in err[0]


@pytest.mark.parametrize("argv", [
    ["route", "--engines", "a=tcp://127.0.0.1:1", "--block-size", "16"],
    ["events", "publish-sample", "--endpoint", "tcp://127.0.0.1:1",
     "--replay-endpoint", "tcp://127.0.0.1:2"],
    ["hash", "--block-size", "2", "--tokens", "1,2,3"],
])
def test_one_seed_rule_no_seed_is_an_error(argv, monkeypatch, capsys):
    """Every hashing command: --seed, else PYTHONHASHSEED, else an error."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert cli.main(argv) == 2
    assert "no hash seed: pass --seed or set PYTHONHASHSEED" in capsys.readouterr().err


def test_bench_json_small(capsys):
    args = parse(bench.add_arguments, ["--batches", "200", "--router-events", "20",
                                       "--workload-requests", "4", "--repeats", "1", "--json"])
    assert bench.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["publisher"]["dropped_batches"] == 0
    assert out["router"]["mismatched_blocks"] == 0
    assert out["router"]["verified_blocks"] == 20 * bench.BLOCKS_PER_EVENT
    assert out["overhead"]["ratio_on_off"] > 0
