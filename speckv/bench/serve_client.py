"""The HTTP side of `speckv bench serve`: stream a workload to an OpenAI-compatible server.

Owns one request's measurement (`RequestResult`: TTFT, inter-token gaps, cached tokens,
acceptance from the usage report), a run's `Summary` (throughput, TTFT / TPOT / ITL mean,
median, p99), Poisson arrival offsets, the async client loop under a concurrency cap
(`run_http`), and reading the server's Prometheus `/metrics` text into totals and deltas.
`serve.py` (the command) and `route.py` (engines behind the router) drive it.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tqdm import tqdm

from speckv.workloads import (
    WorkloadRequest,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class Summary:
    name: str
    num_completed: int
    num_failed: int
    duration_s: float
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    # per-request latencies; None for LLM.generate (one call: no per-request arrival or end)
    ttft_mean_ms: float | None
    ttft_median_ms: float | None
    ttft_p99_ms: float | None
    tpot_mean_ms: float | None
    tpot_median_ms: float | None
    tpot_p99_ms: float | None
    itl_mean_ms: float | None
    itl_median_ms: float | None
    itl_p99_ms: float | None
    e2e_mean_ms: float | None
    hit_rate_metrics: float | None  # /metrics deltas (server) or the engine stats (in process)
    hit_rate_usage: float  # sum of cached_tokens / prompt tokens
    oracle_hit_rate: float | None
    acceptance_rate: float | None  # accepted / drafted tokens
    mean_acceptance_length: float | None  # 1 + accepted / verification steps with drafts
    # server runs only, means from /metrics histograms (times run from the handler's start):
    server_ttft_mean_ms: float | None = None  # HTTP arrival -> first token out of the engine
    server_queue_mean_ms: float | None = None  # HTTP arrival -> admitted into a step
    # client TTFT - server TTFT (both include the queue): what the HTTP path adds, the
    # client's send and the response's way back
    http_path_overhead_ms: float | None = None
    ttfts_ms: list[float] = field(repr=False, default_factory=list)


def summarize(name: str, results: list[RequestResult], duration_s: float, *,
              hit_rate_metrics: float | None, oracle_hit_rate: float | None,
              acceptance: tuple[float, float] | None, timed: bool = True) -> Summary:
    """`timed`: the results carry per-request TTFT / ITL / latency."""
    done = [r for r in results if r.success]
    ttfts = [1000 * r.ttft_s for r in done] if timed else []
    tpots = [1000 * (r.latency_s - r.ttft_s) / (r.output_tokens - 1)
             for r in done if r.output_tokens > 1]
    itls = [1000 * gap for r in done for gap in r.itl_s]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)

    def mean(values: list[float]) -> float | None:
        return statistics.fmean(values) if values and timed else None

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) if values and timed else None

    return Summary(
        name=name, num_completed=len(done), num_failed=len(results) - len(done),
        duration_s=duration_s, request_throughput=len(done) / duration_s,
        output_throughput=output_tokens / duration_s,
        total_token_throughput=(prompt_tokens + output_tokens) / duration_s,
        ttft_mean_ms=mean(ttfts), ttft_median_ms=pct(ttfts, 50),
        ttft_p99_ms=pct(ttfts, 99),
        tpot_mean_ms=mean(tpots), tpot_median_ms=pct(tpots, 50),
        tpot_p99_ms=pct(tpots, 99),
        itl_mean_ms=mean(itls), itl_median_ms=pct(itls, 50),
        itl_p99_ms=pct(itls, 99),
        e2e_mean_ms=mean([1000 * r.latency_s for r in done]),
        hit_rate_metrics=hit_rate_metrics,
        hit_rate_usage=sum(r.cached_tokens for r in done) / prompt_tokens if prompt_tokens else 0,
        oracle_hit_rate=oracle_hit_rate,
        acceptance_rate=acceptance[0] if acceptance else None,
        mean_acceptance_length=acceptance[1] if acceptance else None,
        ttfts_ms=ttfts,
    )


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request may be sent (Poisson; inf: all at 0)."""
    if math.isinf(rate):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    return np.cumsum(gaps).tolist()


# ---- the HTTP client -------------------------------------------------------------------------
def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def histogram_mean_ms(before: dict[str, float], after: dict[str, float],
                      name: str) -> float | None:
    count = _delta(after, before, f"{name}_count")
    return 1000 * _delta(after, before, f"{name}_sum") / count if count else None


def metrics_rates(before: dict[str, float], after: dict[str, float]
                  ) -> tuple[float | None, tuple[float, float] | None]:
    """(hit rate, (acceptance rate, mean acceptance length)) over a run, from /metrics."""
    queries = _delta(after, before, "vllm:prefix_cache_queries_total")
    hits = _delta(after, before, "vllm:prefix_cache_hits_total")
    drafted = _delta(after, before, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _delta(after, before, "vllm:spec_decode_num_accepted_tokens_total")
    drafts = _delta(after, before, "vllm:spec_decode_num_drafts_total")
    acceptance = (accepted / drafted, 1 + accepted / drafts) if drafted and drafts else None
    return (hits / queries if queries else None), acceptance


@dataclass(frozen=True)
class HttpTarget:
    base_url: str
    endpoint: str
    model: str
    api_key: str | None = None


def _request_body(target: HttpTarget, request: WorkloadRequest, text: str | None,
                  ignore_eos: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "max_tokens": request.output_len,
                            "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos}
    if target.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = request.prompt_token_ids
    return body


async def _send(client: Any, target: HttpTarget, body: dict[str, Any]) -> RequestResult:
    result = RequestResult(success=False)
    chat = "messages" in body
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", target.endpoint, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    result.cached_tokens = details.get("cached_tokens") or 0
                for choice in chunk.get("choices", []):
                    content = choice["delta"].get("content") if chat else choice.get("text")
                    if content:
                        now = time.perf_counter()
                        if result.ttft_s == 0.0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
        result.latency_s = time.perf_counter() - start
        result.success = result.output_tokens > 0
        if not result.success:
            result.error = "no usage chunk in the stream"
    except Exception as error:  # the run goes on; the failure is counted and shown
        result.error = f"{type(error).__name__}: {error}"
    return result


async def run_http(target: HttpTarget, requests: list[WorkloadRequest], texts: list[str | None],
                   *, request_rate: float, max_concurrency: int, ignore_eos: bool, seed: int,
                   progress: bool, desc: str = "server") -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency + 4,
                          max_keepalive_connections=max_concurrency + 4)
    offsets = arrival_offsets(len(requests), request_rate, seed)
    semaphore = asyncio.Semaphore(max_concurrency)
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, leave=False)
    async with httpx.AsyncClient(base_url=target.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(None, connect=30)) as client:
        start = time.perf_counter()

        async def one(index: int) -> RequestResult:
            await asyncio.sleep(max(0.0, offsets[index] - (time.perf_counter() - start)))
            async with semaphore:
                body = _request_body(target, requests[index], texts[index], ignore_eos)
                result = await _send(client, target, body)
            bar.update(1)
            return result

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def http_get(base_url: str, path: str, api_key: str | None = None,
             method: str = "GET") -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.request(method, f"{base_url}{path}", headers=headers, timeout=60)
    response.raise_for_status()
    return response


# ---- the same engine, in process --------------------------------------------------------------
