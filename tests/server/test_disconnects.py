"""Clients that go away: their requests are aborted at once and every KV block comes back."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from speckv.engine.engine_args import engine_config
from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import (
    MODEL_NAME,
    engine_call,
    scrape,
    value,
    wait_idle_and_check,
)


def test_100_requests_with_20_disconnecting_mid_stream_free_every_block(start_server):
    server = start_server(engine_config(block_size=4, num_blocks=400, max_num_seqs=16,
                                        hash_seed="0"))
    before = scrape(server.url)
    prompts = [f"Request {i}: " + "shared prefix text " * (1 + i % 4) for i in range(100)]

    async def finish(client: openai.AsyncOpenAI, index: int) -> int:
        if index % 2:
            stream = await client.completions.create(
                model=MODEL_NAME, prompt=prompts[index], max_tokens=24, stream=True,
                extra_body={"ignore_eos": True})
            return sum([1 async for chunk in stream if chunk.choices[0].text]) and 24
        chat = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": prompts[index]}],
            max_tokens=24, extra_body={"ignore_eos": True})
        return chat.usage.completion_tokens

    async def leave(http: httpx.AsyncClient, index: int) -> int:
        body = {"model": MODEL_NAME, "prompt": prompts[index], "max_tokens": 400,
                "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data:")
                if seen == 3:
                    break  # leaving the block closes the connection mid-stream
        return 0

    async def main() -> list[int]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x",
                                      max_retries=0, timeout=WATCHDOG_S) as client, \
                httpx.AsyncClient(base_url=server.url, timeout=WATCHDOG_S) as http:
            jobs = [leave(http, i) if i % 5 == 0 else finish(client, i) for i in range(100)]
            return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    assert results.count(24) == 80
    assert wait_idle_and_check(server) == 399  # every block free (block 0 is the null block)
    after = scrape(server.url)
    aborted = (value(after, "vllm:request_success_total", finished_reason="abort")
               - value(before, "vllm:request_success_total", finished_reason="abort"))
    finished = (value(after, "vllm:request_success_total", finished_reason="length")
                - value(before, "vllm:request_success_total", finished_reason="length"))
    assert (aborted, finished) == (20, 80)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_a_non_streaming_client_that_times_out_is_aborted(start_server):
    server = start_server()
    loop = server.server.client.loop
    body = {"model": MODEL_NAME, "prompt": "wait for me", "max_tokens": 480,
            "ignore_eos": True}

    def post() -> None:
        with httpx.Client(base_url=server.url, timeout=httpx.Timeout(60, read=1.0)) as http:
            http.post("/v1/completions", json=body)

    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        request = pool.submit(post)
        while not engine_call(server, lambda engine: engine.has_unfinished_requests()):
            time.sleep(0.005)
        # a long engine step: the request cannot finish before its client gives up
        loop.call(lambda engine: gate.wait(WATCHDOG_S))
        assert isinstance(request.exception(timeout=WATCHDOG_S), httpx.ReadTimeout)
        time.sleep(0.2)  # the server's event loop (not blocked) sees the disconnect
        gate.set()
    assert wait_idle_and_check(server) == 511
    metrics = scrape(server.url)
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 0
