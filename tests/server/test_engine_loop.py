"""The engine loop's first step after idling (`speckv.server.engine_loop`): requests submitted
close together share it, while a client that sends one request at a time is not made to wait.

Here a burst's requests come 50 ms apart, inside a 1 s arrival window and a longer quiet
period (the defaults are tens of milliseconds): on a busy machine the gaps stay inside them,
and a loop that did not wait would have started its step at the first request (the tiny
model's steps end in milliseconds). Requests "one at a time" come 1.5 s apart, each in a
window of its own.
"""

from __future__ import annotations

import threading
import time
from itertools import count

import pytest

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.llama.tiny import tiny_model
from speckv.server.engine_loop import LONE_WAKES_TO_SKIP, EngineLoop, EngineRequest, Output
from tests.patience import wait_until

GAP_S = 0.05  # not a wall limit: the spacing of a "burst" under test
QUIET_S = 5.0  # not a wall limit: the loop's quiet period under test
WINDOW_S = 1.0  # not a wall limit: the loop's arrival window under test
APART_S = 1.5  # not a wall limit: "one at a time" under test (each in a window of its own)


class StepLog:
    """The request ids each step finished (every request here ends in its first step)."""

    def __init__(self) -> None:
        self.steps: list[set[str]] = []
        self.finished: set[str] = set()
        self._lock = threading.Lock()

    def deliver(self, events) -> None:
        with self._lock:
            done = {e.request_id for e in events if isinstance(e, Output) and e.output.finished}
            if done:
                self.steps.append(done)
                self.finished |= done

    def step_of(self, request_id: str) -> int:
        with self._lock:
            return next(i for i, ids in enumerate(self.steps) if request_id in ids)


@pytest.fixture
def loop_and_log():
    engine = LLMEngine(tiny_model(), engine_config(block_size=4, num_blocks=256,
                                                   max_num_batched_tokens=512))
    log = StepLog()
    loop = EngineLoop(engine, log.deliver, arrival_quiet_s=QUIET_S, arrival_window_s=WINDOW_S)
    loop.start()
    yield loop, log
    loop.stop()


_ids = count()


def _send(loop: EngineLoop, gaps: int = 1) -> list[str]:
    """`gaps + 1` one-token requests, GAP_S apart; waits until all finished."""
    ids = []
    for i in range(gaps + 1):
        if i:
            time.sleep(GAP_S)
        request_id = f"r{next(_ids)}"
        loop.submit(EngineRequest(request_id, [3 + i, 5, 7, 11, 13],
                                  SamplingParams(max_tokens=1, temperature=0.0),
                                  time.perf_counter()))
        ids.append(request_id)
    return ids


def _wait(log: StepLog, ids: list[str]) -> None:
    wait_until(lambda: set(ids) <= log.finished, "the requests finish", poll_s=0.01)


def test_a_burst_after_idling_shares_the_first_step(loop_and_log):
    loop, log = loop_and_log
    ids = _send(loop, gaps=3)
    _wait(log, ids)
    assert {log.step_of(i) for i in ids} == {0}


def test_one_request_at_a_time_does_not_wait_and_a_burst_brings_the_wait_back(loop_and_log):
    loop, log = loop_and_log
    for _ in range(LONE_WAKES_TO_SKIP + 1):  # a client that waits for each answer
        lone = _send(loop, gaps=0)
        _wait(log, lone)
        time.sleep(APART_S)
    # now the first step starts at once: a request 50 ms later runs in a step of its own
    first, second = _send(loop, gaps=1)
    _wait(log, [first, second])
    assert log.step_of(first) != log.step_of(second)
    # that window saw two requests: the next burst is waited for again
    time.sleep(APART_S)
    burst = _send(loop, gaps=2)
    _wait(log, burst)
    assert len({log.step_of(i) for i in burst}) == 1
