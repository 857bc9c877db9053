"""Whether a loaded model's few-row fp32 CPU products run through speckv's own kernel.

Owns that choice for a loaded model, and the call into the kernel (`_rowdot.c`, built at
install like the hash chain; absent, torch's kernels run). A decode step multiplies one row
per request by every weight of the model; a batch-1 verification of 3 drafts, four rows. That
is a read of every weight from memory, and torch's kernels read at about half the speed one
core streams memory at:

    SmolLM2-135M's projections streamed once (530 MB of fp32), 1 thread, ms per pass
    (AMD EPYC, AVX-512; a shared machine, median of 5):
                               1 row   2 rows   4 rows   8 rows
    F.linear (x @ W^T)          47.9     73.0     63.2     75.1
    rowdot (W read once)        23.6     26.0     36.2     87.8
    one core reading 530 MB     ~24 (torch.sum over the same weights: 21-22 GB/s)

So each `Linear` computes inputs of up to `Linear.native_max_rows` rows with it, measured per
machine at load against the form that would run otherwise (plain, transposed or oneDNN
packed, chosen before: `small_rows`, `packed_linear`), for each row count in
`MEASURED_ROWS` up to the first where it does not clearly win. It is one thread: where torch
runs several, the measurement decides whether their summed bandwidth beats it. Each output's
summation order depends only on the weight's width, so a row gets the same bits whatever else
is in its batch; across forms the bits differ (a forward's form depends only on its shapes, so
a hit still reads what a cold run wrote).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from speckv.models.common.form_timing import (
    STREAMED_BYTES,
    max_rows_clearly_faster,
    streamed_weights,
    time_row_limit,
)
from speckv.models.common.layers import Linear
from speckv.models.common.small_rows import cpu_fp32_linears

try:
    from speckv.models.common import _rowdot
except ImportError:  # built without a C compiler: torch's kernels only
    _rowdot = None

MEASURED_ROWS = (1, 2, 3, 4, 6, 8)  # decode of 1..8 requests, verification of 1..5 drafts
# chosen where its pass measured below (1 - CLEAR_MARGIN) of the other form's (a shared
# machine moves one measurement by up to ~20%; the gain above is 40-65%)
CLEAR_MARGIN = 0.1
_NUM_REPS = 5
# (weight shapes, threads, CPU capability, the forms chosen before) -> native_max_rows
_CHOSEN: dict[tuple, int] = {}


def rowdot_available() -> bool:
    """Whether the native kernel was built (`pip install` with a C compiler)."""
    return _rowdot is not None


def rowdot_instruction_set() -> str | None:
    """The kernel body this CPU runs ("avx512", "avx2", "baseline"); None when not built."""
    return None if _rowdot is None else _rowdot.instruction_set()


def time_native(linears: Sequence[Linear], rows: Sequence[int] = MEASURED_ROWS,
                num_reps: int = _NUM_REPS, clock: Callable[[], float] = time.process_time
                ) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest (other form, native) seconds of a pass through every one of
    `linears` (their forward as set now, then with native rows on), interleaved so that a slow
    moment hits both."""
    return time_row_limit(linears, "native_max_rows", rows, num_reps, clock)


def choose_native_max_rows(timings: dict[int, tuple[float, float]],
                           margin: float = CLEAR_MARGIN) -> int:
    """The most rows to compute natively: up to (not including) the first measured row count
    where it did not clearly win; 0 where it lost at 1 row."""
    return max_rows_clearly_faster(timings, margin)


def use_native_where_faster(model: nn.Module) -> int:
    """Compute `model`'s few-row fp32 CPU products natively up to the row count where that
    measured faster on this machine (once per process per architecture and forms chosen, on
    its first `STREAMED_BYTES` of weights; a model smaller than that stays in the cache, a
    regime not measured, and keeps torch's kernels). Returns `native_max_rows` (0: never)."""
    linears = [m for m in cpu_fp32_linears(model) if m.weight.is_contiguous()]
    if _rowdot is None or sum(m.weight.numel() * 4 for m in linears) < STREAMED_BYTES:
        return 0
    key = (tuple(tuple(m.weight.shape) for m in linears), torch.get_num_threads(),
           torch.backends.cpu.get_cpu_capability(),
           tuple((m.packed is not None, m.packed_min_rows, m.transposed_rows) for m in linears))
    if key not in _CHOSEN:
        num_streamed = len(streamed_weights([m.weight for m in linears], STREAMED_BYTES))
        _CHOSEN[key] = choose_native_max_rows(time_native(linears[:num_streamed]))
    set_native_max_rows(linears, _CHOSEN[key])
    return _CHOSEN[key]


def set_native_max_rows(linears: Sequence[Linear], max_rows: int) -> None:
    """Compute inputs of up to `max_rows` rows of each of `linears` natively (0: never)."""
    if max_rows and _rowdot is None:
        raise RuntimeError("speckv was installed without its native kernel (_rowdot)")
    for m in linears:
        m.native_max_rows = max_rows


def native_max_rows_of(model: nn.Module) -> int:
    """What `set_native_max_rows` set on `model`'s projections (0: none, or no projection)."""
    return next((m.native_max_rows for m in cpu_fp32_linears(model)), 0)


def single_threaded_max_rows(model: nn.Module) -> int:
    """The most rows any of `model`'s projections computes on speckv's own kernels (the
    compact, panel and native forms), which run on one thread (0: none). Past it, torch's
    kernels take the products and split them across threads."""
    return max((max(m.compact_max_rows, m.native_max_rows,
                    m.panel_max_rows if m.panel is not None else 0)
                for m in cpu_fp32_linears(model)), default=0)


def linear_forms_summary(model: nn.Module) -> str:
    """What computes `model`'s fp32 CPU projections, by row count, in a user's words."""
    linears = cpu_fp32_linears(model)
    if not linears:
        return "torch's kernels"
    first = linears[0]
    parts = []
    compact_rows = max(m.compact_max_rows for m in linears)
    if compact_rows:
        formats = sorted({m.compact[2].format.upper() for m in linears if m.compact_max_rows})
        parts.append(f"the checkpoint's {' / '.join(formats)} weights (speckv's kernel) up to "
                     f"{compact_rows} rows")
    if first.panel is not None:
        parts.append(f"panel-packed weights for {first.panel_min_rows}-{first.panel_max_rows} "
                     "rows")
    if first.native_max_rows:
        parts.append(f"speckv's kernel ({rowdot_instruction_set()}) up to "
                     f"{first.native_max_rows} rows")
    if first.packed is not None:
        parts.append(f"oneDNN packed weights from "
                     f"{max(first.packed_min_rows, first.native_max_rows + 1)} rows")
    packed_from = first.packed_min_rows if first.packed is not None else None
    transposed = sorted(n for n in first.transposed_rows if n > first.native_max_rows
                        and (packed_from is None or n < packed_from))
    if transposed:  # the rows neither of the forms above takes
        parts.append("W @ x^T for " + ", ".join(map(str, transposed)) + " rows")
    return "; ".join(parts) + ("; torch's kernels otherwise" if parts else "torch's kernels")
