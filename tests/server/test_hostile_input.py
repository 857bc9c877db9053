"""Input a hostile or careless client sends: text that is not Unicode (a lone UTF-16 surrogate),
JSON nested thousands deep, unbounded `stop` / `stop_token_ids` / `messages` lists, and
connections dropped mid-body. Each is a 400 in the OpenAI error shape naming the field (never
a 500), or for a dropped connection one short log line (no traceback); the server keeps
serving."""

from __future__ import annotations

import logging
import socket

import httpx
import pytest

from speckv.api.protocol import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from tests.patience import WATCHDOG_S, wait_until
from tests.server.server_test_utils import MODEL_NAME

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "max_tokens": 2}


def _error(response: httpx.Response, param: str | None) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    return error


def _post_raw(http: httpx.Client, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("path,raw,param,where", [
    ("/v1/completions", b'{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}',
     "prompt", "'prompt'"),
    ("/v1/completions", b'{"model": "tiny", "prompt": ["a\\udfff"], "max_tokens": 2}',
     "prompt", "'prompt[0]'"),
    ("/v1/chat/completions", b'{"model": "tiny", "max_tokens": 2, "messages": '
     b'[{"role": "user", "content": "hi"}, {"role": "user", "content": "x\\udc00"}]}',
     "messages", "'messages[1].content'"),
    ("/v1/completions", b'{"model": "tiny", "prompt": "hi", "stop": ["\\ud83d"]}',
     "stop", "'stop[0]'"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(http, path, raw, param, where):
    error = _error(_post_raw(http, path, raw), param)
    assert where in error["message"] and "surrogate" in error["message"]
    # a surrogate *pair* is a valid character: served
    pair = b'{"model": "tiny", "prompt": "smile \\ud83d\\ude00", "max_tokens": 2}'
    assert _post_raw(http, "/v1/completions", pair).status_code == 200


@pytest.mark.parametrize("depth", [65, 5_000, 200_000])
def test_deeply_nested_json_is_a_400(http, depth):
    for path in ("/v1/completions", "/v1/chat/completions"):
        raw = b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        error = _error(_post_raw(http, path, raw), None)
        assert error["code"] == "invalid_json" and "deeper than 64" in error["message"]
    # brackets inside strings are text, not nesting
    text = "[" * 5_000 + '\\"{' * 100
    assert http.post("/v1/completions", json={**GOOD, "prompt": text[:300]}).status_code == 200


def test_stop_and_other_lists_are_bounded(http):
    error = _error(http.post("/v1/completions", json={
        **GOOD, "stop": [f"s{i}" for i in range(100_000)]}), "stop")
    assert f"at most {MAX_STOP_STRINGS}" in error["message"] and "100000" in error["message"]
    error = _error(http.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 5000]}), "stop")
    assert "5000 characters" in error["message"]
    error = _error(http.post("/v1/completions", json={
        **GOOD, "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}), "stop_token_ids")
    assert f"at most {MAX_STOP_TOKEN_IDS}" in error["message"]
    error = _error(http.post("/v1/chat/completions", json={
        **CHAT, "messages": [{"role": "user", "content": "hi"}] * 10_000}), "messages")
    assert error["code"] == "context_length_exceeded" and "10000 messages" in error["message"]
    error = _error(http.post("/v1/completions", json={**GOOD, "prompt": [1.5] * 100_000}),
                   "prompt")
    assert error["code"] == "context_length_exceeded"
    # the bound itself is served
    ok = http.post("/v1/completions", json={**GOOD, "stop": [f"s{i}" for i in
                                                             range(MAX_STOP_STRINGS)]})
    assert ok.status_code == 200, ok.text


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(self.format(record).splitlines())


def test_dropped_connections_log_one_short_line_each(start_server):
    server = start_server()
    lines = _Lines()
    # the server's own loggers (uvicorn's do not reach the root logger)
    loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "speckv")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(lines)
        logger.setLevel(logging.INFO)
    drops = 20
    try:
        for _ in range(drops):  # half a body, then the client is gone
            with socket.create_connection((server.host, server.port)) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                             b"application/json\r\nContent-Length: 1000\r\n\r\n{\"model\"")
        wait_until(lambda: len(lines.lines) >= drops, f"{drops} dropped connections logged")
        with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
            assert http.post("/v1/completions", json=GOOD).status_code == 200
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(lines)
            logger.setLevel(level)
    assert len(lines.lines) == drops, lines.lines[:40]
    assert all("left before sending its whole body (POST /v1/completions)" in line
               and len(line) < 120 for line in lines.lines)


def test_an_unknown_huge_model_name_is_not_echoed_back(http):
    response = http.post("/v1/completions", json={**GOOD, "model": "m" * 100_000})
    assert response.status_code == 404 and len(response.content) < 400
    assert "(100000 characters)" in response.json()["error"]["message"]
