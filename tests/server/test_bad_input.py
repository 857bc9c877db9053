"""Every bad input gets the OpenAI error shape with the right status, names the field, and the
server keeps serving everyone else (the engine is untouched: every block free afterwards)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.patience import WATCHDOG_S, wait_until
from tests.server.server_test_utils import MODEL_NAME, TINY_CONFIG, wait_idle_and_check

GOOD = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3}


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("overrides,param,fragment", [
    ({"n": 2}, "n", "n=2"),
    ({"max_tokens": -1}, "max_tokens", "at least 1"),
    ({"max_tokens": 0}, "max_tokens", "at least 1"),
    ({"max_tokens": 10**12}, "max_tokens", "maximum context length is 512"),
    ({"max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": [1, TINY_CONFIG.vocab_size]}, "prompt", f"[0, {TINY_CONFIG.vocab_size})"),
    ({"prompt": [3, -1]}, "prompt", "outside the vocabulary"),
    ({"prompt": [3, 1.5]}, "prompt", "not an integer token id"),
    ({"prompt": [7] * 600}, "prompt", "maximum context length is 512 tokens, but the prompt "
                                      "has 600"),
    ({"temperature": 2.5}, "temperature", "between 0 and 2"),
    ({"temperature": -0.1}, "temperature", "between 0 and 2"),
    ({"top_p": 0}, "top_p", "(0, 1]"),
    ({"top_p": 1.5}, "top_p", "(0, 1]"),
    ({"top_k": -2}, "top_k", "top_k"),
    ({"seed": -1}, "seed", "seed"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids", "outside the vocabulary"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed"),
    ({"logprobs": 1}, "logprobs", "not supported"),
    ({"echo": True}, "echo", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
])
def test_bad_completion_fields_are_400_naming_the_field(http, overrides, param, fragment):
    error = _error(http.post("/v1/completions", json={**GOOD, **overrides}), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert fragment in error["message"]


@pytest.mark.parametrize("body,param,fragment", [
    ({"model": MODEL_NAME, "messages": []}, "messages", "empty"),
    ({"model": MODEL_NAME}, "messages", "Field required"),
    ({"model": MODEL_NAME, "messages": [{"content": "hi"}]}, "messages", "role"),
    # roles as OpenAI and vLLM know them; one empty-prompt rule with /v1/completions
    ({"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]},
     "messages[0].role", "'wizard' is not one of"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": ""}]},
     "messages[0].content", "empty"),
    ({"model": MODEL_NAME, "messages": [{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": []}]},
     "messages[1].content", "empty"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
      "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "x" * 600}]},
     "messages", "maximum context length is 512"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
     "messages[0].content", "text parts only"),
    ({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function"}]}, "tools", "not supported"),
])
def test_bad_chat_fields_are_400(http, body, param, fragment):
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert error["param"] == param
    assert fragment in error["message"]


def test_malformed_bodies_routes_and_models(http):
    for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        error = _error(http.post("/v1/completions", content=raw,
                                 headers={"content-type": "application/json"}), 400)
        assert error["code"] == "invalid_json"
    error = _error(http.post("/v1/completions", json={**GOOD, "model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found" and "'gpt-4'" in error["message"]
    assert _error(http.get("/v1/nothing"), 404)["code"] == "not_found"
    assert _error(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"


def test_the_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, n=3)
    assert bad.value.param == "n" and bad.value.code == "unsupported_parameter"
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=[{"role": "user",
                                                                 "content": "hi"}])
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.completions.create(model=MODEL_NAME, prompt=[5] * 513, max_tokens=1)
    assert "513" in long_prompt.value.message and "512" in long_prompt.value.message
    # and everyone else is still served
    ok = client.completions.create(model=MODEL_NAME, prompt="still here", max_tokens=2)
    assert ok.usage.completion_tokens >= 1


def test_the_server_is_untouched_by_bad_input(http, shared_server):
    usable = wait_idle_and_check(shared_server)
    assert http.post("/v1/completions", json={**GOOD, "prompt": [1, 10**9]}).status_code == 400
    assert http.post("/v1/completions", json=GOOD).status_code == 200
    assert wait_idle_and_check(shared_server) == usable


def test_body_over_the_limit_is_413(start_server):
    server = start_server(max_request_body_bytes=2048)
    with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
        error = _error(http.post("/v1/completions",
                                 json={**GOOD, "prompt": "x" * 4096}), 413)
        assert error["code"] == "request_too_large" and "2048" in error["message"]

        def chunked():  # no Content-Length: the limit holds while reading
            for _ in range(8):
                yield b" " * 512
            yield b"{}"

        error = _error(http.post("/v1/completions", content=chunked(),
                                 headers={"content-type": "application/json"}), 413)
    with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
        assert http.post("/v1/completions", json=GOOD).status_code == 200


def test_api_key_is_required_on_v1_routes(start_server):
    server = start_server(api_key="s3cret")
    with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            error = _error(http.post("/v1/completions", json=GOOD, headers=headers), 401)
            assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert _error(http.get("/v1/models"), 401)["code"] == "invalid_api_key"
        assert _error(http.post("/reset_prefix_cache"), 401)["code"] == "invalid_api_key"
        assert http.get("/health").status_code == 200
        assert http.get("/metrics").status_code == 200
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0) as client:
        assert client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2).choices


def test_full_waiting_queue_is_503_with_retry_after(start_server):
    server = start_server(max_waiting_requests=2, retry_after_s=3)
    loop = server.server.client.loop
    # a long engine step: the loop thread is busy, so new requests wait
    gate = threading.Event()
    busy = loop.call(lambda engine: gate.wait(WATCHDOG_S))
    while not busy.running():
        time.sleep(0.005)

    def post(body):
        with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
            return http.post("/v1/completions", json=body)

    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(post, GOOD) for _ in range(2)]
        wait_until(lambda: loop.num_waiting_requests >= 2, "two requests wait", poll_s=0.005)
        refused = post(GOOD)
        gate.set()
        assert [w.result().status_code for w in waiting] == [200, 200]
    error = _error(refused, 503)
    assert refused.headers["retry-after"] == "3"
    assert error["code"] == "server_overloaded" and "2 requests" in error["message"]
    assert post(GOOD).status_code == 200  # the queue drained: served again
    assert wait_idle_and_check(server) == 511
