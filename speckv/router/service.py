"""The router as a running service: one subscriber thread per engine, and its HTTP API.

Owns the wiring between `EventSubscriber`s and a `RouterIndex` (one lock serialises index
updates and lookups) and the Starlette app:

    POST /route  {"token_ids": [...], "lora_name"?: str, "cache_salt"?: str,
                  "mm_items"?: [{"identifier": str, "offset": int, "length": int}]}
              -> {"engine": name, "matched_tokens": n, "per_engine": {name: n}, "prompt_blocks": k}
    GET  /stats -> per-engine index counters and subscriber counters
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from speckv.events.schema import KVEventBatch
from speckv.events.subscriber import EventSubscriber, SubscriberConfig, run_subscriber
from speckv.hashing.extra_keys import MultiModalItem
from speckv.router.index import EngineHashConfig, RouterIndex


@dataclass(frozen=True)
class EngineEndpoint:
    name: str
    endpoint: str
    replay_endpoint: str | None
    hashing: EngineHashConfig


class RouterService:
    def __init__(self, engines: list[EngineEndpoint], poll_timeout_s: float = 0.05) -> None:
        if not engines:
            raise ValueError("the router needs at least one engine")
        names = [engine.name for engine in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engine names must be unique, got {names}")
        self.engines = engines
        self.index = RouterIndex({engine.name: engine.hashing for engine in engines})
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._poll_timeout_s = poll_timeout_s
        self._subscribers: dict[str, EventSubscriber] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for engine in self.engines:
            thread = threading.Thread(
                target=self._consume, args=(engine,), name=f"router-{engine.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=timeout_s)

    def apply(self, engine: str, seq: int, batch: KVEventBatch) -> None:
        with self.lock:
            self.index.apply_batch(engine, batch, seq)

    def route(self, token_ids: list[int], **kwargs: Any) -> dict[str, Any]:
        with self.lock:
            result = self.index.route(token_ids, **kwargs)
        return {
            "engine": result.engine,
            "matched_tokens": result.matched_tokens,
            "per_engine": result.per_engine,
            "prompt_blocks": result.num_prompt_blocks,
        }

    def stats(self) -> dict[str, Any]:
        with self.lock:
            index = self.index.stats()
        out: dict[str, Any] = {}
        for name, counters in index.items():
            subscriber = self._subscribers.get(name)
            out[name] = {
                "index": counters,
                "subscriber": subscriber.stats.as_dict() if subscriber is not None else None,
            }
        return out

    def _consume(self, engine: EngineEndpoint) -> None:
        # the subscriber (and its sockets) live in this thread only
        subscriber = EventSubscriber(
            SubscriberConfig(endpoint=engine.endpoint, replay_endpoint=engine.replay_endpoint)
        )
        self._subscribers[engine.name] = subscriber

        def on_batch(seq: int, batch: KVEventBatch) -> None:
            self.apply(engine.name, seq, batch)

        try:
            run_subscriber(subscriber, on_batch, self._stop.is_set, self._poll_timeout_s)
        finally:
            subscriber.close()


class MMItem(BaseModel):
    model_config = ConfigDict(strict=True)
    identifier: str
    offset: int = Field(ge=0)
    length: int = Field(gt=0)


class RouteRequest(BaseModel):
    model_config = ConfigDict(strict=True)
    token_ids: list[int] = Field(min_length=1)
    lora_name: str | None = None
    cache_salt: str | None = None
    mm_items: list[MMItem] = Field(default_factory=list)


def _unprocessable(detail: Any) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=422)


def make_app(service: RouterService) -> Starlette:
    """The Starlette app of a router service (the framework `speckv serve` uses)."""

    async def route(request: Request) -> JSONResponse:
        try:
            body = RouteRequest.model_validate_json(await request.body())
        except ValidationError as error:
            return _unprocessable(error.errors(include_url=False, include_context=False))
        if any(token < 0 for token in body.token_ids):
            return _unprocessable("token ids must be >= 0")
        try:
            items = [MultiModalItem(i.identifier, i.offset, i.length) for i in body.mm_items]
            result = await asyncio.to_thread(
                service.route, body.token_ids, lora_name=body.lora_name,
                cache_salt=body.cache_salt, mm_items=items)
        except ValueError as err:
            return _unprocessable(str(err))
        return JSONResponse(result)

    async def stats(request: Request) -> JSONResponse:
        return JSONResponse(service.stats())

    return Starlette(routes=[Route("/route", route, methods=["POST"]),
                             Route("/stats", stats, methods=["GET"])])


def engine_endpoints(
    specs: Mapping[str, tuple[str, str | None]], hashing: EngineHashConfig
) -> list[EngineEndpoint]:
    """Engines that share one hash configuration (the usual fleet)."""
    return [
        EngineEndpoint(name, endpoint, replay, hashing)
        for name, (endpoint, replay) in specs.items()
    ]
