"""The OpenAI endpoints over real sockets with the official `openai` client: streaming and
non-streaming for both endpoints, token-id prompts, stop strings, usage with cached tokens,
and the side endpoints (/v1/models, /health, /version, /metrics, /reset_prefix_cache)."""

from __future__ import annotations

import httpx

from speckv.engine.sampling_params import SamplingParams
from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import (
    MODEL_NAME,
    TOKENIZER,
    engine_call,
    scrape,
    value,
    wait_idle_and_check,
)

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _reference(shared_server, prompt_ids, max_tokens):
    """What the engine itself produces for the prompt (greedy), run in its loop thread."""

    def run(engine):
        request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=max_tokens,
                                                                    ignore_eos=True))
        final = None
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request_id and output.finished:
                    final = output
        return final

    return engine_call(shared_server, run)


def test_completion_matches_the_engine_streaming_or_not(client, shared_server):
    prompt_ids = TOKENIZER.encode(PROMPT)
    expected = _reference(shared_server, prompt_ids, 12)
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.object == "text_completion" and plain.model == MODEL_NAME
    (choice,) = plain.choices
    assert choice.text == expected.text and choice.finish_reason == "length"
    assert plain.usage.prompt_tokens == len(prompt_ids)
    assert plain.usage.completion_tokens == 12
    assert plain.usage.total_tokens == len(prompt_ids) + 12
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert len({c.id for c in chunks}) == 1


def test_token_id_prompt_and_batch_of_one(client, shared_server):
    prompt_ids = [5, 17, 99, 200, 42, 42, 7]
    expected = _reference(shared_server, prompt_ids, 6)
    for prompt in (prompt_ids, [prompt_ids]):
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.choices[0].text == expected.text
        assert out.usage.prompt_tokens == len(prompt_ids)


def test_chat_streaming_and_not(client, shared_server):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Say hi."}]}]
    rendered = TOKENIZER.apply_chat_template(
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Say hi."}])
    expected = _reference(shared_server, TOKENIZER.encode(rendered), 10)
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                           max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert plain.object == "chat.completion"
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == expected.text
    assert plain.usage.prompt_tokens == len(TOKENIZER.encode(rendered))
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)


def test_stop_strings_and_sampling_with_seed(client):
    first = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20,
                                      temperature=0, extra_body={"ignore_eos": True})
    text = first.choices[0].text
    stop = text[5:8]
    stopped = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=20,
                                        temperature=0, stop=[stop],
                                        extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.find(stop)]
    seeded = [client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=10,
                                        temperature=1.0, top_p=0.9, seed=7,
                                        extra_body={"top_k": 50, "ignore_eos": True})
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]


def test_repeated_prompt_reports_cached_tokens_and_moves_counters(client, shared_server):
    before = scrape(shared_server.url)
    prompt = "A shared system prompt that is long enough to fill several KV blocks. " * 2
    messages = [{"role": "user", "content": prompt}]
    first = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                           temperature=0)
    second = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4,
                                            temperature=0)
    num_prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == (num_prompt - 1) // 4 * 4 > 0  # every whole block but the last token's
    after = scrape(shared_server.url)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:prefix_cache_queries_total") == 2 * num_prompt
    assert delta("vllm:prefix_cache_hits_total") == cached
    assert delta("vllm:prompt_tokens_total") == 2 * num_prompt
    generated = first.usage.completion_tokens + second.usage.completion_tokens
    assert delta("vllm:generation_tokens_total") == generated
    finished = sum(delta("vllm:request_success_total", finished_reason=r)
                   for r in ("stop", "length"))
    assert finished == 2
    assert delta("vllm:time_to_first_token_seconds_count") == 2
    assert delta("vllm:e2e_request_latency_seconds_count") == 2
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == generated - 2


def test_side_endpoints(http, shared_server):
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    (entry,) = models["data"]
    assert entry["id"] == MODEL_NAME and entry["max_model_len"] == 512
    metrics = scrape(shared_server.url)
    assert value(metrics, "speckv:lookahead_tokens") == 0
    assert value(metrics, "speckv:legacy_block_drop") == 0
    assert value(metrics, "speckv:hash_mode_info", hash_mode="legacy") == 1
    assert value(metrics, "vllm:num_requests_running", model_name=MODEL_NAME, engine="0") == 0
    wait_idle_and_check(shared_server)
    assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                              "max_tokens": 2}).status_code == 200
    assert http.post("/reset_prefix_cache").json() == {"success": True}
    second = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT,
                                                "max_tokens": 2}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_reset_is_refused_while_a_request_holds_blocks(shared_server):
    with httpx.Client(base_url=shared_server.url, timeout=WATCHDOG_S) as http, http.stream(
            "POST", "/v1/completions",
            json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 300, "stream": True,
                  "ignore_eos": True}) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        refused = http.post("/reset_prefix_cache")
        assert refused.status_code == 409
        assert refused.json()["error"]["code"] == "prefix_cache_in_use"
