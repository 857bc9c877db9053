"""The adaptive speculation policy's typed measurements and report.

Owns `StepCost` (one step's target, catch-up and proposal seconds), `Verification` (one
request's drafts verified and accepted) and `SpeculationReport` (what speculation did over the
engine's life and what the policy believes now: read by `/metrics` and `generate`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepCost:
    """One step's measured costs (seconds are wall time on the runner's clock)."""

    num_target_tokens: int  # positions the target computed in the step, all requests
    target_s: float  # target forward + sampling / verification
    num_decode_requests: int  # requests that were asked for drafts after the step (B)
    num_spec_tokens: int  # drafts per request asked for (k, 0: none)
    catch_up_s: float  # the drafter's draft-KV catch-up (paid for every k)
    propose_s: float  # the k proposal forwards (0 when k = 0)

    def __post_init__(self) -> None:
        # a cost below zero (a clock read wrong) would make drafting look free
        for name in ("target_s", "catch_up_s", "propose_s"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Verification:
    """One request's verification in one step."""

    num_drafts: int  # drafts verified
    num_accepted: int  # of them accepted (a prefix)

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_drafts:
            raise ValueError(f"accepted {self.num_accepted} of {self.num_drafts} drafts")


@dataclass(frozen=True)
class SpeculationReport:
    """What speculation did over the engine's life, and what the policy believes now (read by
    `/metrics` and `generate`'s summary). Not a step's counts: those are
    `engine.stats.SpecDecodingStats`, in each step's `SchedulerStats`, as in vLLM."""

    max_spec_tokens: int
    num_drafts_by_position: tuple[int, ...]  # steps that verified a draft at position j
    num_accepted_by_position: tuple[int, ...]  # of them, steps that accepted it (index j-1)
    steps_by_num_spec_tokens: tuple[int, ...]  # decode steps that asked for k drafts (index k)
    acceptance_estimate: tuple[float, ...]  # current a_j (conditional, decayed, with prior)
    last_num_spec_tokens: int  # the latest choice
    # predicted tokens/s of the latest choice over no drafts, at the latest batch size (None:
    # not predicted yet, or not adaptive)
    predicted_speedup: float | None = None

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Share of the drafts at position j that were accepted (lifetime; a draft after a
        rejected one counts as rejected, as in vLLM's per-position acceptance rate)."""
        return tuple(a / d if d else 0.0
                     for a, d in zip(self.num_accepted_by_position, self.num_drafts_by_position))

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per request per verification step with drafts (accepted + 1 bonus)."""
        steps = self.num_drafts_by_position[0] if self.num_drafts_by_position else 0
        if not steps:
            return None
        return 1.0 + sum(self.num_accepted_by_position) / steps
