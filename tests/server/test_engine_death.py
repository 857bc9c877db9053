"""The engine loop dying (a fault injected into `LLMEngine.step`): /health turns 503, in-flight
requests fail with a 500 (streaming ones with an error event the `openai` client raises),
new requests get 503, and nobody hangs."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import MODEL_NAME, engine_call


def test_engine_death_fails_in_flight_requests_and_health(start_server, monkeypatch):
    server = start_server()
    loop = server.server.client.loop
    long = {"model": MODEL_NAME, "prompt": "in flight", "max_tokens": 480, "ignore_eos": True}

    def non_streaming() -> httpx.Response:
        with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
            return http.post("/v1/completions", json=long)

    gate = threading.Event()
    with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                          timeout=WATCHDOG_S) as client, ThreadPoolExecutor(1) as pool:
        plain = pool.submit(non_streaming)
        sdk_stream = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=400,
            stream=True, extra_body={"ignore_eos": True})
        sdk_chunks = iter(sdk_stream)
        next(sdk_chunks)
        with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as raw:
            lines = raw.iter_lines()
            next(line for line in lines if line.startswith("data:"))
            while engine_call(server, lambda engine: engine.num_unfinished_requests) < 3:
                time.sleep(0.005)
            busy = loop.call(lambda engine: gate.wait(WATCHDOG_S))  # hold the loop between steps
            while not busy.running():
                time.sleep(0.005)

            def broken_step():
                raise RuntimeError("device lost (injected fault)")

            monkeypatch.setattr(server.server.engine, "step", broken_step)
            gate.set()
            rest = [line for line in lines if line.startswith("data:")]
        errors = [json.loads(line[5:]) for line in rest if "error" in line]
        assert rest[-1] == "data: [DONE]"
        (error,) = errors
        assert error["error"]["code"] == "engine_error"
        assert "injected fault" in error["error"]["message"]
        with pytest.raises(openai.APIError, match="injected fault"):
            for _ in sdk_chunks:
                pass
        failed = plain.result(timeout=WATCHDOG_S)
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "engine_error"
        health = http.get("/health")
        assert health.status_code == 503
        assert "injected fault" in health.json()["error"]["message"]
        refused = http.post("/v1/completions", json=long)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        assert http.post("/reset_prefix_cache").status_code == 503
        assert http.get("/metrics").status_code == 200  # still scrapeable for the post-mortem
