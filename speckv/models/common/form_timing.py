"""How a loaded model's projection forms are timed against each other on this machine.

Owns the measurement that the per-machine form choices (`small_rows`: x @ W^T or W @ x^T for
few rows; `packed_linear`: F.linear or oneDNN with packed weights) share: which of the model's
weights one pass streams (`streamed_weights`), and the fastest of such passes in two
forms, interleaved so that a slow moment hits both (`time_two_forms`); and for the forms a
`Linear` takes up to a row limit (`native_linear`, `compact_linear`), the timing with the
limit off and on (`time_row_limit`) and the rule that sets it (`max_rows_clearly_faster`).
Streaming every weight once is what a step does: the weights do not fit in the cache, and a
loop over one warm matrix would time another kernel regime.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

# the weights streamed per pass: the model's first ones up to this size, 4x the AMD EPYC's
# 32 MiB last-level cache (so a pass times the memory-bound regime of a real step) at a
# fraction of a whole model's time (SmolLM2-135M: about 1 s to measure instead of about 3)
STREAMED_BYTES = 128 << 20

# one form of a projection: computes weight `index`'s product with `x` ([rows, in])
Form = Callable[[int, torch.Tensor], object]


def streamed_weights(weights: Sequence[torch.Tensor], num_bytes: int) -> list[torch.Tensor]:
    """The first of `weights` until they hold `num_bytes` bytes (the last one may run past):
    what one timing pass streams."""
    streamed, total_bytes = [], 0
    for w in weights:
        if total_bytes >= num_bytes:
            break
        streamed.append(w)
        total_bytes += w.numel() * w.element_size()
    return streamed


def time_two_forms(weights: Sequence[torch.Tensor], rows: Sequence[int], num_reps: int,
                   clock: Callable[[], float], forms: tuple[Form, Form]
                   ) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest of `num_reps` passes of each of the two `forms` over all
    `weights` ([out, in] fp32 CPU), in the order of `forms`, the forms interleaved. `clock` is
    the process's CPU time in the callers, as the speculation policy's costs: it leaves out
    the time other processes held the core. The fastest, not the median: what other
    processes do (their memory traffic, a sibling thread on the core) only ever slows a pass,
    and on a shared machine it did so for runs of passes long enough to move a median (a
    serve start once measured panel-packed weights clearly faster at 8 rows only, where other
    starts found 2-24)."""
    def one_pass(n: int, form: Form) -> float:
        # fresh inputs every pass: one allocation's placement can keep a form slow for a whole
        # run of passes (seen: 2 rows in W @ x^T at 13 ms or 20 ms per pass by the run)
        inputs = {w.shape[1]: torch.randn(n, w.shape[1]) for w in weights}  # [n, in]
        start = clock()
        with torch.no_grad():
            for index, w in enumerate(weights):
                form(index, inputs[w.shape[1]])
        return clock() - start

    timings = {}
    for n in rows:
        for form in forms:
            one_pass(n, form)  # warm-up: first-touch allocations
        passes: tuple[list[float], list[float]] = ([], [])
        for _ in range(num_reps):
            for times, form in zip(passes, forms):
                times.append(one_pass(n, form))
        timings[n] = (min(passes[0]), min(passes[1]))
    return timings


def time_row_limit(linears: Sequence[nn.Module], limit: str, rows: Sequence[int],
                   num_reps: int, clock: Callable[[], float]
                   ) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest (other forms, the form behind `limit`) seconds of a pass
    through `linears`, where `limit` names the attribute of a `Linear` up to which it computes
    that form (`native_max_rows`, `compact_max_rows`): 0 for the first, the pass's row count
    for the second. Each limit is as before afterwards."""
    saved = [getattr(m, limit) for m in linears]

    def other(index: int, x: torch.Tensor) -> object:
        setattr(linears[index], limit, 0)
        return linears[index](x)

    def limited(index: int, x: torch.Tensor) -> object:
        setattr(linears[index], limit, x.shape[0])
        return linears[index](x)

    try:
        return time_two_forms([m.weight for m in linears], rows, num_reps, clock,
                              (other, limited))
    finally:
        for m, value in zip(linears, saved):
            setattr(m, limit, value)


def max_rows_clearly_faster(timings: dict[int, tuple[float, float]], margin: float) -> int:
    """The row limit from `time_row_limit`'s timings: up to (not including) the first measured
    row count where the limited form did not run below (1 - margin) of the other; 0 where it
    lost at the fewest rows."""
    max_rows = 0
    for n in sorted(timings):
        other_s, limited_s = timings[n]
        if limited_s >= (1.0 - margin) * other_s:
            break
        max_rows = n
    return max_rows
