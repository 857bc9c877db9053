"""`--vs-vllm` on `speckv bench hash` / `bench cache`: without vLLM it says why and skips.

vLLM is never a dependency, so these tests hide it (a `None` entry in `sys.modules` makes the
import fail exactly as an absent package does); the with-vLLM path is measured by hand in a
scratch environment (see speckv/bench/vllm_peer.py). The shared timing helper is tested here.
"""

from __future__ import annotations

import argparse
import sys

import pytest

from speckv.bench import cache_ops, hash_cost, vllm_peer


@pytest.fixture
def no_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_load_vllm_reports_why(no_vllm: None) -> None:
    modules, reason = vllm_peer.load_vllm()
    assert modules is None
    assert "vllm is not importable" in reason
    message = vllm_peer.skip_message(reason)
    assert message.startswith("--vs-vllm skipped: vllm is not importable")
    assert "scratch environment" in message


@pytest.mark.parametrize("module", [hash_cost, cache_ops])
def test_vs_vllm_skips_with_a_message(module, no_vllm: None,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(module, "--vs-vllm", "--quick")
    assert args.vs_vllm
    assert module.run(args) == 0
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())  # rich may wrap the line
    assert "--vs-vllm skipped: vllm is not importable here" in text


@pytest.mark.parametrize("module", [hash_cost, cache_ops])
def test_vs_vllm_json_skip_keeps_stdout_clean(module, no_vllm: None,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert module.run(_args(module, "--vs-vllm", "--quick", "--json")) == 0
    out = capsys.readouterr()
    assert out.out == ""  # the message goes to stderr: stdout stays parseable
    assert "skipped" in out.err


def test_time_side_by_side_times_every_call_and_restores_gc() -> None:
    import gc

    counts = {"a": 0, "b": 0}

    def call(name: str):
        def run() -> None:
            counts[name] += 1
        return run

    assert gc.isenabled()
    ms = vllm_peer.time_side_by_side({"a": call("a"), "b": call("b")}, rounds=3,
                                     calls_per_round=2)
    assert set(ms) == {"a", "b"} and all(value >= 0 for value in ms.values())
    assert counts == {"a": 6, "b": 6}
    assert gc.isenabled()


def test_ratio_and_same_hashes() -> None:
    assert vllm_peer.ratio(6.0, 2.0) == 3.0
    assert vllm_peer.same_hashes([b"a", b"b"], [b"a", b"b"])
    assert not vllm_peer.same_hashes([b"a"], [b"a", b"b"])
    assert not vllm_peer.same_hashes([b"a", b"c"], [b"a", b"b"])
