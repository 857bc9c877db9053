"""Whether a loaded model's few-row fp32 CPU products read its weights as its checkpoint holds
them: GGUF blocks (Q4_1, Q8_0) or fp16.

Owns that choice for a loaded model: which projections get a compact copy of their weight
(`attach_compact` for a GGUF file's blocks, `attach_half` for fp16-exact weights; only where
it widens to exactly the loaded fp32 weight) and up to how many rows `Linear` computes from it
(`use_compact_where_faster`, measured per machine at load against the forms that run
otherwise, as `native_linear` measures its kernel).

A decode step reads every weight once, and the built-in model's fp32 weights are its Q4_1 and
Q8_0 blocks widened: 538 MB a step where the blocks are 112 MB (4-bit values or int8 with fp32
scales); its EAGLE3 head's are its fp16 checkpoint widened (2x the bytes). `_blockdot.c`
widens each weight to the fp32 value the loaded copy holds (exactly: see there) and sums in
the order `_rowdot.rowdot` sums that copy, so the products are `rowdot`'s to the bit from a
fraction of the bytes:

    the built-in model's 211 projections (LM head included), 1 thread, ms per pass
    (AMD EPYC, AVX-512; fastest of 5):
                                 1 row   2 rows   4 rows   8 rows
    rowdot on the fp32 weights    23.8     26.5     34.9     64.3
    blocks (_blockdot)            10.2     12.2     17.6     37.8

Nothing else changes: prefill chunks keep the fp32 forms (oneDNN), and a forward's form still
depends only on its shapes, so a hit reads what a cold run wrote.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from speckv.models.common.compact_weight import CompactWeight, half_of
from speckv.models.common.form_timing import (
    STREAMED_BYTES,
    max_rows_clearly_faster,
    streamed_weights,
    time_row_limit,
)
from speckv.models.common.layers import Linear
from speckv.models.common.small_rows import cpu_fp32_linears

try:
    from speckv.models.common import _blockdot
except ImportError:  # built without a C compiler: the fp32 forms only
    _blockdot = None

MEASURED_ROWS = (1, 2, 3, 4, 6, 8)  # as native_linear's
CLEAR_MARGIN = 0.1  # as native_linear's
_NUM_REPS = 5
# (weight shapes and formats, threads, CPU capability, the forms chosen before) -> rows
_CHOSEN: dict[tuple, int] = {}


def blockdot_instruction_set() -> str | None:
    """The kernel body this CPU runs ("avx512", "avx2", "baseline"); None when not built."""
    return None if _blockdot is None else _blockdot.instruction_set()


def attach_compact(model: nn.Module, weights: Iterable[tuple[str, CompactWeight]],
                   name_of: Callable[[str], str]) -> int:
    """Give each fp32 CPU projection of `model` whose parameter is named `name_of(file name)`
    that compact weight, where it widens to exactly the weight the projection holds (a tied LM
    head shares its embedding's). Returns how many projections got one (0 without the
    kernel)."""
    if _blockdot is None:
        return 0
    params = dict(model.named_parameters())
    by_weight: dict[int, CompactWeight] = {}
    for file_name, compact in weights:
        weight = params.get(name_of(file_name))
        if (weight is not None and weight.dtype == torch.float32 and weight.dim() == 2
                and compact.in_features == weight.shape[1]
                and torch.equal(compact.widen(), weight.detach())):
            by_weight[id(weight)] = compact
    return _attach(model, lambda weight: by_weight.get(id(weight)))


def attach_half(model: nn.Module) -> int:
    """Give each fp32 CPU projection of `model` without a compact weight its fp16 copy, where
    every value of the weight is an fp16 one (a checkpoint stored in fp16). Returns how many
    projections got one (0 without the kernel)."""
    if _blockdot is None:
        return 0
    halves: dict[int, CompactWeight | None] = {}

    def half(weight: torch.Tensor) -> CompactWeight | None:
        if id(weight) not in halves:
            halves[id(weight)] = half_of(weight)
        return halves[id(weight)]

    return _attach(model, half)


def _attach(model: nn.Module, compact_of: Callable[[torch.Tensor], CompactWeight | None]
            ) -> int:
    attached = 0
    for m in cpu_fp32_linears(model):
        if m.compact is not None and m.compact[0] is m.weight:
            continue
        compact = compact_of(m.weight)
        if compact is not None:
            m.compact = (m.weight, m.weight._version, compact)
            attached += 1
    return attached


def use_compact_where_faster(model: nn.Module, min_bytes: int = STREAMED_BYTES) -> int:
    """Compute the few-row products of `model`'s projections that hold a compact weight from
    it, up to the row count where that measured faster on this machine than the forms chosen
    before (once per process per architecture; on the first `STREAMED_BYTES` of fp32 weights,
    which a pass then reads compact). A model of fewer than `min_bytes` fp32 weights keeps the
    other forms: it stays in the cache, a regime the passes do not measure (a drafter, whose
    weights the target's step evicts between its forwards, passes 0). Returns
    `compact_max_rows` (0: never, or no compact weights)."""
    linears = [m for m in cpu_fp32_linears(model) if m.compact is not None]
    if not linears or sum(m.weight.numel() * 4 for m in linears) < min_bytes:
        set_compact_max_rows(linears, 0)
        return 0
    key = (tuple((tuple(m.weight.shape), m.compact[2].format) for m in linears),
           torch.get_num_threads(), torch.backends.cpu.get_cpu_capability(),
           tuple((m.packed is not None, m.packed_min_rows, m.transposed_rows, m.native_max_rows,
                  m.panel is not None, m.panel_min_rows, m.panel_max_rows) for m in linears))
    if key not in _CHOSEN:
        num_streamed = len(streamed_weights([m.weight for m in linears], STREAMED_BYTES))
        timings = time_row_limit(linears[:num_streamed], "compact_max_rows", MEASURED_ROWS,
                                 _NUM_REPS, time.process_time)
        _CHOSEN[key] = max_rows_clearly_faster(timings, CLEAR_MARGIN)
    set_compact_max_rows(linears, _CHOSEN[key])
    return _CHOSEN[key]


def set_compact_max_rows(linears: Sequence[Linear], max_rows: int) -> None:
    """Compute inputs of up to `max_rows` rows of each of `linears` from its compact weight."""
    for m in linears:
        if max_rows and m.compact is None:
            raise ValueError("set_compact_max_rows: a projection without a compact weight")
        m.compact_max_rows = max_rows


def compact_max_rows_of(model: nn.Module) -> int:
    """The most rows any of `model`'s projections computes from a compact weight (0: none)."""
    return max((m.compact_max_rows for m in cpu_fp32_linears(model)), default=0)
