"""Which dtype `speckv train-draft` computes in on this CPU (data generation and training).

Owns that one choice. bfloat16 halves the bytes a batched forward streams, and where the CPU
has native bfloat16 kernels it ran data generation about 2x faster than float32 (the Xeon the
shipped head was trained on); without them torch emulates it, and the same GEMM is several
times slower than float32:

    [96, 576] x [576, 1536], 1 thread, ms     float32   bfloat16
    AMD EPYC (AVX2, no AVX-512 BF16)             2.9       20.0

So `auto` times both on a GEMM of the shape batched decoding runs and takes bfloat16 only
where it is clearly faster. The features stored for training stay bfloat16 either way (half
the memory; the head reads them in float32).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from speckv.attention.kv_cache import resolve_dtype

CHOICES: tuple[str, ...] = ("auto", "float32", "bfloat16")  # `--dtype`
# bfloat16 is taken where its median GEMM time is below this share of float32's: a shared
# machine moves one timing by 10-20%, and the emulated kernels lose by far more than that
CLEAR_SHARE = 0.8
_SHAPE = (96, 576, 1536)  # rows (requests decoded together), SmolLM2 hidden, its MLP width
_NUM_REPS = 5
_CALLS_PER_REP = 4


def gemm_seconds(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
                 shape: tuple[int, int, int] = _SHAPE) -> dict[torch.dtype, float]:
    """Median process-CPU seconds of one `x [rows, in] @ W^T [in, out]` per dtype, the dtypes
    timed in interleaved passes (so load from other processes lands on each alike)."""
    rows, inp, out = shape
    gen = torch.Generator().manual_seed(0)
    weights = {d: torch.randn(out, inp, generator=gen).to(d) for d in dtypes}
    inputs = {d: torch.randn(rows, inp, generator=gen).to(d) for d in dtypes}
    for d in dtypes:  # warm up: first calls pay one-time kernel selection
        F.linear(inputs[d], weights[d])
    samples: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
    for _ in range(_NUM_REPS):
        for d in dtypes:
            start = time.process_time()
            for _ in range(_CALLS_PER_REP):
                F.linear(inputs[d], weights[d])
            samples[d].append((time.process_time() - start) / _CALLS_PER_REP)
    return {d: statistics.median(s) for d, s in samples.items()}


def choose_dtype(seconds: dict[torch.dtype, float]) -> torch.dtype:
    """bfloat16 where it timed clearly faster than float32 (`CLEAR_SHARE`), else float32."""
    bf16, fp32 = seconds.get(torch.bfloat16), seconds.get(torch.float32)
    if bf16 is not None and fp32 is not None and bf16 < CLEAR_SHARE * fp32:
        return torch.bfloat16
    return torch.float32


def training_dtype(name: str) -> torch.dtype:
    """`--dtype`: "auto" (timed on this CPU), "float32" or "bfloat16"."""
    if name not in CHOICES:
        raise ValueError(f"--dtype must be one of {', '.join(CHOICES)}, got {name!r}")
    return choose_dtype(gemm_seconds()) if name == "auto" else resolve_dtype(name)
