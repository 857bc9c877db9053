"""SamplingParams: how one request samples and when it stops. Frozen and validated.

Owns the per-request knobs (temperature, top-k, top-p, seed, max_tokens, stop strings and
stop token ids), which steps hand back an output (`output_kind`) and what the request carries
for a KV connector (`kv_transfer_params`).
Bad values raise a ValueError naming the field at construction, so a bad request never
reaches the engine's batch.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """Which steps hand back a `RequestOutput` for a request (vLLM's name and choices).

    CUMULATIVE: every step that produced tokens or finished it (the whole output so far and
    the step's delta). FINAL_ONLY: only the last, when it finishes (its delta fields hold the
    whole output, the one output sent); its text is decoded once, then, unless stop strings
    need it every step — the same text. `LLM.generate` asks for FINAL_ONLY."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy (the default); `top_k == 0` and `top_p == 1` are off."""

    max_tokens: int = 16  # output tokens, at most
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # per-request torch.Generator seed; None: derived from the engine
    stop: tuple[str, ...] = ()  # stop strings (excluded from the output text)
    stop_token_ids: tuple[int, ...] = ()  # extra stop tokens (kept in the output, like EOS)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra: dict[str, object] = field(default_factory=dict, compare=False, repr=False)
    # for the KV connector (the API's `kv_transfer_params`, as in vLLM): read by the connector
    # in `get_num_new_matched_tokens`, opaque to the engine
    kv_transfer_params: dict[str, object] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.temperature, int | float)
            or isinstance(self.temperature, bool)
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if (
            not isinstance(self.top_p, int | float)
            or isinstance(self.top_p, bool)
            or not (0.0 < self.top_p <= 1.0)
        ):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop entries must be non-empty strings, got {text!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for token_id in self.stop_token_ids:
            if not _is_int(token_id) or token_id < 0:
                raise ValueError(f"stop_token_ids entries must be ints >= 0, got {token_id!r}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise ValueError(f"kv_transfer_params must be an object (a dict) or None, got "
                             f"{type(self.kv_transfer_params).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
