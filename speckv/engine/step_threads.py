"""Compute threads per step: few-token steps on `threads`, prefill-sized steps on more.

Owns torch's intra-op thread count while the engine steps on a CPU. speckv's few-row kernels
(the checkpoint's blocks, `rowdot`, panels: `speckv.models.common`) compute on one thread, so
a decode or verification step gains nothing from more, and on a machine that also serves HTTP
a second compute thread only waits at each op's barrier while the server's work holds its
core. A longer step (a prefill chunk) runs torch's GEMMs, which split across cores, for
hundreds of milliseconds while the server has little to do: there the server's core is
better spent computing. On a 2-core machine, 32 prompts of 256 tokens prefill in 19.4 s on
one thread and 10.6 s on two (in process); over HTTP at concurrency 32 the median TTFT went
from 15.1 to 8.1-8.8 s.

    tokens in the step:  1 ........ single_threaded_rows | single_threaded_rows + 1 ........
    threads:             threads                         | prefill_threads

The boundary is the most rows the model's single-threaded forms were measured to win at on
this machine, so it moves with them.

More threads pay only while the other cores are free: with another process busy on the
second core (a spinning loop, paired over HTTP), `--prefill-threads 2` ran 0.93x one thread
at batch 1 (TTFT 176-191 -> 317-370 ms) and 0.92x at concurrency 8, since each GEMM waits at
its barrier for the thread that lost its core. So `ThreadChooser` times long steps (wall
seconds per token, per power-of-two size) at both counts and runs them on the faster, trying
the other every `PROBE_INTERVAL` long steps of that size: the machine's load is measured as
it is, not assumed (paired over HTTP with the spinning process, batch 1, 12 requests a
round: TTFT 292 ms in the first round, 178 in the second, against 175-192 on one thread).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

PROBE_INTERVAL = 8  # long steps of one size between tries of the count not in use
COST_DECAY = 0.5  # weight of the old seconds-per-token mean when a step is timed again


@dataclass(frozen=True)
class StepThreads:
    threads: int  # steps of at most `single_threaded_rows` tokens
    prefill_threads: int  # longer steps
    single_threaded_rows: int  # the most rows the model's single-threaded kernels compute

    def __post_init__(self) -> None:
        if min(self.threads, self.prefill_threads) < 1 or self.single_threaded_rows < 0:
            raise ValueError(f"StepThreads needs threads >= 1 and rows >= 0, got {self}")

    def for_step(self, num_tokens: int) -> int:
        """The compute threads of a step of `num_tokens` tokens on an idle machine."""
        return self.threads if num_tokens <= self.single_threaded_rows else self.prefill_threads

    def describe(self) -> str:
        """The choice in a user's words (`speckv serve` prints it)."""
        if self.threads == self.prefill_threads:
            return f"{self.threads} compute thread(s)"
        return (f"{self.threads} compute thread(s) for steps of up to "
                f"{self.single_threaded_rows} tokens, {self.prefill_threads} for longer ones")


def step_threads_for(threads: int | None, prefill_threads: int | None,
                     single_threaded_rows: int) -> StepThreads | None:
    """The per-step choice `--threads` / `--prefill-threads` ask for (None: every step runs on
    torch's setting, as it stands)."""
    few = threads if threads is not None else torch.get_num_threads()
    if prefill_threads is None or prefill_threads == few:
        return None
    return StepThreads(few, prefill_threads, single_threaded_rows)


class ThreadChooser:
    """Sets torch's threads for each step of one engine (in the thread that steps: OpenMP
    keeps the count per thread): `config.threads` for a short step; for a long one, of
    `config.threads` and `config.prefill_threads` the count whose long steps of that size
    (a power of two of tokens) took fewer wall seconds per token, `prefill_threads` until
    both are timed, the other every `PROBE_INTERVAL` long steps of that size. Not
    thread-safe: the runner calls `begin` before a step's forward and `end` after its
    proposals."""

    def __init__(self, config: StepThreads, clock: Callable[[], float] = time.perf_counter
                 ) -> None:
        self.config = config
        self.clock = clock
        self._cost: dict[tuple[int, int], float] = {}  # (threads, size) -> seconds per token
        self._num_long_steps: dict[int, int] = {}  # size -> long steps begun
        self._timing: tuple[int, int, int, float] | None = None  # threads, size, tokens, start

    def begin(self, num_tokens: int) -> None:
        """Set the threads of a step of `num_tokens` tokens and start timing a long one."""
        config = self.config
        threads, size = config.for_step(num_tokens), num_tokens.bit_length()
        long_step = threads != config.threads
        if long_step:
            threads = self._long_step_threads(size)
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        self._timing = (threads, size, num_tokens, self.clock()) if long_step else None

    def _long_step_threads(self, size: int) -> int:
        """The threads of the next long step of `size` (a power of two of tokens)."""
        count = self._num_long_steps.get(size, 0) + 1
        self._num_long_steps[size] = count
        many, few = self.config.prefill_threads, self.config.threads
        cost_many, cost_few = self._cost.get((many, size)), self._cost.get((few, size))
        best = few if cost_many is not None and cost_few is not None and cost_few < cost_many \
            else many
        if count % PROBE_INTERVAL == 0 and cost_many is not None:
            return few if best == many else many  # the runner-up, timed again
        return best

    def end(self) -> None:
        """The step begun last has finished: fold a long step's seconds per token in."""
        if self._timing is None:
            return
        threads, size, num_tokens, start = self._timing
        self._timing = None
        per_token = (self.clock() - start) / num_tokens
        old = self._cost.get((threads, size))
        self._cost[(threads, size)] = (per_token if old is None
                                       else COST_DECAY * old + (1.0 - COST_DECAY) * per_token)
