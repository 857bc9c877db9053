"""Whether a loaded model's small-batch fp32 CPU products run on panel-packed weights.

Owns that choice for a loaded model and the packing. A panel is 32 rows of a weight laid out
k-major (`_rowdot.c`: P[t][c][0:32] = W[32 t + r, c]), so one sequential read of the panels
serves every row of x with a broadcast per element: decode steps of several requests read
each weight once at memory speed instead of paying a vector load per row of x per row of W:

    75 projections of the built-in model's shapes, 1 thread, ms per pass (AMD EPYC, AVX-512):
                           1 row  2 rows  4 rows  8 rows  16 rows  32 rows
    oneDNN, packed (32)     22.5    25.2    20.7    25.8     31.6     49.8
    rowdot (W as is)        18.5    21.1    24.4    37.3     60.8    104.3
    panels                  18.4    16.2    15.7    16.4     30.4     50.2

So `Linear` computes inputs of `panel_min_rows`..`panel_max_rows` rows on its panels, the
range of `MEASURED_ROWS` where they measured clearly faster, per machine at load, than the
forms that run otherwise (`native_linear`, `packed_linear`), ties inside it included. The
panels are one more copy of the projections' weights (as oneDNN's packed copy is). Each
output sums over the input width in order, one chain, whatever the other rows of its batch: a
row's bits do not depend on its batch, and differ from the other forms' by fp32 rounding (a
forward's form depends only on its shapes, so a hit still reads what a cold run wrote).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from speckv.models.common.form_timing import STREAMED_BYTES, streamed_weights, time_two_forms
from speckv.models.common.layers import Linear
from speckv.models.common.small_rows import cpu_fp32_linears

try:
    from speckv.models.common import _rowdot
except ImportError:  # built without a C compiler: torch's kernels only
    _rowdot = None

PANEL_WIDTH = 32  # outputs per panel (the kernel's tile)
MEASURED_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CLEAR_MARGIN = 0.1  # as native_linear's and packed_linear's
_NUM_REPS = 5
_CHOSEN: dict[tuple, tuple[int, int] | None] = {}


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [m, k] fp32 -> panels [ceil(m / 32), k, 32] (rows past m zero)."""
    m, k = weight.shape
    num_panels = -(-m // PANEL_WIDTH)
    padded = weight.new_zeros((num_panels * PANEL_WIDTH, k))
    padded[:m] = weight.detach()
    return padded.view(num_panels, PANEL_WIDTH, k).transpose(1, 2).contiguous()


def set_panels(linears: Sequence[Linear], rows: tuple[int, int] | None) -> None:
    """Compute inputs of rows[0]..rows[1] rows of each of `linears` on panels of its weight
    (a tied weight packed once); None: never."""
    if rows is not None and _rowdot is None:
        raise RuntimeError("speckv was installed without its native kernel (_rowdot)")
    by_weight: dict[int, torch.Tensor] = {}
    for m in linears:
        if rows is None:
            m.panel = None
            continue
        if id(m.weight) not in by_weight:
            by_weight[id(m.weight)] = pack_panels(m.weight)
        m.panel = (m.weight, m.weight._version, by_weight[id(m.weight)])
        m.panel_min_rows, m.panel_max_rows = rows


def time_panels(linears: Sequence[Linear], rows: Sequence[int] = MEASURED_ROWS,
                num_reps: int = _NUM_REPS, clock: Callable[[], float] = time.process_time
                ) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest (other forms, panels) seconds of a pass through `linears`."""
    saved = [(m.panel, m.panel_min_rows, m.panel_max_rows) for m in linears]
    panels = [pack_panels(m.weight) for m in linears]

    def other(index: int, x: torch.Tensor) -> object:
        linears[index].panel = None
        return linears[index](x)

    def panel(index: int, x: torch.Tensor) -> object:
        m = linears[index]
        m.panel = (m.weight, m.weight._version, panels[index])
        m.panel_min_rows = m.panel_max_rows = x.shape[0]
        return m(x)

    try:
        return time_two_forms([m.weight for m in linears], rows, num_reps, clock,
                              (other, panel))
    finally:
        for m, (p, lo, hi) in zip(linears, saved):
            m.panel, m.panel_min_rows, m.panel_max_rows = p, lo, hi


def choose_panel_rows(timings: dict[int, tuple[float, float]], margin: float = CLEAR_MARGIN
                      ) -> tuple[int, int] | None:
    """The run of measured row counts without a clear loss of the panels that holds the most
    clear wins (the longer of two with as many), as (fewest, most) rows; None where they never
    clearly won. A count where the two forms tie stays inside the run: either form is as fast
    there, and on a shared machine one noisy count must not cut the range (seen: runs of clear
    wins 2-32, 6-8 and 3-8 from three starts on one machine)."""
    ordered = sorted(timings)
    best: tuple[int, int, int] | None = None  # (clear wins, first index, last index)
    start, wins = None, 0
    for i, n in enumerate(ordered + [None]):  # type: ignore[list-item]
        other_s, panels_s = timings[n] if n is not None else (0.0, 1.0)
        loses = panels_s > (1.0 + margin) * other_s
        if not loses:
            start = i if start is None else start
            wins += panels_s < (1.0 - margin) * other_s
            continue
        if start is not None and wins and (
                best is None or (wins, i - 1 - start) > (best[0], best[2] - best[1])):
            best = (wins, start, i - 1)
        start, wins = None, 0
    return None if best is None else (ordered[best[1]], ordered[best[2]])


def use_panels_where_faster(model: nn.Module) -> tuple[int, int] | None:
    """Pack `model`'s fp32 CPU projections into panels and use them for the row counts where
    that measured faster on this machine (once per process per architecture and forms chosen
    before, on its first `STREAMED_BYTES`; a model smaller than that keeps the other forms).
    Returns (fewest, most) rows computed on panels, or None."""
    linears = [m for m in cpu_fp32_linears(model) if m.weight.is_contiguous()]
    if _rowdot is None or sum(m.weight.numel() * 4 for m in linears) < STREAMED_BYTES:
        return None
    key = (tuple(tuple(m.weight.shape) for m in linears), torch.get_num_threads(),
           torch.backends.cpu.get_cpu_capability(),
           tuple((m.packed is not None, m.packed_min_rows, m.transposed_rows,
                  m.native_max_rows) for m in linears))
    if key not in _CHOSEN:
        num_streamed = len(streamed_weights([m.weight for m in linears], STREAMED_BYTES))
        _CHOSEN[key] = choose_panel_rows(time_panels(linears[:num_streamed]))
    set_panels(linears, _CHOSEN[key])
    return _CHOSEN[key]


def panel_rows_of(model: nn.Module) -> tuple[int, int] | None:
    """What `set_panels` set on `model`'s projections (None: none, or no projection)."""
    first = next(iter(cpu_fp32_linears(model)), None)
    return None if first is None or first.panel is None else (first.panel_min_rows,
                                                              first.panel_max_rows)
