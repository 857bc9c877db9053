"""Whether a loaded model's fp32 CPU projections run through oneDNN with packed weights.

Owns that choice for a loaded model: measured once per process per set of weight shapes (and
thread count) on the model's own `Linear` weights against torch's plain `F.linear`, then each
`Linear` gets its weight packed once (`Linear.packed`). oneDNN's packed layout makes the
few-row products of decode and verification steps cheaper than the plain kernel, which repacks
panels of the weight on every call:

    SmolLM2-135M, its 210 projections + lm_head streamed once, 1 thread, ms per pass
    (AMD EPYC, AVX-512, quiet machine, median of 3):
                             1 row   2 rows   3 rows   4 rows   8 rows   16 rows   32 rows
    F.linear (x @ W^T)        47.3     93.3    119.3     81.2     98.1     132.9     191.8
    oneDNN, packed weight     55.1     60.0     56.7     65.9     78.2      90.5     132.6

So the packed form runs from `Linear.packed_min_rows` rows on, chosen per machine: a
verification step of 3 drafts then costs 1.4x a one-row step instead of 1.7x, a decode step of
8 requests 0.8x what it did; a one-row step keeps the plain kernel where that measured faster
(here). The packed copy costs the projections' memory once more. Where oneDNN is missing,
or measured no faster (another CPU), the model keeps the plain forms. Like the transposed
form, packed rounds differently from `F.linear`; a forward's form depends only on its shapes,
so a hit still reads what a cold run wrote, bit for bit (a 1-row and a multi-row forward
never matched anyway).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common.form_timing import STREAMED_BYTES, streamed_weights, time_two_forms
from speckv.models.common.layers import Linear
from speckv.models.common.small_rows import cpu_fp32_linears

MEASURED_ROWS = (1, 2, 4, 8)  # a decode step, small batches, a verification of 3 drafts
# the packed form is chosen for 2+ rows where its 2..8-row passes summed below
# (1 - CLEAR_MARGIN) of the plain ones, and for 1 row too where that one did as well (a shared
# machine moves a measurement by up to ~20%; the gain measured above is 20-50%)
CLEAR_MARGIN = 0.1
_NUM_REPS = 5
# (weight shapes, threads, CPU capability) -> the fewest rows computed packed (None: never),
# measured once per process
_CHOSEN: dict[tuple, int | None] = {}


def onednn_available() -> bool:
    """Whether this torch build can pack a weight for oneDNN (`torch.ops.mkldnn`)."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


# the row count oneDNN lays the packed weight out for; measured on the built-in model's shapes
# (80 projections, 1 thread, ms): 8 rows 30.2 (hint 8) / 25.3 (hint 32), 16 rows 36.2 / 32.3,
# 32 rows 55.7 / 52.6, 256 rows 368 / 351
PACK_HINT_ROWS = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in] fp32 CPU) in oneDNN's packed layout for `_linear_pointwise`."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_HINT_ROWS)


def time_packed(weights: Sequence[torch.Tensor], rows: Sequence[int] = MEASURED_ROWS,
                num_reps: int = _NUM_REPS, clock: Callable[[], float] = time.process_time
                ) -> dict[int, tuple[float, float]]:
    """Per row count, the fastest (plain, packed) seconds of a pass streaming every weight once,
    the two forms interleaved (`form_timing.time_two_forms`)."""
    packed = [pack_weight(w) for w in weights]

    def plain(index: int, x: torch.Tensor) -> object:
        return F.linear(x, weights[index])

    def packed_form(index: int, x: torch.Tensor) -> object:
        return torch.ops.mkldnn._linear_pointwise(x, packed[index], None, "none", [], "")

    return time_two_forms(weights, rows, num_reps, clock, (plain, packed_form))


def choose_packed_min_rows(timings: dict[int, tuple[float, float]],
                           margin: float = CLEAR_MARGIN) -> int | None:
    """The fewest rows to compute packed: 2 where the multi-row passes summed clearly below
    the plain ones, 1 where the one-row pass did too, None where packing did not pay."""
    multi = [t for n, t in timings.items() if n > 1]
    if not multi or sum(t[1] for t in multi) >= (1.0 - margin) * sum(t[0] for t in multi):
        return None
    one_row = timings.get(1)
    return 1 if one_row is not None and one_row[1] < (1.0 - margin) * one_row[0] else 2


def use_packed_weights_where_faster(model: nn.Module) -> int | None:
    """Pack `model`'s fp32 CPU `Linear` weights where that measured faster on this machine
    (once per process per architecture, on its first `STREAMED_BYTES` of weights); models
    smaller than that stay in the cache, a regime not measured, and keep the plain form.
    Returns the fewest rows computed packed (None: none)."""
    linears = cpu_fp32_linears(model)
    weights = list({id(m.weight): m.weight.detach() for m in linears}.values())  # tied: once
    if (not onednn_available()
            or sum(w.numel() * w.element_size() for w in weights) < STREAMED_BYTES):
        return None
    key = (tuple(tuple(w.shape) for w in weights), torch.get_num_threads(),
           torch.backends.cpu.get_cpu_capability())
    if key not in _CHOSEN:
        _CHOSEN[key] = choose_packed_min_rows(
            time_packed(streamed_weights(weights, STREAMED_BYTES)))
    min_rows = _CHOSEN[key]
    if min_rows is not None:
        set_packed(linears, min_rows)
    return min_rows


def set_packed(linears: Sequence[Linear], min_rows: int = 2) -> None:
    """Pack each of `linears`' weights (a tied weight once) and compute their inputs of
    `min_rows` rows or more with it."""
    by_weight: dict[int, torch.Tensor] = {}
    for m in linears:
        if id(m.weight) not in by_weight:
            by_weight[id(m.weight)] = pack_weight(m.weight)
        m.packed = (m.weight, m.weight._version, by_weight[id(m.weight)])
        m.packed_min_rows = min_rows
