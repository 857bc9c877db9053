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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepThreads:
    threads: int  # steps of at most `single_threaded_rows` tokens
    prefill_threads: int  # longer steps
    single_threaded_rows: int  # the most rows the model's single-threaded kernels compute

    def __post_init__(self) -> None:
        if min(self.threads, self.prefill_threads) < 1 or self.single_threaded_rows < 0:
            raise ValueError(f"StepThreads needs threads >= 1 and rows >= 0, got {self}")

    def for_step(self, num_tokens: int) -> int:
        """The compute threads of a step of `num_tokens` tokens."""
        return self.threads if num_tokens <= self.single_threaded_rows else self.prefill_threads

    def apply(self, num_tokens: int) -> None:
        """Set torch's threads for a step of `num_tokens` tokens (in the thread that steps:
        OpenMP keeps the count per thread)."""
        wanted = self.for_step(num_tokens)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)

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
