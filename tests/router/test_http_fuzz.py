"""Fuzzing the HTTP surface: hypothesis draws JSON bodies (OpenAI's fields with any JSON value,
plus arbitrary objects, lone surrogates and deep nesting) for `/v1/completions` and
`/v1/chat/completions`, sent to a real `speckv serve` process and to a real `speckv router`
in front of it. Every answer is a 2xx, or a 4xx in OpenAI's error shape, never a 5xx; both
keep serving a good request afterwards, and no dropped body leaves a traceback in their logs.

Examples are few (a fixed count, no time limit) so the module takes tens of seconds."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.patience import WATCHDOG_S
from tests.router.fleet_utils import MODEL_NAME, Engine, RouterProcess, save_fleet_models

EXAMPLES = 60  # per endpoint and front: 240 requests

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
           | st.sampled_from(["", "a\ud800b", "\udfff", MODEL_NAME, "user", "system", "text"]))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]) | JSON,
    "content": st.text(max_size=30) | JSON})
FIELDS = {
    "model": st.just(MODEL_NAME) | JSON, "prompt": st.text(max_size=30)
    | st.lists(st.integers(-5, 300), max_size=20) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON, "temperature": SCALARS,
    "top_p": SCALARS, "top_k": SCALARS, "seed": SCALARS, "n": SCALARS, "stop": JSON,
    "stop_token_ids": JSON, "stream": st.booleans() | SCALARS, "stream_options": JSON,
    "ignore_eos": SCALARS, "logprobs": SCALARS, "echo": SCALARS, "best_of": SCALARS,
    "presence_penalty": SCALARS, "logit_bias": JSON, "kv_transfer_params": JSON,
    "max_completion_tokens": st.integers(-2, 3) | SCALARS, "response_format": JSON,
    "tools": JSON}
# max_tokens always set and small: a valid body generates a few tokens, not the context
BODY = st.fixed_dictionaries({"max_tokens": st.integers(-2, 3) | SCALARS},
                             optional=FIELDS) | st.dictionaries(st.text(max_size=10), JSON)
NESTED = st.integers(60, 3000).map(lambda d: '{"prompt": ' + "[" * d + "]" * d + "}")
RAW = st.one_of(BODY.map(lambda b: json.dumps(b)), NESTED, st.text(max_size=40))


@pytest.fixture(scope="module")
def fronts(tmp_path_factory, tiny_chat_model):
    """{"server": url, "router": url}: one engine process and a router in front of it."""
    models = save_fleet_models(tmp_path_factory.mktemp("fuzz"), tiny_chat_model)
    engine = Engine(models["model"], ["--hash-seed", "0"]).start()
    router = None
    try:
        engine.wait()
        router = RouterProcess({"a": engine}).start()
        yield {"server": engine, "router": router}
    finally:
        if router is not None:
            _, err = router.stop()
            assert "Traceback" not in err, err[-3000:]
        engine.stop()


def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["message"], str) and error["message"]


@pytest.mark.parametrize("front", ["server", "router"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_any_json_body_is_2xx_or_an_openai_4xx(fronts, front, path):
    url = fronts[front].url
    with httpx.Client(base_url=url, timeout=WATCHDOG_S) as http:

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(raw=RAW)
        def fuzz(raw: str) -> None:
            content = raw.encode("utf-8", "surrogatepass")  # lone surrogates as JSON escapes
            _check(http.post(path, content=content,
                             headers={"content-type": "application/json"}))

        fuzz()
        good = {"model": MODEL_NAME, "max_tokens": 2, "prompt": "still serving",
                "messages": [{"role": "user", "content": "still serving"}]}
        assert http.post(path, json=good).status_code == 200
