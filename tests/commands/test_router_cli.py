"""`speckv router`'s flags: bad ones are one-line errors naming the flag, before any engine
is contacted; an unreachable engine is named with its URL."""

from __future__ import annotations

import pytest

from speckv.cli import main
from speckv.commands.router import parse_engines


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "a=nope"], "--engine 'a=nope': the URL must be http://HOST:PORT"),
    (["--engine", "a"], "--engine 'a' is not NAME=URL"),
    (["--engine", "a=http://h:1", "--engine", "a=http://h:2"], "given twice"),
    (["--engine", "a=http://h:1", "--stale-after", "0"], "--stale-after must be > 0"),
    (["--engine", "a=http://h:1", "--max-imbalance", "-1"], "--max-imbalance must be >= 0"),
    (["--engine", "a=http://h:1", "--engine-api-key", "b=k"], "no --engine named 'b'"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    assert main(["router", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speckv: error: ") and message in err and "Traceback" not in err


def test_engine_keys_per_engine_or_for_all():
    specs = parse_engines(["a=http://h:1", "b=http://h:2/"], ["k", "b=kb"])
    assert [(s.name, s.url, s.api_key) for s in specs] == \
        [("a", "http://h:1", "k"), ("b", "http://h:2", "kb")]
