"""The asyncio side of the engine loop: submit a request, await its acceptance, read its outputs.

Owns one `asyncio.Queue` per request. The engine loop thread hands each step's events over with
a single `call_soon_threadsafe`; `_dispatch` (on the event loop) routes them to the queues.
`submit` returns once the engine has accepted the request (or raises the `APIError` that says
why not: bad request 400, queue full 503 + Retry-After, engine down 503), so a handler knows
the status before it starts a response. `RequestStream.close` aborts a request that has not
finished (a client that went away), which frees its KV blocks at the next loop iteration.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from speckv.api.errors import bad_request, engine_dead, engine_failed, queue_full
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.server.engine_loop import (
    Accepted,
    EngineDeadError,
    EngineLoop,
    EngineRequest,
    Failed,
    LoopEvent,
    LoopObserver,
    Output,
    Rejected,
)


class RequestStream:
    """The outputs of one accepted request, in order; iterate, then `close`."""

    def __init__(self, client: AsyncEngineClient, request_id: str,
                 queue: asyncio.Queue[LoopEvent]) -> None:
        self._client = client
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    async def next_output(self) -> RequestOutput:
        """The next output; raises APIError (500) if the engine died meanwhile."""
        event = await self._queue.get()
        if isinstance(event, Failed):
            self.finished = True
            raise engine_failed(event.message)
        assert isinstance(event, Output), event
        if event.output.finished:
            self.finished = True
        return event.output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next_output()

    def close(self) -> None:
        """Forget the request; abort it in the engine if it has not finished."""
        self._client._unregister(self.request_id)
        if not self.finished:
            self.finished = True
            self._client.loop.abort(self.request_id)


class AsyncEngineClient:
    def __init__(self, engine: LLMEngine, observer: LoopObserver | None = None,
                 max_waiting_requests: int = 256, retry_after_s: int = 1) -> None:
        self.loop = EngineLoop(engine, self._deliver, observer)
        self.max_waiting_requests = max_waiting_requests
        self.retry_after_s = retry_after_s
        self._queues: dict[str, asyncio.Queue[LoopEvent]] = {}
        self._event_loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Bind to the running event loop and start the engine loop thread."""
        self._event_loop = asyncio.get_running_loop()
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()

    async def submit(self, request: EngineRequest) -> RequestStream:
        loop = self.loop
        if loop.error is not None:
            raise engine_dead(loop.error)
        num_waiting = loop.num_waiting_requests
        if num_waiting >= self.max_waiting_requests:
            raise queue_full(num_waiting, self.retry_after_s)
        queue: asyncio.Queue[LoopEvent] = asyncio.Queue()
        self._queues[request.request_id] = queue
        stream = RequestStream(self, request.request_id, queue)
        try:
            loop.submit(request)
            event = await queue.get()
        except EngineDeadError as error:
            self._unregister(request.request_id)
            raise engine_dead(str(error)) from None
        except BaseException:  # cancelled while waiting (client gone): take it back
            stream.close()
            raise
        if isinstance(event, Rejected):
            self._unregister(request.request_id)
            raise bad_request(event.message, event.param, "invalid_value")
        if isinstance(event, Failed):
            self._unregister(request.request_id)
            raise engine_failed(event.message)
        assert isinstance(event, Accepted), event
        return stream

    # ---- the engine loop thread calls this -----------------------------------------------------
    def _deliver(self, events: list[LoopEvent]) -> None:
        event_loop = self._event_loop
        if event_loop is None:
            return
        # RuntimeError: the event loop closed (shutdown), nobody is waiting any more
        with contextlib.suppress(RuntimeError):
            event_loop.call_soon_threadsafe(self._dispatch, events)

    # ---- on the event loop ---------------------------------------------------------------------
    def _dispatch(self, events: list[LoopEvent]) -> None:
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def _unregister(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
