"""`kv_transfer_params` over real HTTP, as vLLM carries it: the request body's field reaches the
KV connector, and what the connector returns at the request's finish comes back in the
response (official `openai` client, `extra_body`). A prefill server sends the prompt's KV to a
fake remote; a decode server loads it asynchronously and reports it as cached tokens."""

from __future__ import annotations

import random

import httpx
import openai

from speckv.engine.engine_args import engine_config
from tests.doubles.remote import FakeRemoteConnector, RemoteBlocks
from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import MODEL_NAME, make_server

CONFIG = engine_config(block_size=4, num_blocks=64, max_num_seqs=4, hash_seed="0")


def test_kv_transfer_params_travel_both_ways(tiny_chat_model):
    prompt = [random.Random(7).randrange(1, 200) for _ in range(21)]
    remote = RemoteBlocks()
    prefill_connector = FakeRemoteConnector(remote, send_on_finish=True, send_steps=1)
    prefill = make_server(tiny_chat_model, CONFIG, connector=prefill_connector)
    try:
        with openai.OpenAI(base_url=f"{prefill.url}/v1", api_key="unused", max_retries=0,
                           timeout=WATCHDOG_S) as client:
            response = client.completions.create(
                model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0,
                extra_body={"kv_transfer_params": {"do_remote_decode": True}})
        params = response.model_extra["kv_transfer_params"]
    finally:
        prefill.stop()
    assert {"do_remote_decode": True} in prefill_connector.seen_params.values()
    assert params["remote_engine"] == "remote" and params["num_blocks"] == 5
    assert len(remote.blocks) == 5
    decode = make_server(tiny_chat_model, CONFIG, connector=FakeRemoteConnector(
        remote, min_load_steps=1, max_load_steps=2))
    try:
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0,
                "kv_transfer_params": {"remote_engine": params["remote_engine"]}}
        reply = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=WATCHDOG_S).json()
    finally:
        decode.stop()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 20
    assert "kv_transfer_params" not in reply  # the decode side returned none


def test_a_kv_transfer_params_that_is_not_an_object_is_a_400(http):
    reply = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi",
                                               "max_tokens": 1, "kv_transfer_params": [1]})
    assert reply.status_code == 400
    assert "kv_transfer_params" in reply.text
