"""Prefill/decode disaggregation over HTTP: `speckv router --prefill --decode` in front of two
`speckv serve` engines joined by the nixl connector.

In one process (engines and router on loopback threads, so the pools can be checked): 50
concurrent requests through the router equal a single engine's greedy answers and leave both
engines with every block free and `check_integrity()` clean; a bad `kv_transfer_params` field
is a 400 naming it; a decode engine that rejects a request still releases the prefill lease.
In real processes (two `speckv serve`, one `speckv router`, the `openai` client): greedy output
through P/D with the EAGLE3 drafter equals the decode engine's own output without transfer.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import openai
import pytest

from speckv.connectors.nixl.transport import nixl_available
from speckv.drafters.loaders import random_drafter, save_drafter
from speckv.engine.config import EngineConfig
from speckv.engine.engine_args import engine_config
from speckv.events.endpoints import LOOPBACK, free_port
from speckv.router.pd import PDConfig, PDRouter, build_pd_app
from speckv.server.launch import ServerThread
from tests.patience import WATCHDOG_S, wait_until
from tests.router.fleet_utils import ENV, MODEL_NAME, Engine, save_fleet_models, wait_http
from tests.server.server_test_utils import (
    engine_call,
    make_server,
    scrape,
    value,
    wait_idle_and_check,
)

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")


def _config(role: str | None, **options) -> EngineConfig:
    transfer = {} if role is None else {"kv_transfer_config": json.dumps(
        {"kv_connector": "nixl", "kv_role": role, **options})}
    return engine_config(block_size=4, num_blocks=512, max_num_seqs=16, hash_seed="0",
                         **transfer)


def _texts(count: int) -> list[str]:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kv", "block", "cache", "draft"]
    return [" ".join(rng.choice(words) for _ in range(rng.randrange(4, 14)))
            for _ in range(count)]


@pytest.fixture(scope="module")
def pd(tiny_chat_model):
    single = make_server(tiny_chat_model, _config(None))
    prefill = make_server(tiny_chat_model, _config("kv_producer"))
    decode = make_server(tiny_chat_model, _config("kv_consumer"))
    router = ServerThread(SimpleNamespace(app=build_pd_app(PDRouter(PDConfig(
        (prefill.url,), (decode.url,)))))).start()
    yield SimpleNamespace(single=single, prefill=prefill, decode=decode, router=router)
    for thread in (router, decode, prefill, single):
        thread.stop()


def _leases(thread: ServerThread) -> int:
    return int(engine_call(thread, lambda engine: engine.scheduler.num_held_requests))


def test_concurrent_pd_requests_equal_a_single_engine_and_free_every_block(pd):
    texts = _texts(50)

    async def ask(base_url: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
        try:
            replies = await asyncio.gather(*(
                client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=6,
                                          temperature=0) for text in texts))
        finally:
            await client.close()
        return [reply.choices[0].text for reply in replies]

    expected = asyncio.run(ask(pd.single.url))
    got = asyncio.run(ask(pd.router.url))
    assert got == expected
    stats = engine_call(pd.decode, lambda engine: engine.kv_connector_stats()["nixl"])
    assert stats.loaded_blocks > 0 and stats.load_failed_blocks == 0
    for thread in (pd.prefill, pd.decode):
        engine = thread.server.engine
        assert wait_idle_and_check(thread) == engine.num_blocks - 1  # every block free
    # what `speckv bench serve --base-url ROUTER` calls
    assert httpx.post(f"{pd.router.url}/reset_prefix_cache", timeout=WATCHDOG_S).json()["success"]
    # the router's own metrics, its engines by name (not the decode engine's, passed through)
    samples = scrape(pd.router.url)
    assert value(samples, "speckv_router:requests_total", engine="decode0",
                 reason="transferred") == 50
    assert value(samples, "speckv_router:prefill_requests_total", engine="prefill0") == 50
    assert not any(name.startswith("vllm:") for name, _ in samples)
    answer = httpx.post(f"{pd.router.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": texts[0], "max_tokens": 2})
    assert answer.headers["x-speckv-engine"] == "decode0"
    assert answer.headers["x-speckv-pd"] == "prefill=prefill0;decode=decode0"


def test_a_bad_transfer_field_is_named_and_a_rejected_request_releases_its_lease(pd):
    prompt = "alpha beta gamma delta alpha beta gamma delta kv"
    first = httpx.post(f"{pd.prefill.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = first["kv_transfer_params"]
    assert params["num_tokens"] > 0 and _leases(pd.prefill) == 1
    bad = httpx.post(f"{pd.decode.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 4,
        "kv_transfer_params": {**params, "num_tokens": params["num_tokens"] + 1}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "kv_transfer_params.num_tokens"
    rejected = httpx.post(f"{pd.decode.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 10**6,
        "kv_transfer_params": params})
    assert rejected.status_code == 400
    # the decode engine told the prefill engine to let go
    wait_until(lambda: not _leases(pd.prefill), "the rejected request's lease is let go",
               poll_s=0.05)
    engine = pd.prefill.server.engine
    assert wait_idle_and_check(pd.prefill) == engine.num_blocks - 1


# ---- real processes ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def processes(tmp_path_factory, tiny_chat_model):
    path: Path = tmp_path_factory.mktemp("pd")
    models = save_fleet_models(path, tiny_chat_model)
    eagle3 = save_drafter(random_drafter("eagle3", tiny_chat_model, init_std=0.2, seed=3,
                                         aux_layers=(0, 1, 1)), path / "eagle3")
    drafter = ["--speculative-method", "eagle3", "--speculative-model", str(eagle3),
               "--num-spec-tokens", "2", "--hash-seed", "0"]
    engines = {role: Engine(models["model"], [*drafter, "--kv-transfer-config", json.dumps(
        {"kv_connector": "nixl", "kv_role": role})]) for role in ("kv_producer", "kv_consumer")}
    for engine in engines.values():
        engine.start()
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "speckv.cli", "router", "--port", str(port),
         "--prefill", engines["kv_producer"].url, "--decode", engines["kv_consumer"].url],
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for engine in engines.values():
            engine.wait()
        wait_http(f"http://{LOOPBACK}:{port}", router, 60)
        yield SimpleNamespace(router=f"http://{LOOPBACK}:{port}", **engines)
    finally:  # signal all three, then wait: their shutdowns overlap
        router.terminate()
        for engine in engines.values():
            if engine.process is not None and engine.process.poll() is None:
                engine.process.send_signal(signal.SIGINT)
        router.wait(WATCHDOG_S)
        for engine in engines.values():
            engine.stop()


@pytest.mark.slow
def test_greedy_output_through_pd_processes_equals_the_decode_engines_own(processes):
    prompt = "draft kv cache block " * 9
    client = openai.OpenAI(base_url=f"{processes.kv_consumer.url}/v1", api_key="x",
                           max_retries=0)
    direct = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                       temperature=0)
    assert httpx.post(f"{processes.kv_consumer.url}/reset_prefix_cache",
                      timeout=WATCHDOG_S).status_code == 200
    through = openai.OpenAI(base_url=f"{processes.router}/v1", api_key="x", max_retries=0)
    stream = through.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12,
                                        temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == direct.choices[0].text
    # the prompt came over NIXL: the decode engine counts it as cached
    assert usage is not None and usage.prompt_tokens_details.cached_tokens > 0
    state = httpx.get(f"{processes.router}/router/state", timeout=WATCHDOG_S).json()
    assert state["transferred"] == 1 and state["local_prefill"] == 0
