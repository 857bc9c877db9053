"""EngineCore: the one step lifecycle, over any runner that speaks the typed messages.

Owns the order of a step and nothing else:

    SchedulerOutput = scheduler.schedule()          hits, chunked prefill, preemption
    ModelRunnerOutput = runner.execute_model(...)   forward, verify, draft KV, next drafts,
                                                    why a request stops (token-wise)
    cuts = stop_strings.find_stop_strings(...)      optional: tokens kept per request whose
                                                    sampled text completes a stop string
    EngineCoreOutputs = scheduler.update_from_output(..., cuts)   real tokens, finish, cache

`LLMEngine` runs it over the real `ModelRunner` (its `OutputProcessor` finds the stop strings);
`speckv.simulation` runs it over a toy runner (a fixed next-token rule and a symbolic KV store) in
the property tests, the cache benchmarks and the samples, so there is exactly one scheduler
lifecycle.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from speckv.engine.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from speckv.engine.scheduler import Scheduler


class Runner(Protocol):
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...


class StopStringFinder(Protocol):
    def find_stop_strings(self, sampled_token_ids: Mapping[str, list[int]]
                          ) -> dict[str, int]:
        """Per request whose new tokens complete a stop string: how many of them to keep."""
        ...


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner,
                 stop_strings: StopStringFinder | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.stop_strings = stop_strings

    def step(self) -> list[EngineCoreOutput]:
        """One step; an output for every request that sampled tokens or finished in it."""
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute_model(scheduler_output)
        if self.stop_strings is None or not runner_output.sampled_token_ids:
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        cuts = self.stop_strings.find_stop_strings(runner_output.sampled_token_ids)
        return self.scheduler.update_from_output(scheduler_output, runner_output, cuts)
