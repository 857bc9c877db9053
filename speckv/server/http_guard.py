"""The HTTP checks `speckv serve` and `speckv router` share: the API key, the bounded request
body, and noticing a client that went away. One copy, so both fronts refuse alike."""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.types import Receive

from speckv.server import errors


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
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise errors.body_too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (after the body, `receive` only reports that)."""
    while (await receive())["type"] != "http.disconnect":
        pass
