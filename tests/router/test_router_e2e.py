"""`speckv router` in front of real `speckv serve` processes on loopback (the tiny chat model
with random drafters): a router started after the engines fills its index by replay; routing
follows the prefix; the predicted cached tokens equal the engines' reports with lookahead
L = 1 (EAGLE), L = 2 (2-module MTP) and legacy + drop engines in one fleet; the official
`openai` client, streaming included; API keys; an engine killed (retry elsewhere, a broken
stream ends with an error chunk) and restarted (epoch change, index rebuilt); contracts the
router cannot reproduce refused naming the field."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from speckv.engine.engine_args import engine_config
from speckv.router.contract import ContractError
from speckv.router.engine_probe import fetch_contracts
from speckv.router.fleet import EngineSpec
from tests.patience import WATCHDOG_S
from tests.router.fleet_utils import (
    BLOCK,
    MODEL_NAME,
    Engine,
    RouterProcess,
    save_fleet_models,
)
from tests.server.server_test_utils import scrape, value

pytestmark = pytest.mark.slow
SMALL_CACHE = ["--num-gpu-blocks-override", "96", "--hash-seed", "0"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def complete(router: RouterProcess, prompt, headers=None, **extra) -> httpx.Response:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}
    response = httpx.post(f"{router.url}/v1/completions", json=body, headers=headers,
                          timeout=WATCHDOG_S)
    assert response.status_code == 200, response.text
    return response


def settle(router: RouterProcess) -> None:
    """Wait until every routed block's KV event has reached the router's index."""
    router.wait_state(lambda s: all(e["index"]["pending_blocks"] == 0 for e in s.values()))


def router_metrics(router: RouterProcess):
    return scrape(router.url)


def total(samples, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == name and all(dict(ls).get(k) == want for k, want in labels.items()))


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_chat_model):
    return save_fleet_models(tmp_path_factory.mktemp("fleet"), tiny_chat_model)


def start_all(*processes):
    for process in processes:
        process.start()
    with ThreadPoolExecutor(len(processes)) as pool:  # the engines load side by side
        list(pool.map(lambda p: p.wait(), processes))


@pytest.fixture(scope="module")
def fleet(models):
    """Every engine of the module, loaded side by side: two EAGLE engines (L = 1, divergent
    block reuse on), a 2-module MTP engine (L = 2) and an EAGLE engine on legacy hashes (the
    drop); the last two want an API key."""
    eagle = ["--speculative-method", "eagle", "--speculative-model", str(models["eagle"]),
             "--num-spec-tokens", "2", *SMALL_CACHE]
    # MTP without divergent block reuse: its hits stay whole blocks (the mode test checks it)
    mtp = ["--speculative-method", "mtp", "--speculative-model", str(models["mtp2"]),
           "--num-spec-tokens", "2", *SMALL_CACHE, "--api-key", "ek",
           "--disable-divergent-block-reuse"]
    legacy = [*eagle, "--disable-lookahead-block-hashes", "--api-key", "ek"]
    engines = {"a": Engine(models["model"], eagle), "b": Engine(models["model"], eagle),
               "mtp": Engine(models["model"], mtp), "legacy": Engine(models["model"], legacy)}
    try:
        start_all(*engines.values())
        yield engines
    finally:
        for engine in engines.values():
            engine.kill()


@pytest.fixture(scope="module")
def pair(fleet):
    """Engines a and b behind a router started after engine a served one prompt."""
    engines = {name: fleet[name] for name in ("a", "b")}
    early = httpx.post(f"{engines['a'].url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": tokens(0, 30), "max_tokens": 2})
    assert early.status_code == 200
    routers = [RouterProcess(engines, ["--max-request-body-bytes", "65536"]).start()]
    try:
        yield engines, routers
    finally:
        for router in routers:
            router.stop()


def test_router_started_after_the_engines_replays_their_history(pair):
    _, (router, *_) = pair
    state = router.wait_state(lambda s: s["a"]["index"]["cached_blocks"] > 0)
    assert state["a"]["subscriber"]["replayed_batches"] > 0
    assert state["a"]["index"]["verified_blocks"] == state["a"]["index"]["stored_blocks"]
    response = complete(router, tokens(0, 30))
    assert response.headers["x-speckv-engine"] == "a"
    # 30 tokens, blocks of 4, L = 1: 7 whole blocks have their successor -> 28 cached
    assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 28
    samples = router_metrics(router)
    assert value(samples, "speckv_router:requests_total", engine="a", reason="prefix") >= 1


def test_routing_follows_the_prefix_and_predictions_equal_reports(pair):
    _, (router, *_) = pair
    settle(router)
    before = router_metrics(router)
    served: dict[int, set[str]] = {}
    for round_ in range(3):
        for prefix in range(4):
            prompt = tokens(100 + prefix, 96) + tokens(1000 * round_ + prefix, 5 + round_)
            response = complete(router, prompt)
            served.setdefault(prefix, set()).add(response.headers["x-speckv-engine"])
            settle(router)
    assert all(len(names) == 1 for names in served.values()), served  # each prefix: one engine
    assert {name for names in served.values() for name in names} == {"a", "b"}
    after = router_metrics(router)
    checks = total(after, "speckv_router:prediction_checks_total") - \
        total(before, "speckv_router:prediction_checks_total")
    assert checks == 12
    assert total(after, "speckv_router:prediction_mismatches_total") == 0
    assert total(after, "speckv_router:reported_cached_tokens_total") > \
        total(before, "speckv_router:reported_cached_tokens_total")
    assert total(after, "speckv_router:hash_mismatched_blocks_total") == 0


def test_the_openai_client_against_the_router(pair):
    _, (router, *_) = pair
    messages = [{"role": "user", "content": "Tell me about caches. " * 3}]
    with openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        first, second = (client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0)
            for _ in range(2))
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        assert second.choices[0].message.content == first.choices[0].message.content
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == first.choices[0].message.content
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
        completion = client.completions.create(model=MODEL_NAME, prompt="Hello there, cache",
                                               max_tokens=3, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in completion)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=0)
        with pytest.raises(openai.APIStatusError, match="limit of 65536 bytes") as raised:
            client.completions.create(model=MODEL_NAME, prompt="x" * 70_000, max_tokens=1)
        assert raised.value.status_code == 413
    assert total(router_metrics(router), "speckv_router:prediction_mismatches_total") == 0
    # the reset goes to every engine; their AllBlocksCleared events empty the index
    reset = httpx.post(f"{router.url}/reset_prefix_cache", timeout=WATCHDOG_S)
    assert reset.status_code == 200 and reset.json()["engines"] == ["a", "b"]
    state = router.wait_state(lambda s: all(e["index"]["cached_blocks"] == 0
                                            for e in s.values()))
    assert all(e["index"]["clears"] >= 1 for e in state.values())


@pytest.fixture(scope="module")
def modes(fleet):
    """A mixed fleet: L = 2 and legacy + drop, behind engine keys; the router wants its own."""
    engines = {name: fleet[name] for name in ("mtp", "legacy")}
    router = RouterProcess(engines, ["--api-key", "rk", "--engine-api-key", "ek"]).start()
    try:
        yield router
    finally:
        router.stop()


def test_predictions_equal_reports_for_every_hash_mode(modes):
    router = modes
    key = {"Authorization": "Bearer rk"}
    assert httpx.post(f"{router.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    state = httpx.get(f"{router.url}/router/state", headers=key).json()["engines"]
    assert {state["mtp"]["hash_mode"], state["legacy"]["hash_mode"]} == \
        {"lookahead L=2", "legacy+drop"}
    reported: dict[str, list[int]] = {"mtp": [], "legacy": []}
    for length in range(29, 37):  # every remainder mod the block size, twice each
        prompt = tokens(length, length)
        for _ in range(2):
            response = complete(router, prompt, headers=key)
            engine = response.headers["x-speckv-engine"]
            reported[engine].append(
                response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            settle(router)
    samples = router_metrics(router)
    for engine in ("mtp", "legacy"):
        assert any(reported[engine]), reported  # both engines served hits
        assert value(samples, "speckv_router:prediction_checks_total", engine=engine) == \
            len(reported[engine])
        assert total(samples, "speckv_router:prediction_mismatches_total", engine=engine) == 0
        assert value(samples, "speckv_router:predicted_cached_tokens_total", engine=engine) \
            == sum(reported[engine])
    # the legacy engine drops a block on every hit; MTP with L = 2 loses one only when the
    # prompt ends right after a block boundary: the hits differ by mode
    assert all(c % BLOCK == 0 for cs in reported.values() for c in cs)


def test_an_engine_down_at_the_routers_start_joins_when_its_health_passes(pair, models):
    engines, routers = pair
    late = Engine(models["model"], engines["a"].flags)  # its port is known, nothing listens
    router = RouterProcess({"a": engines["a"], "late": late}).start()
    routers.append(router)
    try:
        state = router.state()["late"]
        assert (state["healthy"], state["reached"], state["epoch"]) == (False, False, None)
        assert complete(router, tokens(11, 20)).headers["x-speckv-engine"] == "a"
        late.start().wait()
        router.wait_state(lambda s: s["late"]["healthy"] and s["late"]["epochs_seen"] == 1)
        prompt = tokens(12, 41)  # served by `late` alone first: only it holds the prefix
        assert httpx.post(f"{late.url}/v1/completions", timeout=WATCHDOG_S, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2}).status_code == 200
        router.wait_state(lambda s: s["late"]["index"]["cached_blocks"] >= 10)
        response = complete(router, prompt)
        assert response.headers["x-speckv-engine"] == "late"
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
        assert total(router_metrics(router), "speckv_router:prediction_mismatches_total") == 0
    finally:
        late.kill()


def test_an_engine_killed_and_restarted(pair):
    engines, routers = pair
    # its own router, polling slowly: the kill is found by the next request
    router = RouterProcess(engines, ["--health-interval", "5"]).start()
    routers.append(router)
    router.wait_state(lambda s: s["a"]["subscriber"]["replayed_batches"] > 0)
    prompt = tokens(7, 33)
    victim = complete(router, prompt).headers["x-speckv-engine"]
    other = ({"a", "b"} - {victim}).pop()
    settle(router)
    engines[victim].kill()
    retried = complete(router, prompt)  # routed to the dead engine, retried on the other
    assert retried.headers["x-speckv-engine"] == other
    samples = router_metrics(router)
    assert value(samples, "speckv_router:retries_total", engine=victim) == 1
    assert value(samples, "speckv_router:requests_total", engine=other, reason="retry") == 1
    assert complete(router, prompt).headers["x-speckv-engine"] == other  # out of rotation

    engines[victim].start().wait()  # same ports, a new epoch
    state = router.wait_state(lambda s: s[victim]["healthy"] and s[victim]["epochs_seen"] == 2)
    assert state[victim]["index"]["cached_blocks"] == 0  # the old entries are gone
    assert state[victim]["index_resets"] >= 1

    # a stream that breaks mid-way ends with an error chunk
    body = {"model": MODEL_NAME, "prompt": tokens(8, 20), "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body,
                      timeout=WATCHDOG_S) as stream:
        streaming = stream.headers["x-speckv-engine"]
        for line in stream.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if len(events) == 1:
                    engines[streaming].kill()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "broke mid-way" in error["message"]
    samples = router_metrics(router)
    assert value(samples, "speckv_router:stream_errors_total", engine=streaming) == 1
    survivor = ({"a", "b"} - {streaming}).pop()
    assert complete(router, tokens(9, 12)).headers["x-speckv-engine"] == survivor
    assert total(samples, "speckv_router:prediction_mismatches_total") == 0


def test_contracts_the_router_cannot_reproduce_are_refused(start_server, monkeypatch):
    no_events = start_server(engine_config(block_size=4, num_blocks=32, hash_seed="0"))
    result = RouterProcess({"x": no_events}).run()
    assert result.returncode == 2
    assert "engine 'x': cache contract field 'kv_events'" in result.stderr
    assert "Traceback" not in result.stderr
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    random_seed = start_server(engine_config(block_size=4, num_blocks=32))
    with pytest.raises(ContractError, match="'hash_seed': the engine hashes with a random"):
        fetch_contracts([EngineSpec("y", random_seed.url)])  # what the CLI calls
