"""The shipped drafter for the built-in SmolLM2-135M-Instruct (`speckv/assets/smollm2-eagle3`).

Owns locating and loading the trained EAGLE3 head that `speckv train-draft --install-asset`
writes (fc + one decoder layer + an LM head over a reduced draft vocabulary, fp16; the
embeddings are the target's), the speed-up it measured on the held-out prompt set
(`benchmark.json`, written by `speckv bench spec-decode --record`), and the one rule that turns
speculation on by default from that figure, with the line that says why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from speckv.drafters.base import Drafter
from speckv.drafters.loaders import load_drafter
from speckv.models.base import TargetModel

BUILTIN_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-eagle3"
BUILTIN_DRAFTER_METHOD = "eagle3"  # the only drafter the built-in model ships
BENCHMARK_FILE = "benchmark.json"


def builtin_drafter_available() -> bool:
    return (BUILTIN_DRAFTER_DIR / "config.json").is_file() and (
        BUILTIN_DRAFTER_DIR / "model.safetensors"
    ).is_file()


def load_builtin_drafter(
    model: TargetModel,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
) -> Drafter:
    """The shipped EAGLE3 head on `model` (the built-in SmolLM2); dtype/device default to its."""
    if not builtin_drafter_available():
        raise FileNotFoundError(
            f"no shipped drafter in {BUILTIN_DRAFTER_DIR}; train one with "
            "`speckv train-draft --install-asset`"
        )
    drafter = load_drafter(BUILTIN_DRAFTER_DIR, model, dtype, device)
    if drafter.policy.name != BUILTIN_DRAFTER_METHOD:
        raise ValueError(f"{BUILTIN_DRAFTER_DIR} holds a {drafter.policy.name} drafter, "
                         f"expected {BUILTIN_DRAFTER_METHOD}")
    return drafter


# Speculation is on by default only where the held-out figure reaches this (a smaller gain is
# within what a different prompt mix or machine load takes away).
DEFAULT_ON_SPEEDUP = 1.1


@dataclass(frozen=True)
class MeasuredSpeedup:
    """What `speckv bench spec-decode --record` measured for the shipped head (decode tokens/s
    with speculation / without, greedy, 1 thread, on `prompt_set`, families pooled)."""

    speedup_by_batch: dict[int, float]
    mean_acceptance_length: float
    num_spec_tokens: int
    command: str
    prompt_set: str | None  # the held-out set's name; None: recorded before there was one

    def at(self, batch_size: int) -> float | None:
        """The speed-up measured at the nearest batch size not above `batch_size`."""
        sizes = [b for b in sorted(self.speedup_by_batch) if b <= batch_size]
        return self.speedup_by_batch[sizes[-1]] if sizes else None

    def describe(self, batch_size: int = 1) -> str:
        """The figure as the banner quotes it."""
        where = (f"on the held-out prompt set {self.prompt_set}" if self.prompt_set
                 else "on prompts close to its training set")
        return (f"measured {self.at(batch_size) or 0:.2f}x decode tokens/s at batch "
                f"{batch_size} {where}, mean acceptance length "
                f"{self.mean_acceptance_length:.2f} (`{self.command}`)")


def measured_speedup() -> MeasuredSpeedup | None:
    """The shipped head's recorded benchmark (None: none recorded)."""
    path = BUILTIN_DRAFTER_DIR / BENCHMARK_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return MeasuredSpeedup(
        {int(b): float(s) for b, s in raw["speedup_by_batch"].items()},
        float(raw["mean_acceptance_length"]), int(raw["num_spec_tokens"]), str(raw["command"]),
        raw.get("prompt_set"),
    )


@dataclass(frozen=True)
class SpeculationDefault:
    """Whether the shipped head runs when no speculation flag is given, and why."""

    on: bool
    reason: str  # says what was measured, on which prompts, against which bar


def speculation_default(measured: MeasuredSpeedup | None,
                        batch_size: int = 1) -> SpeculationDefault:
    """The rule every default follows (generate, serve, the demo): on only where the
    held-out figure at `batch_size` is at least `DEFAULT_ON_SPEEDUP`. Pure."""
    if measured is None:
        return SpeculationDefault(False, "no benchmark recorded for the shipped EAGLE3 head")
    if measured.prompt_set is None:
        return SpeculationDefault(False, f"the shipped EAGLE3 head {measured.describe(batch_size)}"
                                  "; not measured on held-out prompts")
    figure = measured.at(batch_size) or 0.0
    if figure >= DEFAULT_ON_SPEEDUP:
        return SpeculationDefault(True, f"the shipped EAGLE3 head {measured.describe(batch_size)}")
    return SpeculationDefault(False, f"the shipped EAGLE3 head {measured.describe(batch_size)}, "
                              f"below the {DEFAULT_ON_SPEEDUP}x that turns it on by default")


def builtin_speculation_pays(batch_size: int = 1) -> bool:
    """Whether the shipped head is on by default (`speculation_default` of the recording)."""
    return speculation_default(measured_speedup(), batch_size).on
