"""The `speckv` command, run as a real subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys


def speckv(*args, env=None):
    return subprocess.run([sys.executable, "-m", "speckv.cli", *args], capture_output=True,
                          text=True, env={**os.environ, **(env or {})}, timeout=120)


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
