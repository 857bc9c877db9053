"""The HTTP checks `speckv serve` and `speckv router` share: the API key, the bounded request
body, noticing a client that went away (one short log line, no traceback, for a client that
leaves while sending its body), and the OpenAI error shape for API and routing errors. One
copy, so both fronts refuse alike."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from speckv.api import errors
from speckv.api.errors import APIError


def check_bearer_key(request: Request, key: str | None) -> None:
    """Nothing when no key is configured or the request carries it as `Bearer KEY`; else the
    OpenAI 401 (compared in constant time)."""
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             key.encode()):
        raise errors.unauthorized()


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused (413) as soon as it passes `limit` bytes: a declared
    Content-Length over the limit is refused before anything is read."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise errors.body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():  # ClientDisconnect: `client_gone_handler`
        size += len(chunk)
        if size > limit:
            raise errors.body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (after the body, `receive` only reports that)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(work: Awaitable[Any], receive: Receive) -> tuple[bool, Any]:
    """(True, result) if `work` finished first; (False, None) if the client left first (the
    work is cancelled)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.done() and not task.cancelled() and task.exception() is None:
        return True, task.result()
    if task.done() and not task.cancelled():
        raise task.exception()  # type: ignore[misc]
    return False, None


def client_gone_handler(logger: logging.Logger) -> Any:
    """A Starlette handler for `ClientDisconnect` (a client that left while sending its body):
    one line on `logger`, and a 499 that nobody reads, where an unhandled exception would log
    two tracebacks per dropped connection."""

    async def on_client_gone(request: Request, error: Exception) -> Response:
        client = request.client
        peer = f"{client.host}:{client.port}" if client else "a client"
        logger.warning("%s left before sending its whole body (%s %s)", peer, request.method,
                    request.url.path)
        return Response(status_code=499)

    return on_client_gone


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def on_api_error(request: Request, error: Exception) -> Response:
    """Starlette handler: an `APIError` as its OpenAI-shaped response."""
    assert isinstance(error, APIError)
    return error_response(error)


async def on_http_error(request: Request, error: Exception) -> Response:
    """Starlette handler: unknown routes and methods (and other HTTP errors) in the OpenAI
    error shape rather than Starlette's plain text."""
    assert isinstance(error, HTTPException)
    if error.status_code == 404:
        return error_response(errors.route_not_found(request.method, request.url.path))
    if error.status_code == 405:
        return error_response(errors.method_not_allowed(request.method, request.url.path))
    return error_response(APIError(error.status_code, str(error.detail)))
