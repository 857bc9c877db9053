"""EngineCore: the one step lifecycle, over any runner that speaks the typed messages.

Owns the order of a step and nothing else:

    SchedulerOutput = scheduler.schedule()          hits, chunked prefill, preemption
    ModelRunnerOutput = runner.execute_model(...)   forward, verify, draft KV, next drafts
    EngineCoreOutputs = scheduler.update_from_output(...)   real tokens, finish, cache

`LLMEngine` runs it over the real `ModelRunner`; `speckv.testing` runs it over a toy runner
(a fixed next-token rule and a symbolic KV store) in the property tests, the cache benchmarks
and the samples, so there is exactly one scheduler lifecycle.
"""

from __future__ import annotations

from typing import Protocol

from speckv.engine.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from speckv.engine.scheduler import Scheduler


class Runner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> list[EngineCoreOutput]:
        """One step; an output for every request that sampled tokens or finished in it."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)
