"""The router's HTTP app (Starlette, served by uvicorn; httpx to the engines).

    POST /v1/completions, /v1/chat/completions   planned, routed, forwarded byte for byte;
                                                 SSE streams passed through chunk by chunk
    GET  /v1/models                              the engines' served model
    GET  /health                                 200 while an engine is in rotation, else 503
    GET  /metrics                                the router's Prometheus metrics
    GET  /router/state                           per-engine rotation, load, index, events (JSON)
    POST /reset_prefix_cache                     sent on to every engine in rotation (their
                                                 AllBlocksCleared events empty the index)

Owns the request path: the API key (`--api-key`, as `Authorization: Bearer` on every `/v1`
route and the state), the body limit (413), the in-flight bound (503 + Retry-After), prompt
parsing with the server's own code (`speckv.api.protocol`: the engine's tokenizer and chat
template, and the engine's errors for bad input), the policy's choice, one retry on another
engine for a request that failed before any byte was sent back (connection refused, 5xx), an
error chunk + `[DONE]` for a stream that breaks mid-way, and checking each reported
`cached_tokens` against the prediction. Every answer from an engine carries its name in the
`x-speckv-engine` header. The engine's own key (`--engine-api-key`) is sent on;
the client's never is.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from speckv.api import errors
from speckv.api.errors import APIError
from speckv.api.http_guard import (
    check_bearer_key,
    client_gone_handler,
    on_api_error,
    on_http_error,
    race_disconnect,
    read_body,
)
from speckv.api.protocol import (
    SSE_DONE,
    GenerationRequest,
    ModelLimits,
    error_chunk,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from speckv.router.engine_probe import EngineDown, flush_events, read_contract
from speckv.router.fleet import EngineLink, EnginePlan, Fleet
from speckv.router.metrics import RouterMetrics
from speckv.router.policy import Decision, Policy

logger = logging.getLogger("speckv.router")
ENGINE_HEADER = "x-speckv-engine"  # which engine answered (debugging, tests)
_LOAD_METRICS = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
                 "vllm:kv_cache_usage_perc": "kv_usage"}


@dataclass(frozen=True)
class RouterConfig:
    api_key: str | None = None
    max_request_body_bytes: int = 8 * 1024**2
    max_inflight_requests: int = 1024  # over all engines; more get 503 + Retry-After
    retry_after_s: int = 1
    health_interval_s: float = 0.5
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0  # between bytes of an engine's answer

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key:
            raise ValueError("--api-key must not be empty")
        for name in ("max_request_body_bytes", "max_inflight_requests", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if not self.health_interval_s > 0:
            raise ValueError("--health-interval must be > 0")


def load_from_metrics(text: str) -> dict[str, float]:
    """running / waiting / kv_usage from an engine's /metrics (vLLM's names), summed."""
    load: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        key = _LOAD_METRICS.get(family.name)
        if key is not None:
            load[key] = sum(sample.value for sample in family.samples)
    return load


async def poll_engine(client: httpx.AsyncClient, fleet: Fleet, link: EngineLink,
                      timeout_s: float) -> None:
    """One health poll: /health, the contract (a speckv engine's, or the one a vLLM engine's
    /metrics and /v1/models give), the load. Any failure takes it out."""
    try:
        health = await client.get(f"{link.spec.url}/health", timeout=timeout_s)
        if health.status_code != 200:
            fleet.mark_unhealthy(link, f"/health answered {health.status_code}")
            return
        probe = await read_contract(client, link.spec, timeout_s)
    except EngineDown as down:
        fleet.mark_unhealthy(link, str(down))
        return
    except httpx.HTTPError as error:
        fleet.mark_unhealthy(link, f"{type(error).__name__}: {error}")
        return
    except ValueError as error:
        fleet.refuse(link, error)
        return
    fleet.engine_healthy(link, probe.contract, load_from_metrics(probe.metrics_text))


def _no_engine(retry_after_s: int) -> APIError:
    return APIError(503, "No engine is in rotation (all failed their health checks or were "
                    "refused).", "server_error", None, "no_engine",
                    {"Retry-After": str(retry_after_s)})


def _upstream_failed(engine: str, detail: str) -> APIError:
    return APIError(502, f"engine {engine!r} failed: {detail}", "server_error", None,
                    "upstream_error")


class _SSEUsage:
    """Finds the `usage` of a passing SSE stream without holding it up."""

    def __init__(self) -> None:
        self._buffer = b""
        self.usage: Any = None

    def feed(self, data: bytes) -> None:
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            if b'"prompt_tokens_details"' not in event:
                continue
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    with contextlib.suppress(ValueError):
                        usage = json.loads(line[5:]).get("usage")
                        if usage:
                            self.usage = usage


class Router:
    """The fleet, its policy, metrics and HTTP client; `app` is the ASGI app."""

    def __init__(self, fleet: Fleet, policy: Policy, config: RouterConfig) -> None:
        self.fleet = fleet
        self.policy = policy
        self.config = config
        self.metrics = RouterMetrics(fleet)
        self.created = int(time.time())
        self.inflight = 0
        self.client: httpx.AsyncClient | None = None
        self.app = build_app(self)

    # ---- planning ------------------------------------------------------------------------------
    def parse(self, kind: str, body: dict[str, Any]) -> dict[str, GenerationRequest]:
        """The request as each engine will see it, keyed by engine (one parse per distinct
        tokenizer and limits); the engine's APIError for bad input."""
        parse = parse_completion if kind == "completion" else parse_chat
        parsed: dict[tuple[Any, ...], GenerationRequest] = {}
        out: dict[str, GenerationRequest] = {}
        for name, link in self.fleet.links.items():
            c = link.contract
            if c is None:  # not reached yet: not in rotation
                continue
            key = (c.tokenizer, c.max_model_len, c.vocab_size)
            if key not in parsed:
                tokenizer = self.fleet.tokenizers.get(name, c.model, c.tokenizer)
                limits = ModelLimits(c.served_model_name, c.max_model_len, c.vocab_size)
                parsed[key] = parse(body, limits, tokenizer)
            out[name] = parsed[key]
        return out

    def plan(self, requests: dict[str, GenerationRequest]) -> dict[str, EnginePlan]:
        groups: dict[int, list[str]] = {}
        for name, generation in requests.items():
            groups.setdefault(id(generation), []).append(name)
        plans: dict[str, EnginePlan] = {}
        for names in groups.values():
            plans.update(self.fleet.plan(requests[names[0]].prompt_token_ids, names))
        return plans

    def choose(self, plans: dict[str, EnginePlan], exclude: set[str]) -> Decision | None:
        views = self.fleet.views(plans, exclude)
        num_tokens = next(iter(plans.values())).num_prompt_tokens
        decision = self.policy.choose(views, num_tokens)
        if decision is not None and exclude:
            decision = Decision(decision.engine, "retry", decision.costs)
        return decision

    # ---- health --------------------------------------------------------------------------------
    async def health_loop(self) -> None:
        assert self.client is not None
        interval = self.config.health_interval_s
        while True:
            await asyncio.gather(*(poll_engine(self.client, self.fleet, link,
                                               max(1.0, 2 * interval))
                                   for link in self.fleet.links.values()))
            self.fleet.expire_stale()
            await asyncio.sleep(interval)


class _Stream:
    """An engine's SSE answer passed through chunk by chunk; a break mid-way ends it with an
    error chunk and `[DONE]`; a client that leaves closes the engine's stream (so the engine
    aborts the request)."""

    def __init__(self, router: Router, engine: str, response: httpx.Response,
                 plan: EnginePlan, done: Callable[[bool, Any], None]) -> None:
        self.router = router
        self.engine = engine
        self.response = response
        self.plan = plan
        self.done = done  # (served, usage)
        self.usage: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-type", self.response.headers.get(
                        "content-type", "text/event-stream").encode()),
                   (b"cache-control", b"no-cache"), (ENGINE_HEADER.encode(), self.engine.encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        try:
            await race_disconnect(self._pump(send), receive)
        finally:
            await self.response.aclose()
            self.done(True, self.usage)

    async def _pump(self, send: Send) -> None:
        usage = _SSEUsage()
        reported = False
        try:
            async for data in self.response.aiter_raw():
                usage.feed(data)
                if usage.usage is not None and not reported:
                    # counted as soon as it passes: a client may leave right after [DONE],
                    # before the engine closes its stream, and cancel this pump
                    self._report(usage.usage)
                    self.usage = usage.usage
                    reported = True
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except httpx.HTTPError as error:
            self.router.metrics.stream_errors.labels(self.engine).inc()
            self.router.fleet.mark_unhealthy(self.router.fleet.links[self.engine],
                                             f"stream broke: {type(error).__name__}")
            chunk = error_chunk(_upstream_failed(self.engine, f"the stream broke mid-way "
                                                 f"({type(error).__name__}: {error})"))
            await send({"type": "http.response.body", "body": chunk + SSE_DONE,
                        "more_body": True})
        except OSError:
            return  # the client went away mid-send
        if not reported:
            self._report(usage.usage)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    def _report(self, usage: Any) -> None:
        self.router.metrics.report(self.engine, self.plan.predicted_cached_tokens, usage,
                                   self.plan.num_prompt_tokens)


def _check_api_key(router: Router, request: Request) -> None:
    check_bearer_key(request, router.config.api_key)


def _passthrough(response: httpx.Response, content: bytes, engine: str) -> Response:
    headers = {k: v for k, v in response.headers.items() if k.lower() == "retry-after"}
    headers[ENGINE_HEADER] = engine
    return Response(content, status_code=response.status_code, headers=headers,
                    media_type=response.headers.get("content-type", "application/json"))


def build_app(router: Router) -> Starlette:
    """The Starlette app: every route is a closure over the one router state (config, fleet,
    index, metrics), built in two groups: the proxied generation routes (`_proxy_routes`)
    and the router's own (`_service_routes`)."""
    config = router.config
    fleet = router.fleet

    async def on_unexpected(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error routing %s", request.url.path)
        failure = APIError(500, f"Internal router error: {type(error).__name__}: {error}",
                           "server_error")
        return JSONResponse(failure.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        total = config.max_inflight_requests + 16
        router.client = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=total, max_keepalive_connections=total),
            timeout=httpx.Timeout(config.request_timeout_s, connect=config.connect_timeout_s))
        fleet.start()
        health = asyncio.ensure_future(router.health_loop())
        try:
            yield
        finally:
            health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await health
            await router.client.aclose()
            fleet.stop()

    return Starlette(
        routes=[*_proxy_routes(router), *_service_routes(router)],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                            ClientDisconnect: client_gone_handler(logger),
                            Exception: on_unexpected},
        lifespan=lifespan,
    )


def _proxy_routes(router: Router) -> list[Route]:
    """/v1/completions and /v1/chat/completions: routed to an engine (`_try_engine`), one
    retry on another engine after an upstream failure."""
    config = router.config

    async def forward(request: Request, kind: str, path: str) -> Any:
        _check_api_key(router, request)
        raw = await read_body(request, config.max_request_body_bytes)
        body = parse_json_object(raw)
        if router.inflight >= config.max_inflight_requests:
            raise errors.queue_full(router.inflight, config.retry_after_s)
        requests = router.parse(kind, body)
        if not requests:
            raise _no_engine(config.retry_after_s)
        plans = router.plan(requests)
        stream = bool(body.get("stream"))
        tried: set[str] = set()
        last_error: APIError | None = None
        assert router.client is not None
        while len(tried) < 2:
            decision = router.choose(plans, tried)
            if decision is None:
                break
            tried.add(decision.engine)
            response, error = await _try_engine(
                router, decision, plans, raw, path, stream, tried,
                requests[decision.engine].params.max_tokens)
            if response is not None:
                return response
            last_error = error
        if last_error is not None:
            raise last_error
        raise _no_engine(config.retry_after_s)

    async def completions(request: Request) -> Any:
        return await forward(request, "completion", "/v1/completions")

    async def chat_completions(request: Request) -> Any:
        return await forward(request, "chat", "/v1/chat/completions")

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


async def _try_engine(router: Router, decision: Decision, plans: dict[str, EnginePlan], raw: bytes,
                     path: str, stream: bool, tried: set[str], max_output_tokens: int
                     ) -> tuple[Response | None, APIError | None]:
    """One try of a request on the engine `decision` chose: (the response to return, None),
    or (None, the error) when the next engine should be tried."""
    fleet = router.fleet
    assert router.client is not None
    last_error: APIError | None = None
    engine = decision.engine
    link = fleet.links[engine]
    plan = plans[engine]
    router.metrics.requests.labels(engine, decision.reason).inc()
    fleet.routed(engine, plan)
    router.inflight += 1
    settled = False
    served, usage = False, None  # whether the engine took the request, and its usage

    def done(served: bool, usage: Any, engine: str = engine, plan: EnginePlan = plan) -> None:
        router.inflight -= 1  # output tokens from usage, else max_tokens (an upper bound)
        tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        fleet.finished(engine, plan, None if not served else tokens
                       if isinstance(tokens, int) and tokens >= 0 else max_output_tokens)

    try:
        upstream = router.client.build_request(
            "POST", f"{link.spec.url}{path}", content=raw,
            headers={"content-type": "application/json", **link.headers()})
        response = await router.client.send(upstream, stream=True)
        if response.status_code >= 500:
            content = await response.aread()
            await response.aclose()
            router.metrics.upstream_errors.labels(engine).inc()
            last_error = _upstream_failed(engine, f"HTTP {response.status_code}: "
                                          f"{content[:200]!r}")
            if len(tried) < 2 and len(fleet.links) > 1:
                router.metrics.retries.labels(engine).inc()
                return None, last_error
            return _passthrough(response, content, engine), None
        if stream and response.status_code == 200:
            settled = True  # the stream's end settles it
            return _Stream(router, engine, response, plan, done), None
        content = await response.aread()
        await response.aclose()
        if response.status_code == 200:
            served = True
            with contextlib.suppress(ValueError, AttributeError):
                usage = json.loads(content).get("usage")
                router.metrics.report(engine, plan.predicted_cached_tokens, usage,
                                      plan.num_prompt_tokens)
        return _passthrough(response, content, engine), None
    except httpx.HTTPError as error:
        router.metrics.upstream_errors.labels(engine).inc()
        fleet.mark_unhealthy(link, f"{type(error).__name__}: {error}")
        last_error = _upstream_failed(engine, f"{type(error).__name__}: {error}")
        router.metrics.retries.labels(engine).inc()
    finally:
        if not settled:
            done(served, usage)
    return None, last_error


def _service_routes(router: Router) -> list[Route]:
    """Models, health, metrics, the router's state and the fleet-wide prefix-cache reset."""
    fleet = router.fleet

    async def models(request: Request) -> JSONResponse:
        _check_api_key(router, request)
        first = fleet.first_contract()
        if first is None:  # no engine has answered yet: no model to name
            return JSONResponse({"object": "list", "data": []})
        return JSONResponse({"object": "list", "data": [{
            "id": fleet.served_model_name, "object": "model", "created": router.created,
            "owned_by": "speckv", "root": first.model, "parent": None,
            "max_model_len": first.max_model_len}]})

    async def health(request: Request) -> Response:
        if any(link.in_rotation for link in fleet.links.values()):
            return Response(status_code=200)
        return JSONResponse(APIError(503, "No engine is in rotation.", "server_error").body(),
                            status_code=503)

    async def metrics(request: Request) -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def state(request: Request) -> JSONResponse:
        _check_api_key(router, request)
        return JSONResponse({"policy": router.policy.name, "engines": fleet.state()})

    async def reset_prefix_cache(request: Request) -> Response:
        _check_api_key(router, request)
        assert router.client is not None
        links = [link for link in fleet.links.values() if link.in_rotation]

        async def reset(link: EngineLink) -> httpx.Response:
            return await router.client.post(f"{link.spec.url}/reset_prefix_cache",
                                            headers=link.headers())

        try:
            answers = await asyncio.gather(*(reset(link) for link in links))
        except httpx.HTTPError as error:
            raise _upstream_failed("?", f"{type(error).__name__}: {error}") from None
        for link, answer in zip(links, answers):
            if answer.status_code != 200:
                return _passthrough(answer, answer.content, link.name)
            with contextlib.suppress(ValueError, AttributeError):
                if answer.json().get("success") is False:  # vLLM: blocks still held
                    return _passthrough(answer, answer.content, link.name)
            # a vLLM engine publishes its AllBlocksCleared with its next step's events: the
            # index forgets the engine's blocks now, and the engine is made to step so that
            # the event comes too. Without it, blocks a replay still delivers after this clear
            # (a router started just before the reset) would stay until the engine's next
            # request.
            fleet.cleared(link)
            if link.contract is not None and link.contract.vllm:
                await flush_events(router.client, link.spec, link.contract,
                                   router.config.request_timeout_s)
        return JSONResponse({"success": True, "engines": [link.name for link in links]})

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/router/state", state, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
    ]
