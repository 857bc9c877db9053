"""`speckv router --prefill URL --decode URL`: the prefill/decode proxy.

Owns the P/D flow of vLLM's disaggregated proxy, over engines started with
`--kv-transfer-config` (`speckv.connectors.nixl`):

    1. the request goes to a prefill engine with `kv_transfer_params: {"do_remote_decode":
       true}`, `max_tokens: 1`, not streamed; its response carries `kv_transfer_params`
       (the lease on the prompt's blocks, target and draft KV)
    2. the original request goes to a decode engine with those params; its answer (streamed
       or not) is passed through to the client unchanged

A prefill engine that fails or answers without params is not fatal: the decode engine then
gets the request without params and prefills it itself. Engines of each kind are used in turn.
Every answer names its engines by the router's names for them (`--prefill NAME=URL`, default
prefill0, decode0, ...): `x-speckv-engine` the decode engine that answered, `x-speckv-pd` both;
`/metrics` is the router's own (`speckv.router.pd_metrics`), not an engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from speckv.api.errors import APIError
from speckv.api.http_guard import (
    check_bearer_key,
    on_api_error,
    on_http_error,
    race_disconnect,
    read_body,
)
from speckv.api.protocol import parse_json_object
from speckv.router.pd_metrics import PDMetrics

logger = logging.getLogger("speckv.router")

ENGINE_HEADER = "x-speckv-engine"  # the decode engine that answered, as the KV router's
PD_HEADER = "x-speckv-pd"  # "prefill=NAME;decode=NAME" or "decode=NAME" (local prefill)


@dataclass(frozen=True)
class PDConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    # the router's names for them (headers, metrics); default prefill0.., decode0..
    prefill_names: tuple[str, ...] = ()
    decode_names: tuple[str, ...] = ()
    api_key: str | None = None
    engine_api_key: str | None = None
    max_request_body_bytes: int = 8 << 20
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.prefill_urls:
            raise ValueError("--prefill: at least one prefill engine URL")
        if not self.decode_urls:
            raise ValueError("--decode: at least one decode engine URL")
        for kind in ("prefill", "decode"):
            urls, names = getattr(self, f"{kind}_urls"), getattr(self, f"{kind}_names")
            if not names:
                object.__setattr__(self, f"{kind}_names",
                                   tuple(f"{kind}{i}" for i in range(len(urls))))
            elif len(names) != len(urls):
                raise ValueError(f"--{kind}: {len(names)} names for {len(urls)} URLs")
        names = (*self.prefill_names, *self.decode_names)
        if len(set(names)) != len(names):
            raise ValueError(f"--prefill / --decode: engine names must be unique, got {names}")


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body the prefill engine gets: one output token, not streamed, KV kept. Pure."""
    sent = {k: v for k, v in body.items()
            if k not in ("stream", "stream_options", "max_completion_tokens")}
    sent["max_tokens"] = 1
    sent["kv_transfer_params"] = {"do_remote_decode": True}
    return sent


class PDRouter:
    def __init__(self, config: PDConfig) -> None:
        self.config = config
        self._prefill = itertools.cycle(zip(config.prefill_names, config.prefill_urls))
        self._decode = itertools.cycle(zip(config.decode_names, config.decode_urls))
        self.client: httpx.AsyncClient | None = None
        self.counts = {"requests": 0, "transferred": 0, "local_prefill": 0}
        self.metrics = PDMetrics()

    def headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.config.engine_api_key:
            headers["authorization"] = f"Bearer {self.config.engine_api_key}"
        return headers

    async def prefill(self, path: str, body: dict[str, Any]) -> tuple[str, Any]:
        """(prefill engine's name, its kv_transfer_params or None when it failed)."""
        name, url = next(self._prefill)
        self.metrics.prefill_requests.labels(name).inc()
        url, params = await self._prefill_at(url, path, body)
        if not isinstance(params, dict):
            self.metrics.prefill_failures.labels(name).inc()
        return name, params

    async def _prefill_at(self, url: str, path: str, body: dict[str, Any]) -> tuple[str, Any]:
        assert self.client is not None
        try:
            response = await self.client.post(f"{url}{path}", json=prefill_body(body),
                                               headers=self.headers())
        except httpx.HTTPError as error:
            logger.warning("prefill engine %s failed (%s); the decode engine prefills", url,
                           error)
            return url, None
        if response.status_code != 200:
            if response.status_code < 500:  # the request itself is bad: say so
                raise _passthrough_error(response)
            logger.warning("prefill engine %s answered %d; the decode engine prefills", url,
                           response.status_code)
            return url, None
        with contextlib.suppress(ValueError, AttributeError):
            return url, json.loads(response.content).get("kv_transfer_params")
        return url, None


def _passthrough_error(response: httpx.Response) -> APIError:
    try:
        body = json.loads(response.content)["error"]
        return APIError(response.status_code, body.get("message", ""),
                        body.get("type", "invalid_request_error"), body.get("param"),
                        body.get("code"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return APIError(response.status_code, response.text[:500], "invalid_request_error")


class _Stream:
    """The decode engine's SSE answer, passed through; a client that leaves closes it."""

    def __init__(self, response: httpx.Response, header: str, engine: str) -> None:
        self.response = response
        self.header = header
        self.engine = engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.response.status_code,
                    "headers": [(b"content-type", self.response.headers.get(
                        "content-type", "text/event-stream").encode()),
                        (b"cache-control", b"no-cache"),
                        (PD_HEADER.encode(), self.header.encode()),
                        (ENGINE_HEADER.encode(), self.engine.encode())]})
        try:
            await race_disconnect(self._pump(send), receive)
        finally:
            await self.response.aclose()

    async def _pump(self, send: Send) -> None:
        with contextlib.suppress(httpx.HTTPError, OSError):
            async for data in self.response.aiter_raw():
                await send({"type": "http.response.body", "body": data, "more_body": True})
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def build_pd_app(router: PDRouter) -> Starlette:
    """The P/D router's app: the generation routes (`_pd_proxy_routes`: prefill on a prefill
    engine, then decode with its `kv_transfer_params`) and the router's own."""
    config = router.config

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def state(request: Request) -> JSONResponse:
        return JSONResponse({"mode": "pd",
                             "prefill": dict(zip(config.prefill_names, config.prefill_urls)),
                             "decode": dict(zip(config.decode_names, config.decode_urls)),
                             **router.counts})

    async def models(request: Request) -> Response:
        check_bearer_key(request, config.api_key)
        assert router.client is not None
        response = await router.client.get(f"{config.decode_urls[0]}/v1/models",
                                           headers=router.headers())
        return Response(response.content, status_code=response.status_code,
                        media_type="application/json")

    async def reset_prefix_cache(request: Request) -> Response:
        """Sent on to every engine (so `speckv bench serve --base-url ROUTER` works)."""
        check_bearer_key(request, config.api_key)
        assert router.client is not None
        urls = (*config.prefill_urls, *config.decode_urls)
        answers = await asyncio.gather(*(router.client.post(
            f"{url}/reset_prefix_cache", headers=router.headers()) for url in urls),
            return_exceptions=True)
        failed = [url for url, answer in zip(urls, answers)
                  if isinstance(answer, BaseException) or answer.status_code != 200]
        if failed:
            return JSONResponse({"success": False, "failed": failed}, status_code=409)
        return JSONResponse({"success": True})

    async def metrics(request: Request) -> Response:
        """The router's own metrics (each engine serves its own /metrics)."""
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        router.client = httpx.AsyncClient(timeout=config.timeout_s,
                                          limits=httpx.Limits(max_connections=512))
        try:
            yield
        finally:
            await router.client.aclose()

    return Starlette(
        routes=[*_pd_proxy_routes(router),
                Route("/v1/models", models, methods=["GET"]),
                Route("/health", health, methods=["GET"]),
                Route("/router/state", state, methods=["GET"]),
                Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
                Route("/metrics", metrics, methods=["GET"])],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error},
        lifespan=lifespan,
    )


def _pd_proxy_routes(router: PDRouter) -> list[Route]:
    """/v1/completions and /v1/chat/completions: the prompt prefilled on a prefill engine, the
    request sent on to a decode engine with the KV transfer's params (or prefilled there)."""
    config = router.config

    async def forward(request: Request, path: str) -> Any:
        check_bearer_key(request, config.api_key)
        body = parse_json_object(await read_body(request, config.max_request_body_bytes))
        router.counts["requests"] += 1
        prefill_name, params = await router.prefill(path, body)
        decode_name, decode_url = next(router._decode)
        sent = dict(body)
        if isinstance(params, dict):
            sent["kv_transfer_params"] = params
            reason = "transferred"
            header = f"prefill={prefill_name};decode={decode_name}"
        else:
            sent.pop("kv_transfer_params", None)
            reason = "local_prefill"
            header = f"decode={decode_name}"
        router.counts[reason] += 1
        router.metrics.requests.labels(decode_name, reason).inc()
        assert router.client is not None
        upstream = router.client.build_request("POST", f"{decode_url}{path}", json=sent,
                                               headers=router.headers())
        try:
            response = await router.client.send(upstream, stream=True)
        except httpx.HTTPError as error:
            router.metrics.upstream_errors.labels(decode_name).inc()
            raise APIError(502, f"The decode engine {decode_name} ({decode_url}) failed: "
                           f"{type(error).__name__}: {error}", "server_error", None,
                           "upstream_failed") from None
        if response.status_code >= 500:
            router.metrics.upstream_errors.labels(decode_name).inc()
        if body.get("stream") and response.status_code == 200:
            return _Stream(response, header, decode_name)
        content = await response.aread()
        await response.aclose()
        return Response(content, status_code=response.status_code,
                        headers={PD_HEADER: header, ENGINE_HEADER: decode_name},
                        media_type=response.headers.get("content-type", "application/json"))

    async def completions(request: Request) -> Any:
        return await forward(request, "/v1/completions")

    async def chat_completions(request: Request) -> Any:
        return await forward(request, "/v1/chat/completions")

    return [Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"])]
