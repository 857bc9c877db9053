"""`speckv router` in front of real vLLM CPU engines (vLLM 0.32 from the venv that
SPECKV_VLLM_VENV names; skipped without it): two vLLM engines of the built-in model, one with
speckv's EAGLE3 head (vLLM's last-block drop), behind the router; the predicted cached tokens
equal each engine's `usage.prompt_tokens_details.cached_tokens`; the kv policy hits more than
round-robin; an engine killed and restarted (a new epoch: its entries dropped, its events
replayed); a mixed fleet of one `speckv serve` and one vLLM engine; flags that contradict an
engine refused naming both values."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from speckv.bench.vllm_fleet import VLLMEngine, builtin_model_dir, eagle3_config
from speckv.events.endpoints import LOOPBACK, free_port, loopback_endpoint
from speckv.router.contract import ContractError
from speckv.router.engine_probe import fetch_contracts
from speckv.router.fleet import EngineSpec
from speckv.router.vllm_engine import VLLMFlags
from tests.patience import WATCHDOG_S
from tests.router.fleet_utils import ENV, RouterProcess, wait_http
from tests.server.server_test_utils import scrape

VENV = os.environ.get("SPECKV_VLLM_VENV")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(
    not VENV or not (Path(VENV) / "bin" / "vllm").is_file(),
    reason="set SPECKV_VLLM_VENV to a venv with vLLM 0.32 (CPU) to run the vLLM router tests")]
MODEL = "builtin"


class SpeckvEngine:
    """`speckv serve builtin` with the EAGLE3 head, KV events on loopback."""

    def __init__(self) -> None:
        self.port = free_port()
        self.pub, self.replay = loopback_endpoint(), loopback_endpoint()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> SpeckvEngine:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "speckv.cli", "serve", "builtin", "--port", str(self.port),
             "--served-model-name", MODEL, "--hash-seed", "0", "--threads", "1",
             "--speculative-method", "eagle3", "--kv-events-endpoint", self.pub,
             "--kv-events-replay-endpoint", self.replay], env=ENV,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(WATCHDOG_S)


def wait_vllm(engine: VLLMEngine, log: Path) -> None:
    try:
        wait_http(engine.url, engine.process, cpu_budget_s=600)
    except RuntimeError as error:
        raise RuntimeError(f"{error}\n{log.read_text()[-3000:]}") from None


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("vllm-logs")
    model = builtin_model_dir()
    vllm = {"plain": VLLMEngine(Path(VENV), model),
            "eagle": VLLMEngine(Path(VENV), model, speculative_config=eagle3_config(3))}
    speckv = SpeckvEngine()
    try:
        for name, engine in vllm.items():
            engine.start(logs / f"{name}.log")
        speckv.start()
        with ThreadPoolExecutor(3) as pool:  # they load side by side
            list(pool.map(lambda item: wait_vllm(item[1], logs / f"{item[0]}.log"),
                          vllm.items()))
            wait_http(speckv.url, speckv.process, cpu_budget_s=300)
        yield {**vllm, "speckv": speckv, "logs": logs}
    finally:
        for engine in (*vllm.values(), speckv):
            engine.stop()


def router_over(engines: dict, names: list[str], *flags: str) -> RouterProcess:
    router = RouterProcess({}, list(flags))
    for name in names:
        engine = engines[name]
        router.flags += engine.router_flags(name) if isinstance(engine, VLLMEngine) \
            else [f"--engine={name}={engine.url}"]
    return router.start()


def prompts(seed: int, num_prefixes: int, rounds: int) -> list[list[int]]:
    """Token-id prompts: prefixes of 4 blocks and 10 tokens, each sent `rounds` times with a
    fresh suffix, interleaved."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000, 40000) for _ in range(138)] for _ in range(num_prefixes)]
    return [prefix + [rng.randrange(1000, 40000) for _ in range(20)]
            for _ in range(rounds) for prefix in prefixes]


def send(router: RouterProcess, prompt: list[int]) -> httpx.Response:
    response = httpx.post(f"{router.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text
    router.wait_state(lambda s: all(e["index"]["pending_blocks"] == 0 for e in s.values()),
                      cpu_budget_s=60)
    return response


def totals(router: RouterProcess) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, _), value in scrape(router.url).items():
        out[name] = out.get(name, 0.0) + value
    return out


def run_policy(engines: dict, names: list[str], policy: str, workload) -> tuple[float, dict]:
    """The hit rate of `workload` through a router with `policy` (caches reset first), and the
    router's metric totals."""
    router = router_over(engines, names, "--policy", policy)
    try:
        reset = httpx.post(f"{router.url}/reset_prefix_cache", timeout=WATCHDOG_S)
        assert reset.status_code == 200, reset.text
        router.wait_state(lambda s: all(e["index"]["cached_blocks"] == 0 for e in s.values()))
        cached = prompt_tokens = 0
        for prompt in workload:
            usage = send(router, prompt).json()["usage"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            prompt_tokens += usage["prompt_tokens"]
        return cached / prompt_tokens, totals(router)
    finally:
        router.stop()


def test_predictions_equal_vllm_reports_and_kv_beats_round_robin(engines):
    workload = prompts(0, 5, 3)  # an odd count: round-robin moves each prefix
    kv_hits, kv = run_policy(engines, ["plain", "eagle"], "kv", workload)
    assert kv.get("speckv_router:prediction_checks_total", 0) == len(workload)
    assert kv.get("speckv_router:prediction_mismatches_total", 0) <= len(workload) // 100
    assert kv.get("speckv_router:prompt_token_mismatches_total", 0) == 0
    assert kv.get("speckv_router:hash_mismatched_blocks_total", 0) == 0
    assert kv.get("speckv_router:reported_cached_tokens_total", 0) > 0
    rr_hits, rr = run_policy(engines, ["plain", "eagle"], "round-robin", workload)
    assert rr.get("speckv_router:prediction_mismatches_total", 0) <= len(workload) // 100
    assert kv_hits > rr_hits


def test_the_eagle_engine_drops_its_last_block_and_the_router_predicts_it(engines):
    router = router_over(engines, ["eagle"])
    try:
        prompt = prompts(1, 1, 1)[0]  # 158 tokens: 4 whole blocks of 32 before N - 1
        send(router, prompt)
        usage = send(router, prompt).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 3 * 32  # one block dropped
        state = router.state()["eagle"]
        assert state["hash_mode"] == "legacy+drop"
        assert totals(router).get("speckv_router:prediction_mismatches_total", 0) == 0
    finally:
        router.stop()


def test_a_router_started_after_an_engine_reset_sees_the_reset(engines):
    """vLLM publishes a step's events after the step: an idle engine reset directly shows its
    AllBlocksCleared only at its next step. The router makes it step before replaying its
    events, so it does not predict the blocks of before the reset."""
    plain = engines["plain"]
    prompt = prompts(6, 1, 1)[0]
    assert httpx.post(f"{plain.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL, "prompt": prompt, "max_tokens": 1}).status_code == 200
    assert httpx.post(f"{plain.url}/reset_prefix_cache", timeout=WATCHDOG_S).status_code == 200
    router = router_over(engines, ["plain"])
    try:
        usage = send(router, prompt).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        metrics = totals(router)
        assert metrics.get("speckv_router:prediction_checks_total", 0) == 1
        assert metrics.get("speckv_router:prediction_mismatches_total", 0) == 0
    finally:
        router.stop()


def test_a_reset_through_the_router_brings_the_engines_own_clear(engines):
    """The router forgets a vLLM engine's blocks when it resets it, and makes the engine step
    so that its AllBlocksCleared follows: a router whose replay is still delivering the
    blocks of before the reset (just started) would otherwise keep them while the engine
    idles."""
    router = router_over(engines, ["plain"])
    try:
        send(router, prompts(7, 1, 1)[0])
        before = router.wait_state(
            lambda s: s["plain"]["index"]["cached_blocks"] > 0)["plain"]["index"]["clears"]
        reset = httpx.post(f"{router.url}/reset_prefix_cache", timeout=WATCHDOG_S)
        assert reset.status_code == 200, reset.text
        router.wait_state(lambda s: s["plain"]["index"]["clears"] > before
                          and s["plain"]["index"]["cached_blocks"] == 0)
    finally:
        router.stop()


def test_a_mixed_fleet_of_speckv_and_vllm(engines):
    router = router_over(engines, ["speckv", "plain"])
    try:
        served = {send(router, prompt).headers["x-speckv-engine"]
                  for prompt in prompts(2, 2, 3)}
        assert served == {"speckv", "plain"}
        state = router.state()
        assert state["speckv"]["hash_mode"].startswith("lookahead")
        assert state["plain"]["hash_mode"] == "legacy"
        metrics = totals(router)
        assert metrics.get("speckv_router:prediction_checks_total", 0) == 6
        assert metrics.get("speckv_router:prediction_mismatches_total", 0) == 0
        assert metrics.get("speckv_router:reported_cached_tokens_total", 0) > 0
    finally:
        router.stop()


def test_flags_the_engine_contradicts_are_refused(engines):
    plain, eagle = engines["plain"], engines["eagle"]
    events = plain.kv_events_config()
    # a block stored from the root, for the events to say which seed and lookahead it hashes with
    assert httpx.post(f"{plain.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL, "prompt": prompts(5, 1, 1)[0], "max_tokens": 1}).status_code == 200
    with pytest.raises(ContractError, match=r"'hash_seed'.*--vllm-hash-seed '7'.*seed '0' "
                       "reproduces them"):
        fetch_contracts([EngineSpec("plain", plain.url, vllm=VLLMFlags(events, "7"))])
    with pytest.raises(ContractError, match="says method 'eagle3', but the engine does not "
                       "speculate"):
        fetch_contracts([EngineSpec("plain", plain.url, vllm=VLLMFlags(
            events, "0", eagle3_config()))])
    with pytest.raises(ContractError, match="the engine speculates"):
        fetch_contracts([EngineSpec("eagle", eagle.url, vllm=VLLMFlags(
            eagle.kv_events_config(), "0"))])
    with pytest.raises(ContractError, match="--vllm-lookahead-tokens 1, but the engine's KV "
                       "events carry 0"):
        fetch_contracts([EngineSpec("plain", plain.url, vllm=VLLMFlags(
            events, "0", None, 1))])
    with pytest.raises(ContractError, match="'kv_events': no KV events"):
        fetch_contracts([EngineSpec("plain", plain.url, vllm=VLLMFlags(None, "0"))])


def test_a_vllm_engine_killed_and_restarted(engines):
    plain = engines["plain"]
    router = router_over(engines, ["plain", "eagle"], "--health-interval", "0.3")
    try:
        prompt = prompts(3, 1, 1)[0]
        first = send(router, prompt).headers["x-speckv-engine"]
        epoch = router.state()["plain"]["epoch"]
        plain.stop()
        router.wait_state(lambda s: not s["plain"]["healthy"], cpu_budget_s=60)
        assert send(router, prompt).headers["x-speckv-engine"] == "eagle"
        plain.start(engines["logs"] / "plain-restarted.log")
        wait_vllm(plain, engines["logs"] / "plain-restarted.log")
        state = router.wait_state(lambda s: s["plain"]["healthy"]
                                  and s["plain"]["epochs_seen"] == 2, cpu_budget_s=120)
        assert state["plain"]["epoch"] != epoch and state["plain"]["index_resets"] >= 1
        assert first in ("plain", "eagle")
        for other in prompts(4, 2, 2):  # both engines serve again, predictions exact
            send(router, other)
        metrics = totals(router)
        assert metrics.get("speckv_router:prediction_mismatches_total", 0) == 0
        assert metrics.get("speckv_router:epochs_total", 0) >= 3  # plain twice, eagle once
    finally:
        router.stop()
