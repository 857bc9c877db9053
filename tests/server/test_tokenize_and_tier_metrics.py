"""What vLLM's own clients read from a server besides completions, over real HTTP: `/tokenize`
and `/detokenize` in vLLM's request and response shapes (the chat form gives exactly the prompt
a chat completion sees), and tokens a KV tier served in `/metrics` under vLLM's names
(`vllm:external_prefix_cache_queries` / `_hits`)."""

from __future__ import annotations

import httpx

from speckv.connectors.offload import OffloadConnector
from speckv.engine.engine_args import engine_config
from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import (
    MODEL_NAME,
    TOKENIZER,
    engine_call,
    make_server,
    scrape,
    value,
    wait_idle_and_check,
)

TEXT = "The quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]


def test_tokenize_and_detokenize_as_vllm_serves_them(http):
    answer = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["tokens"] == TOKENIZER.encode(TEXT) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and body["token_strs"] is None
    strs = http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["a", "b"]
    back = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": TEXT}
    # the chat form: the prompt a chat completion is given, token for token
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    completion = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1}).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"] > len(body["tokens"])


def test_tokenize_errors_are_openai_shaped(http):
    cases = [
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "prompt"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model"),
        ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
         "messages[0].role"),
        ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ]
    for path, body, status, param in cases:
        answer = http.post(path, json=body)
        assert answer.status_code == status, (path, body, answer.text)
        assert answer.json()["error"]["param"] == param, (path, body, answer.text)


def test_tokens_a_kv_tier_served_are_external_prefix_cache_hits(tiny_chat_model):
    server = make_server(tiny_chat_model, engine_config(block_size=4, num_blocks=256,
                                                        max_num_seqs=4, hash_seed="0"),
                         connector=OffloadConnector(0.05))
    try:
        with httpx.Client(base_url=server.url, timeout=WATCHDOG_S) as http:
            body = {"model": MODEL_NAME, "prompt": TEXT * 2, "max_tokens": 2}
            first = http.post("/v1/completions", json=body).json()["usage"]
            wait_idle_and_check(server)
            assert engine_call(server, lambda engine: engine.flush_kv_connector(WATCHDOG_S))
            assert http.post("/reset_prefix_cache").status_code == 200  # local cache gone
            second = http.post("/v1/completions", json=body).json()["usage"]
            samples = scrape(server.url)
    finally:
        server.stop()
    served = second["prompt_tokens_details"]["cached_tokens"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0 and served > 0
    assert value(samples, "vllm:external_prefix_cache_hits_total") == served
    assert value(samples, "vllm:external_prefix_cache_queries_total") \
        == first["prompt_tokens"] + second["prompt_tokens"]
    assert value(samples, "vllm:prefix_cache_hits_total") == 0  # the local cache had nothing
