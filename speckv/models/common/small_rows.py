"""Which kernel computes the few-row fp32 CPU matmuls of a decode or verification step.

Owns that choice for a loaded model: measured once per process per set of weight shapes (and
thread count) on the model's own `Linear` weights, then set on each of its `Linear` modules
(`Linear.transposed_rows`); a drafter takes its target's. Batch-1 verification with k drafts
and batch-2..4 decode run `x @ W^T` with 2..4 rows of `x`; torch's CPU kernel for those shapes
is fast on some CPUs and slow on others, and `(W @ x^T)^T` the other way round:

    SmolLM2-135M, its 210 projection matrices streamed once, 1 thread, ms per pass:
                              1 row   2 rows   4 rows   8 rows
    AMD EPYC (AVX2)  x @ W^T     31       49       48       57
                     W @ x^T     31       39       42       74
    Xeon (AVX-512)   x @ W^T     35    30-40    50-81    82-86
                     W @ x^T              57    51-74

So no fixed rule is right on every machine: a rule tuned on the first made the second's
verification steps 1.5-1.8x a one-row step where 1.05-1.1x was possible, and speculation
lost. The two forms round differently; no caller compares them bit for bit (a 1-row and a
multi-row forward never matched anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common.form_timing import STREAMED_BYTES, streamed_weights, time_two_forms
from speckv.models.common.layers import Linear

SMALL_ROWS = range(2, 5)  # the row counts measured (beyond 4 rows x @ W^T wins everywhere seen)
# W @ x^T is chosen where it measured below (1 - CLEAR_MARGIN) of x @ W^T, x @ W^T where above
# (1 + CLEAR_MARGIN); in between the CPU's default. On a shared machine the two forms swap
# places from one measurement to the next by up to ~20% (seen on the AMD EPYC: 2 rows 13 / 17
# ms in a quiet hour, 20 / 20 in a busy one; 3 rows 27 / 23 there, 18 / 21 an hour before);
# the Xeon's 2 rows differ by 1.4-1.9x
CLEAR_MARGIN = 0.2
# where a measurement is not clear, by torch's CPU capability: the form measured faster on
# such a CPU (AVX2: the AMD EPYC above); others keep the plain, reference form
DEFAULT_TRANSPOSED_ROWS: dict[str, frozenset[int]] = {"AVX2": frozenset(SMALL_ROWS)}
_NUM_REPS = 7

# (weight shapes, threads, CPU capability) -> rows computed as W @ x^T: one measurement per
# process for each model architecture (tests and benches load the same model many times)
_CHOSEN: dict[tuple, frozenset[int]] = {}


@dataclass(frozen=True)
class FormTimings:
    """One row count's fastest seconds, over interleaved passes, to stream every weight once in
    each form."""

    num_rows: int
    linear_s: float  # F.linear(x, W): x @ W^T
    transposed_s: float  # (W @ x^T)^T, made contiguous

    def __post_init__(self) -> None:
        if self.linear_s < 0 or self.transposed_s < 0:
            raise ValueError("timings must be >= 0 seconds")


def choose_transposed_rows(timings: Sequence[FormTimings], default: frozenset[int],
                           margin: float = CLEAR_MARGIN) -> frozenset[int]:
    """The row counts to compute as W @ x^T: those where it won by more than `margin`, and
    those of `default` where neither form did."""
    chosen = set()
    for t in timings:
        clear_win = t.transposed_s < (1.0 - margin) * t.linear_s
        clear_loss = t.transposed_s > (1.0 + margin) * t.linear_s
        if clear_win or (t.num_rows in default and not clear_loss):
            chosen.add(t.num_rows)
    return frozenset(chosen)


def time_forms(weights: Sequence[torch.Tensor], rows: Sequence[int] = SMALL_ROWS,
               num_reps: int = _NUM_REPS, clock: Callable[[], float] = time.process_time
               ) -> list[FormTimings]:
    """Per row count, the fastest of `num_reps` passes of each form over all `weights` ([out,
    in] fp32 CPU), interleaved (`form_timing.time_two_forms`)."""
    def linear(index: int, x: torch.Tensor) -> object:
        return F.linear(x, weights[index])

    def transposed(index: int, x: torch.Tensor) -> object:
        return torch.mm(weights[index], x.t()).t().contiguous()

    timings = time_two_forms(weights, rows, num_reps, clock, (linear, transposed))
    return [FormTimings(n, linear_s, transposed_s)
            for n, (linear_s, transposed_s) in timings.items()]


def cpu_fp32_linears(model: nn.Module) -> list[Linear]:
    if not isinstance(model, nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, Linear)
            and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32]


def measure_small_row_form(model: nn.Module) -> frozenset[int]:
    """The row counts to compute as W @ x^T for `model`'s fp32 CPU `Linear` modules, measured
    once per process per architecture on its first weights (`STREAMED_BYTES`), the CPU's
    default (`DEFAULT_TRANSPOSED_ROWS`) where the measurement is not clear. Empty where
    they are fewer than that: such a model stays in the cache, a regime not measured, and tiny
    models (tests) keep the one plain form."""
    return _measure(cpu_fp32_linears(model))


def _measure(linears: list[Linear]) -> frozenset[int]:
    weights = list({id(m.weight): m.weight.detach() for m in linears}.values())  # tied: once
    if sum(w.numel() * w.element_size() for w in weights) < STREAMED_BYTES:
        return frozenset()
    capability = torch.backends.cpu.get_cpu_capability()
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads(), capability)
    if key not in _CHOSEN:
        default = DEFAULT_TRANSPOSED_ROWS.get(capability, frozenset())
        _CHOSEN[key] = choose_transposed_rows(
            time_forms(streamed_weights(weights, STREAMED_BYTES)), default)
    return _CHOSEN[key]


def set_small_row_form(model: nn.Module, transposed_rows: frozenset[int]) -> None:
    """Compute `transposed_rows`-row inputs of `model`'s fp32 CPU `Linear` modules as
    W @ x^T (the rest as x @ W^T)."""
    _set(cpu_fp32_linears(model), transposed_rows)


def _set(linears: list[Linear], transposed_rows: frozenset[int]) -> None:
    for m in linears:
        m.transposed_rows = transposed_rows


def small_row_form_of(model: nn.Module) -> frozenset[int]:
    """What `set_small_row_form` set on `model` (empty: the plain form, or no such module).
    A drafter takes its target's: it runs right after the target's forward has streamed the
    cache clean, so its weights are read from memory as the target's are."""
    return next((m.transposed_rows for m in cpu_fp32_linears(model)), frozenset())


def use_fastest_small_row_form(model: nn.Module) -> frozenset[int]:
    """`set_small_row_form(model, measure_small_row_form(model))` over one walk of its
    modules; returns the rows."""
    linears = cpu_fp32_linears(model)
    rows = _measure(linears)
    _set(linears, rows)
    return rows
