"""The HTTP app (Starlette, served by uvicorn): endpoints over the engine loop.

    POST /v1/completions, /v1/chat/completions   JSON, or SSE with `stream: true`
    GET  /v1/models                              the served model
    GET  /health                                 200; 503 once the engine loop has died
    GET  /metrics                                Prometheus text (vLLM's metric names)
    POST /reset_prefix_cache                     forget cached blocks (409 while requests hold
                                                 blocks)
    GET  /version
    POST /tokenize, /detokenize                  as vLLM serves them (`speckv.api.tokenize`)
    GET  /kv_cache_contract                      what a router needs to reproduce the block
                                                 hashes (`contract.py`); API key as for /v1

Owns the HTTP-side rules: the API key (every `/v1` route and the reset, as `Authorization:
Bearer`), the body size limit (413, checked on Content-Length and while reading), the OpenAI
error shape for every failure (unknown routes included), and client disconnects: a client that
goes away, streaming or not, has its request aborted at once (its KV blocks are freed by the
engine loop before its next step).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from speckv.api import errors
from speckv.api.contract import CONTRACT_PATH, engine_contract, new_epoch, tokenizer_digest
from speckv.api.errors import APIError
from speckv.api.http_guard import (
    check_bearer_key,
    client_gone_handler,
    error_response,
    on_api_error,
    on_http_error,
    race_disconnect,
    read_body,
)
from speckv.api.protocol import (
    SSE_DONE,
    ChunkWriter,
    GenerationRequest,
    ModelLimits,
    ResponseHeader,
    chat_response,
    completion_response,
    error_chunk,
    parse_chat,
    parse_completion,
    parse_json_object,
)
from speckv.api.tokenize import detokenize, tokenize
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.server.async_client import AsyncEngineClient, RequestStream
from speckv.server.engine_loop import EngineRequest
from speckv.server.metrics import CONTENT_TYPE, ServerMetrics

logger = logging.getLogger("speckv.server")
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024**2


def speckv_version() -> str:
    try:
        return version("speckv")
    except PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # None: no key needed
    max_waiting_requests: int = 256  # waiting (not running) requests before 503
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    retry_after_s: int = 1  # the Retry-After of a 503 for a full queue

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("ServerConfig.served_model_name must not be empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServerConfig.api_key must not be empty (None: no key)")
        for name in ("max_waiting_requests", "max_request_body_bytes", "retry_after_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ServerConfig.{name} must be an int >= 1, got {value!r}")


class OpenAIServer:
    """An engine served over HTTP: its loop, metrics and limits. `app` is the ASGI app."""

    def __init__(self, engine: LLMEngine, config: ServerConfig, model_path: str = "") -> None:
        self.engine = engine
        self.config = config
        self.model_path = model_path or config.served_model_name
        self.created = int(time.time())
        self.epoch = new_epoch()  # a restarted server is a new epoch for routers
        self._contract: dict[str, Any] | None = None
        self.limits = ModelLimits(config.served_model_name, engine.max_model_len,
                                  engine.vocab_size)
        self.metrics = ServerMetrics(config.served_model_name, engine.hash_mode,
                                     engine.num_spec_tokens,
                                     spec_stats=engine.spec_decode_stats,
                                     kv_budget=getattr(engine, "kv_budget", None))
        self.client = AsyncEngineClient(engine, self.metrics, config.max_waiting_requests,
                                        config.retry_after_s)
        self.app = build_app(self)

    def contract(self) -> dict[str, Any]:
        if self._contract is None:  # the tokenizer digest costs a few ms: once
            self._contract = engine_contract(
                self.engine, self.config.served_model_name, self.model_path, self.epoch,
                tokenizer_digest(self.engine.tokenizer))
        return self._contract

    def close(self) -> None:
        self.client.stop()
        self.engine.close()


# ---- helpers --------------------------------------------------------------------------------
def _check_api_key(server: OpenAIServer, request: Request) -> None:
    check_bearer_key(request, server.config.api_key)


class EventStreamResponse:
    """SSE for one request: a chunk per engine output, `[DONE]` last; stops (and aborts the
    request) as soon as the client disconnects, whether or not a token is due."""

    def __init__(self, stream: RequestStream, writer: ChunkWriter) -> None:
        self.stream = stream
        self.writer = writer

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                (b"cache-control", b"no-cache")]})
        try:
            await race_disconnect(self._pump(send), receive)
        except OSError:  # the socket went away mid-send
            pass
        finally:
            self.stream.close()

    async def _pump(self, send: Send) -> None:
        try:
            while not self.stream.finished:
                output = await self.stream.next_output()
                chunk = self.writer.delta(output)
                if output.finished:
                    chunk += self.writer.end(output)
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except APIError as error:  # the engine died: the status is sent, say it in the stream
            await send({"type": "http.response.body", "body": error_chunk(error) + SSE_DONE,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _last_output(stream: RequestStream) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    assert last is not None
    return last


# ---- the app ----------------------------------------------------------------------------------
def build_app(server: OpenAIServer) -> Starlette:
    """The Starlette app: every route is a closure over the one server state (config, engine
    client, limits, metrics), built in two groups: generation (`_generation_routes`) and the
    rest (`_service_routes`)."""
    async def on_unexpected(request: Request, error: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path)
        return error_response(APIError(500, f"Internal server error: "
                                        f"{type(error).__name__}: {error}", "server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.client.start()
        try:
            yield
        finally:
            server.close()

    return Starlette(
        routes=[*_generation_routes(server), *_service_routes(server)],
        exception_handlers={APIError: on_api_error, HTTPException: on_http_error,
                            ClientDisconnect: client_gone_handler(logger),
                            Exception: on_unexpected},
        lifespan=lifespan,
    )


def _generation_routes(server: OpenAIServer) -> list[Route]:
    """/v1/completions and /v1/chat/completions: one generation path, streamed or not."""
    config = server.config
    tokenizer = server.engine.tokenizer

    async def generate(request: Request, parse: Callable[..., GenerationRequest],
                       prefix: str) -> Any:
        arrival = time.perf_counter()
        _check_api_key(server, request)
        body = parse_json_object(await read_body(request, config.max_request_body_bytes))
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            generation = parse(body, server.limits, tokenizer)
            stream = await server.client.submit(EngineRequest(
                request_id, generation.prompt_token_ids, generation.params, arrival))
        except APIError:
            # rejected: a prefill engine keeping this request's KV need not wait for its lease
            server.client.loop.call(
                lambda engine: engine.transfer_abandoned(body.get("kv_transfer_params")))
            raise
        header = ResponseHeader.new(request_id, config.served_model_name)
        if generation.stream:
            return EventStreamResponse(stream, ChunkWriter(generation.kind, header,
                                                           generation.include_usage))
        try:
            finished, output = await race_disconnect(_last_output(stream), request.receive)
        finally:
            stream.close()
        if not finished:
            return Response(status_code=499)  # nobody is listening; the request is aborted
        build = completion_response if generation.kind == "completion" else chat_response
        return JSONResponse(build(header, output))

    async def completions(request: Request) -> Any:
        return await generate(request, parse_completion, "cmpl")

    async def chat_completions(request: Request) -> Any:
        return await generate(request, parse_chat, "chatcmpl")

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


def _service_routes(server: OpenAIServer) -> list[Route]:
    """Models, health, metrics, the prefix-cache reset, version, tokenize / detokenize and
    the KV cache contract."""
    config = server.config
    tokenizer = server.engine.tokenizer

    async def models(request: Request) -> JSONResponse:
        _check_api_key(server, request)
        return JSONResponse({"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": server.created,
            "owned_by": "speckv", "root": server.model_path, "parent": None,
            "max_model_len": server.limits.max_model_len}]})

    async def health(request: Request) -> Response:
        loop = server.client.loop
        if loop.is_running:
            return Response(status_code=200)
        return error_response(errors.engine_dead(loop.error or "not started"))

    async def metrics(request: Request) -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    async def reset_prefix_cache(request: Request) -> JSONResponse:
        _check_api_key(server, request)
        try:
            future = server.client.loop.call(lambda engine: engine.reset_prefix_cache())
            reset = await asyncio.wrap_future(future)
        except Exception as error:
            raise errors.engine_dead(str(error)) from None
        if not reset:
            raise APIError(409, "Requests in flight hold KV blocks; reset the prefix cache "
                           "when the server is idle.", "invalid_request_error", None,
                           "prefix_cache_in_use")
        return JSONResponse({"success": True})

    async def tokenize_route(request: Request) -> JSONResponse:
        body = parse_json_object(await read_body(request, config.max_request_body_bytes))
        return JSONResponse(tokenize(body, server.limits, tokenizer))

    async def detokenize_route(request: Request) -> JSONResponse:
        body = parse_json_object(await read_body(request, config.max_request_body_bytes))
        return JSONResponse(detokenize(body, server.limits, tokenizer))

    async def kv_cache_contract(request: Request) -> JSONResponse:
        _check_api_key(server, request)
        return JSONResponse(server.contract())

    async def version_info(request: Request) -> JSONResponse:
        return JSONResponse({"version": speckv_version()})

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/reset_prefix_cache", reset_prefix_cache, methods=["POST"]),
        Route("/version", version_info, methods=["GET"]),
        Route("/tokenize", tokenize_route, methods=["POST"]),
        Route("/detokenize", detokenize_route, methods=["POST"]),
        Route(CONTRACT_PATH, kv_cache_contract, methods=["GET"]),
    ]
