"""The shipped drafter for the built-in SmolLM2-135M-Instruct (`speckv/assets/smollm2-eagle3`).

Owns locating and loading the trained EAGLE3 head that `speckv train-draft --install-asset`
writes (fc + one decoder layer + an LM head over a reduced draft vocabulary, fp16; the
embeddings are the target's), and the speed-up it measured (`benchmark.json`, written by
`speckv bench spec-decode --record`), so the CLI can say what speculation buys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from speckv.drafters.base import Drafter
from speckv.drafters.loaders import load_drafter
from speckv.models.llama import LlamaForCausalLM

BUILTIN_DRAFTER_DIR = Path(__file__).resolve().parent.parent / "assets" / "smollm2-eagle3"
BUILTIN_DRAFTER_METHOD = "eagle3"  # the only drafter the built-in model ships
BENCHMARK_FILE = "benchmark.json"


def builtin_drafter_available() -> bool:
    return (BUILTIN_DRAFTER_DIR / "config.json").is_file() and (
        BUILTIN_DRAFTER_DIR / "model.safetensors"
    ).is_file()


def load_builtin_drafter(
    model: LlamaForCausalLM,
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


@dataclass(frozen=True)
class MeasuredSpeedup:
    """What `speckv bench spec-decode` measured for the shipped head (decode tokens/s with
    speculation / without, greedy, 1 thread, held-out prompts)."""

    speedup_by_batch: dict[int, float]
    mean_acceptance_length: float
    num_spec_tokens: int
    command: str

    def at(self, batch_size: int) -> float | None:
        """The speed-up measured at the nearest batch size not above `batch_size`."""
        sizes = [b for b in sorted(self.speedup_by_batch) if b <= batch_size]
        return self.speedup_by_batch[sizes[-1]] if sizes else None


def measured_speedup() -> MeasuredSpeedup | None:
    """The shipped head's recorded benchmark (None: none recorded)."""
    path = BUILTIN_DRAFTER_DIR / BENCHMARK_FILE
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    return MeasuredSpeedup(
        {int(b): float(s) for b, s in raw["speedup_by_batch"].items()},
        float(raw["mean_acceptance_length"]), int(raw["num_spec_tokens"]), str(raw["command"]),
    )


def builtin_speculation_pays(batch_size: int = 1) -> bool:
    """Whether the shipped head's recorded benchmark is faster than no speculation at
    `batch_size` (the rule every default follows: generate, serve, the demo)."""
    measured = measured_speedup()
    return measured is not None and (measured.at(batch_size) or 0.0) > 1.0
