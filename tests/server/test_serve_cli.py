"""`speckv serve` and `speckv bench serve` as real subprocesses, on the tiny model saved as an HF
directory: health, a repeated chat request served from the prefix cache, KV events on the
configured endpoints, a clean exit on SIGINT, and the benchmark's JSON and chart."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from speckv.events.endpoints import LOOPBACK, loopback_endpoint
from speckv.events.schema import BlockStored
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.models import save_hf_dir
from tests import patience
from tests.patience import WATCHDOG_S, wait_until
from tests.server.server_test_utils import TINY_CONFIG, TOKENIZER

pytestmark = pytest.mark.slow
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}


def speckv(*args: str, cpu_budget_s: float = 300) -> subprocess.CompletedProcess:
    return patience.run([sys.executable, "-m", "speckv.cli", *args], cpu_budget_s, env=ENV)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_chat_model) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    save_hf_dir(path, TINY_CONFIG, tiny_chat_model.state_dict().items(), TOKENIZER)
    return path


def test_help_and_a_busy_port():
    result = speckv("serve", "--help")
    assert result.returncode == 0
    for flag in ("--served-model-name", "--api-key", "--kv-events-endpoint",
                 "--kv-events-replay-endpoint", "--speculative-method", "--speculative-model",
                 "--num-spec-tokens", "--block-size", "--kv-cache-memory-bytes", "--dtype",
                 "--device", "--prefix-caching-hash-algo", "--disable-lookahead-block-hashes"):
        assert flag in result.stdout
    assert speckv("bench", "serve", "--help").returncode == 0
    import socket

    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        result = speckv("serve", "--port", str(port))
    assert result.returncode == 2
    assert result.stderr.startswith("speckv: error: cannot listen on")
    assert "Traceback" not in result.stderr


def test_serve_end_to_end_with_kv_events(model_dir):
    pub, replay = loopback_endpoint(), loopback_endpoint()
    process = subprocess.Popen(  # --port 0: the first stdout line names the port it bound
        [sys.executable, "-m", "speckv.cli", "serve", str(model_dir), "--port", "0",
         "--served-model-name", "tiny", "--block-size", "4", "--threads", "1",
         "--kv-events-endpoint", pub, "--kv-events-replay-endpoint", replay],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first_line = process.stdout.readline()
        assert "speckv serve: tiny on" in first_line, process.stderr.read()
        budget, speculation = process.stdout.readline(), process.stdout.readline()
        assert budget.startswith("speckv serve: KV budget: ")
        # which drafter runs, or why none: this model ships none and no flag asked for one
        assert speculation == "speckv serve: speculation off\n"
        port = int(first_line.split(f"http://{LOOPBACK}:")[1].split()[0])
        assert port != 0
        base = f"http://{LOOPBACK}:{port}"
        def healthy() -> bool:
            assert process.poll() is None, process.stderr.read()
            try:
                return httpx.get(f"{base}/health", timeout=WATCHDOG_S).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy, "the server answers /health", 120, (process.pid,), poll_s=0.1)
        messages = [{"role": "user", "content": "Repeat after me: " + "cache this. " * 6}]
        with openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0) as client:
            first, second = (client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=5, temperature=0)
                for _ in range(2))
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        with EventSubscriber(SubscriberConfig(endpoint=pub, replay_endpoint=replay)) as sub:
            stored = []

            def got_one() -> bool:
                stored.extend(e for _, batch in sub.poll(0.2) for e in batch.events
                              if isinstance(e, BlockStored))
                return bool(stored)

            wait_until(got_one, "a BlockStored event from the server's engine",
                       pids=(process.pid,), poll_s=0)
    finally:
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=WATCHDOG_S)
    assert process.returncode == 0, err
    assert "Traceback" not in err


def test_bench_serve_launches_the_server_and_compares_in_process(model_dir, tmp_path):
    result = speckv("bench", "serve", "--model", str(model_dir), "--block-size", "4",
                    "--threads", "1", "--num-prompts", "12", "--prefix-len", "24",
                    "--suffix-len", "8", "--num-prefixes", "3", "--output-len", "6",
                    "--max-concurrency", "4", "--ignore-eos", "--compare-in-process",
                    "--repeat", "2", "--json", "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    server, loop, generate = payload["runs"]
    assert [r["name"] for r in payload["runs"]] == ["server", "in-process", "LLM.generate"]
    for run in payload["runs"]:
        assert (run["num_completed"], run["num_failed"]) == (24, 0)  # 2 repeats of 12
        assert run["output_throughput"] > 0
    assert server["hit_rate_metrics"] == pytest.approx(server["hit_rate_usage"])
    assert 0 < server["hit_rate_usage"] <= server["oracle_hit_rate"]
    assert server["ttft_median_ms"] > 0 and server["itl_mean_ms"] > 0
    # the server's own TTFT (from the handler) is inside the client's
    assert 0 < server["server_ttft_mean_ms"] < server["ttft_mean_ms"]
    assert server["http_path_overhead_ms"] > 0 and loop["http_path_overhead_ms"] is None
    # the HTTP path alone, not the queue (the median of 2 repeats is their mean: linear)
    assert server["http_path_overhead_ms"] == pytest.approx(
        server["ttft_mean_ms"] - server["server_ttft_mean_ms"])
    assert generate["ttft_median_ms"] is None  # one call: no per-request timing
    assert payload["server_errors"] == []
    assert (tmp_path / "ttft.png").stat().st_size > 0
    assert json.loads((tmp_path / "results.json").read_text())["runs"][1] == loop
