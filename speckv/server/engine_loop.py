"""The engine loop: one thread owns the `LLMEngine`; everyone else talks to it through queues.

Owns the engine's thread. Between two steps it takes what other threads queued (new requests,
aborts, calls such as a prefix-cache reset), so a request joins the running batch at the next
step after it arrives (continuous batching over HTTP). After each step it hands every event of
the step to `deliver` in one call, in order (a request's `Accepted` always precedes its
outputs), and the step's stats to the observer (metrics).

If the engine raises, the loop dies: it records why, fails every request it holds (`Failed`)
and refuses new ones, so no caller waits forever. Only the public engine API is used:
`add_request` (ValueError = the request is bad, the engine is fine), `step`, `abort_request`,
`has_unfinished_requests`, `last_stats`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

from speckv.connectors import TransferParamsError
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.stats import SchedulerStats

logger = logging.getLogger("speckv.server")

# An idle engine's first step waits for a burst of arrivals to end: until no request came for
# ARRIVAL_QUIET_S, at most ARRIVAL_WINDOW_S. Clients that send together (a batch, a benchmark's
# concurrency) then share one prefill step; started at the first arrival, that step would
# prefill one prompt and the rest would wait a whole step for it (8 x 256 tokens of the
# built-in model on a CPU: TTFT 0.6-0.8 s for one, 5.0-5.5 s for seven, against 4.7-5.1 s
# for all eight in one step; a burst's requests reached the loop 0.1-6 ms apart, once 11 ms
# on fresh connections). Where each of
# the last LONE_WAKES_TO_SKIP windows saw a single request (a client that waits for each
# answer), the first step starts at once: lone requests pay no wait.
ARRIVAL_QUIET_S = 0.02
ARRIVAL_WINDOW_S = 0.1
LONE_WAKES_TO_SKIP = 3
# Between two steps that ran nothing (every request waits on a KV transfer, or only leases are
# held): a step is what polls the transfers, 1 ms apart costs at most 1 ms of their latency.
WAITING_PAUSE_S = 0.001


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_s: float  # time.perf_counter() when the HTTP request arrived


@dataclass(frozen=True)
class Accepted:
    request_id: str


@dataclass(frozen=True)
class Rejected:
    request_id: str
    message: str  # the engine's ValueError, in the user's words
    param: str | None = None  # the API field it names (a connector's kv_transfer_params.*)


@dataclass(frozen=True)
class Output:
    output: RequestOutput

    @property
    def request_id(self) -> str:
        return self.output.request_id


@dataclass(frozen=True)
class Failed:
    request_id: str
    message: str  # why the engine loop stopped


LoopEvent = Accepted | Rejected | Output | Failed


class EngineDeadError(RuntimeError):
    pass


class LoopObserver(Protocol):
    """Told what happens, in the loop thread (keep it cheap)."""

    def request_added(self, request: EngineRequest) -> None: ...

    def step_done(self, stats: SchedulerStats | None, outputs: list[RequestOutput],
                  start_s: float, end_s: float) -> None: ...

    def request_aborted(self, output: RequestOutput, now_s: float) -> None: ...

    def engine_idle(self) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, deliver: Callable[[list[LoopEvent]], None],
                 observer: LoopObserver | None = None, idle_wait_s: float = 0.05,
                 arrival_quiet_s: float = ARRIVAL_QUIET_S,
                 arrival_window_s: float = ARRIVAL_WINDOW_S) -> None:
        self.engine = engine
        self._deliver = deliver
        self._observer = observer
        self._idle_wait_s = idle_wait_s
        self._arrival_quiet_s = arrival_quiet_s
        self._arrival_window_s = arrival_window_s
        self._lone_wakes = 0  # arrival windows in a row that saw a single request
        self._window_end_s = -math.inf  # the arrival window opened by the last idle wake-up
        self._window_arrivals = 0  # requests that arrived in it
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inbox: deque[EngineRequest] = deque()
        self._aborts: deque[str] = deque()
        self._calls: deque[tuple[Callable[[LLMEngine], Any], Future]] = deque()
        self._live: set[str] = set()  # submitted and not finished (queued or in the engine)
        self._num_running = 0  # after the last step
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="speckv-engine-loop",
                                        daemon=True)

    # ---- any thread ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop after the current step; requests still held are failed ("shutting down")."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    @property
    def error(self) -> str | None:
        """Why the loop died (None while it runs)."""
        return self._error

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def num_waiting_requests(self) -> int:
        """Requests submitted and not yet running (queued here or waiting in the engine)."""
        with self._lock:
            return max(0, len(self._live) - self._num_running)

    def submit(self, request: EngineRequest) -> None:
        with self._lock:
            if self._error is not None:
                raise EngineDeadError(self._error)
            self._live.add(request.request_id)
            self._inbox.append(request)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            if self._error is not None or request_id not in self._live:
                return
            self._aborts.append(request_id)
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Future:
        """Run `fn(engine)` in the loop thread between two steps; its result as a Future."""
        future: Future = Future()
        with self._lock:
            if self._error is not None:
                future.set_exception(EngineDeadError(self._error))
                return future
            self._calls.append((fn, future))
        self._wake.set()
        return future

    # ---- the loop thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                events: list[LoopEvent] = []
                self._take_queued(events)
                ran = self._step(events) if self.engine.has_unfinished_requests() else False
                if events:
                    self._deliver(events)
                if not self.engine.has_unfinished_requests():
                    if self._wake.wait(self._idle_wait_s):
                        self._woken_idle()
                    self._wake.clear()
                elif not ran:  # only KV transfers pending: poll them, do not spin on them
                    self._wake.wait(WAITING_PAUSE_S)
                    self._wake.clear()
            self._fail_all("the server is shutting down")
        except BaseException as error:  # the engine is broken: nobody may wait on it
            logger.exception("the engine loop died")
            self._fail_all(f"{type(error).__name__}: {error}")

    def _woken_idle(self) -> None:
        """Something was submitted to the idle engine. Past the last arrival window: close
        its count and open a new one. Unless arrivals have come alone lately, wait until
        nothing was submitted for the quiet period or the window ends."""
        now_s = time.perf_counter()
        if now_s > self._window_end_s:
            if self._window_arrivals:  # (a call alone, e.g. a cache reset, says nothing)
                lone = self._window_arrivals == 1
                self._lone_wakes = self._lone_wakes + 1 if lone else 0
            self._window_end_s = now_s + self._arrival_window_s
            self._window_arrivals = 0
        if self._lone_wakes >= LONE_WAKES_TO_SKIP:
            return
        while not self._stop.is_set():
            quiet_s = min(self._arrival_quiet_s, self._window_end_s - time.perf_counter())
            self._wake.clear()
            if quiet_s <= 0 or not self._wake.wait(quiet_s):
                return

    def _take_queued(self, events: list[LoopEvent]) -> None:
        with self._lock:
            requests = list(self._inbox)
            self._inbox.clear()
            aborts = list(self._aborts)
            self._aborts.clear()
            calls = list(self._calls)
            self._calls.clear()
        engine = self.engine
        aborted = set(aborts)
        self._window_arrivals += sum(r.arrival_s <= self._window_end_s for r in requests)
        for request in requests:
            if request.request_id in aborted:  # gone before it reached the engine
                self._finish(request.request_id)
                continue
            try:
                engine.add_request(request.prompt_token_ids, request.params, request.request_id)
            except ValueError as error:
                self._finish(request.request_id)
                param = error.param if isinstance(error, TransferParamsError) else None
                events.append(Rejected(request.request_id, str(error), param))
                continue
            events.append(Accepted(request.request_id))
            if self._observer is not None:
                self._observer.request_added(request)
        for request_id in aborts:
            output = engine.abort_request(request_id)
            self._finish(request_id)
            if output is not None:
                if self._observer is not None:
                    self._observer.request_aborted(output, time.perf_counter())
                events.append(Output(output))
        if aborts and not engine.has_unfinished_requests() and self._observer is not None:
            self._observer.engine_idle()
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(engine))
                except Exception as error:  # the caller's failure, not the engine's
                    future.set_exception(error)

    def _step(self, events: list[LoopEvent]) -> bool:
        """One engine step; False if it ran no request (it only polled KV transfers)."""
        start = time.perf_counter()
        outputs = self.engine.step()
        end = time.perf_counter()
        stats = self.engine.last_stats
        if self._observer is not None:
            self._observer.step_done(stats, outputs, start, end)
        finished = [o.request_id for o in outputs if o.finished]
        with self._lock:
            self._live.difference_update(finished)
            if stats is not None:
                self._num_running = stats.num_running_reqs
        events.extend(Output(output) for output in outputs)
        return bool(outputs) or stats is None or stats.num_running_reqs > 0

    def _finish(self, request_id: str) -> None:
        with self._lock:
            self._live.discard(request_id)

    def _fail_all(self, message: str) -> None:
        with self._lock:
            self._error = self._error or message
            failed = sorted(self._live)
            self._live.clear()
            self._inbox.clear()
            self._aborts.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(message))
        if failed:
            try:
                self._deliver([Failed(request_id, message) for request_id in failed])
            except Exception:  # the receiving side is gone too (event loop closed)
                logger.exception("could not fail the in-flight requests")
