"""A projection's weight held narrower than fp32 where that loses nothing: GGUF blocks of 32
inputs with one scale each (Q4_1, Q8_0), or fp16 (a checkpoint stored in fp16, run in fp32).

Owns the layouts speckv's kernel (`_blockdot.c`) reads, their fp32 meaning (`widen`, which
for blocks `gguf.quants.dequantize` computes too) and the product over them (`product`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    from speckv.models.common import _blockdot
except ImportError:  # built without a C compiler: nothing computes from these
    _blockdot = None

FORMATS = ("q4_1", "q8_0", "f16")
# format -> its product (looked up once: `product` runs in every decode projection)
_KERNELS = {} if _blockdot is None else {
    "q4_1": _blockdot.q4_1_dot, "q8_0": _blockdot.q8_0_dot, "f16": _blockdot.f16_dot}


@dataclass(frozen=True)
class CompactWeight:
    """A weight [out, in] (in a multiple of 32) in one of these layouts:

        q4_1: q [out, in / 2] uint8 (per block of 32: input i < 16 in the low nibble of byte
              i, 16 + i in its high nibble), scales [out, in / 32, 2] fp32 (d, min);
              W[j, 32 t + i] = d * q_i + min
        q8_0: q [out, in] int8, scales [out, in / 32] fp32 (d); W[j, 32 t + i] = d * q_i
        f16:  q [out, in] fp16, no scales; W = q

    Block scales are the file's fp16 values widened (exact), and d * q is exact in fp32.
    """

    format: str
    q: torch.Tensor
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # the kernel reads these buffers by address: their shapes must be the layout's
        if self.format not in FORMATS:
            raise ValueError(f"CompactWeight: format {self.format!r} is not one of {FORMATS}")
        out = self.q.shape[0] if self.q.dim() == 2 else -1
        in_features = self.in_features if out >= 0 else -1
        want = {"q4_1": (torch.uint8, (out, in_features // 32, 2)),
                "q8_0": (torch.int8, (out, in_features // 32)),
                "f16": (torch.float16, None)}[self.format]
        scales_ok = (self.scales is None if want[1] is None else
                     self.scales is not None and self.scales.dtype == torch.float32
                     and tuple(self.scales.shape) == want[1] and self.scales.is_contiguous()
                     and self.scales.device.type == "cpu")
        if (out < 0 or in_features % 32 or self.q.dtype != want[0] or not scales_ok
                or not self.q.is_contiguous() or self.q.device.type != "cpu"):
            scales = "none" if self.scales is None else (
                f"{self.scales.dtype} {tuple(self.scales.shape)}")
            raise ValueError(
                f"CompactWeight({self.format}): q {self.q.dtype} {tuple(self.q.shape)} and "
                f"scales {scales} are not the layout (contiguous CPU tensors, a multiple of "
                "32 inputs)")

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.format == "q4_1" else 1)

    def widen(self) -> torch.Tensor:
        """W [out, in] fp32 (for blocks: as `gguf.quants.dequantize` computes it)."""
        out = self.q.shape[0]
        if self.format == "f16":
            return self.q.to(torch.float32)
        if self.format == "q4_1":
            nibbles = self.q.view(out, -1, 16)
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).to(torch.float32)
            return (self.scales[..., :1] * q + self.scales[..., 1:]).reshape(out, -1)
        q = self.q.view(out, -1, 32).to(torch.float32)
        return (self.scales[..., None] * q).reshape(out, -1)

    def product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [n, in] fp32 contiguous CPU (the caller checks) -> x @ W^T (+ bias) [n, out]."""
        rows, out = x.shape[0], self.q.shape[0]
        y = torch.empty((rows, out), dtype=torch.float32)  # [n, out]
        _KERNELS[self.format](x.data_ptr(), self.q.data_ptr(),
                              0 if self.scales is None else self.scales.data_ptr(),
                              0 if bias is None else bias.data_ptr(), y.data_ptr(), rows,
                              self.in_features, out)
        return y


def half_of(weight: torch.Tensor) -> CompactWeight | None:
    """`weight` [out, in] fp32 as fp16 where every value is one exactly (and in a multiple of
    32 inputs), else None."""
    if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % 32
            or weight.device.type != "cpu"):
        return None
    half = weight.detach().to(torch.float16)
    if not torch.equal(half.to(torch.float32), weight.detach()):
        return None
    return CompactWeight("f16", half.contiguous())
