"""The OpenAI error shape, `{"error": {"message", "type", "param", "code"}}`, and its statuses.

Owns `APIError` (raised anywhere in the server, turned into a JSON response by the app) and one
constructor per kind of failure, so every handler says the same thing the same way:

    400 invalid_request_error   malformed JSON, bad field values, prompt too long
    401 authentication_error    missing or wrong API key
    404 invalid_request_error   unknown model or route
    413 invalid_request_error   body over the size limit
    500 server_error            the engine loop died (in-flight requests fail, none hang)
    503 server_error            the waiting queue is full (with Retry-After) or the engine is down
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def not_supported(param: str, detail: str) -> APIError:
    return bad_request(f"'{param}' is not supported by speckv serve: {detail}", param,
                       "unsupported_parameter")


def unauthorized() -> APIError:
    return APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                    "authentication_error", None, "invalid_api_key")


def model_not_found(name: object, served: str) -> APIError:
    return APIError(404, f"The model {quoted(name)} does not exist; this server serves "
                    f"{served!r}.", "invalid_request_error", "model", "model_not_found")


def quoted(value: object, limit: int = 80) -> str:
    """`repr(value)`, cut to `limit` characters (and its length said) when longer: an error
    never echoes a client's megabyte back."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters"
    return f"{text[:limit]}... ({size})"


def route_not_found(method: str, path: str) -> APIError:
    return APIError(404, f"{method} {path} is not an endpoint of this server.",
                    "invalid_request_error", None, "not_found")


def method_not_allowed(method: str, path: str) -> APIError:
    return APIError(405, f"{path} does not accept {method}.", "invalid_request_error", None,
                    "method_not_allowed")


def body_too_large(limit_bytes: int) -> APIError:
    return APIError(413, f"The request body is larger than this server's limit of "
                    f"{limit_bytes} bytes.", "invalid_request_error", None, "request_too_large")


def queue_full(num_waiting: int, retry_after_s: int) -> APIError:
    return APIError(503, f"The server is overloaded: {num_waiting} requests are already "
                    f"waiting. Retry after {retry_after_s} s.", "server_error", None,
                    "server_overloaded", {"Retry-After": str(retry_after_s)})


def engine_dead(detail: str) -> APIError:
    return APIError(503, f"The engine is not running: {detail}", "server_error", None,
                    "engine_dead")


def engine_failed(detail: str) -> APIError:
    return APIError(500, f"The engine failed while serving this request: {detail}",
                    "server_error", None, "engine_error")
