"""A projection's weight as a GGUF checkpoint stores it: blocks of 32 inputs, one scale each.

Owns the layout speckv's block kernel (`_blockdot.c`) reads and its fp32 meaning
(`QuantizedBlocks.dequantize`, which `gguf.quants.dequantize` computes too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedBlocks:
    """A weight [out, in] in GGUF blocks of 32 inputs, its fp16 scales widened to fp32 (exact):

        q4_1: q [out, in / 2] uint8 (per block: input i < 16 in the low nibble of byte i,
              16 + i in its high nibble), scales [out, in / 32, 2] (d, min);
              W[j, 32 t + i] = d * q_i + min
        q8_0: q [out, in] int8, scales [out, in / 32] (d); W[j, 32 t + i] = d * q_i
    """

    format: str  # "q4_1" or "q8_0"
    q: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        # the kernel reads these buffers by address: their shapes must be the layout's
        out = self.q.shape[0] if self.q.dim() == 2 else -1
        if self.format == "q4_1":
            in_features = 2 * self.q.shape[1] if out >= 0 else -1
            want = (torch.uint8, (out, in_features // 32, 2))
        elif self.format == "q8_0":
            in_features = self.q.shape[1] if out >= 0 else -1
            want = (torch.int8, (out, in_features // 32))
        else:
            raise ValueError(f"QuantizedBlocks: format {self.format!r} is not q4_1 or q8_0")
        if (out < 0 or in_features % 32 or self.q.dtype != want[0]
                or self.scales.dtype != torch.float32 or tuple(self.scales.shape) != want[1]
                or not (self.q.is_contiguous() and self.scales.is_contiguous())
                or self.q.device.type != "cpu" or self.scales.device.type != "cpu"):
            raise ValueError(
                f"QuantizedBlocks({self.format}): q {self.q.dtype} {tuple(self.q.shape)} and "
                f"scales {self.scales.dtype} {tuple(self.scales.shape)} are not the layout "
                "(contiguous CPU tensors, a multiple of 32 inputs)")

    @property
    def in_features(self) -> int:
        return self.q.shape[1] * (2 if self.format == "q4_1" else 1)

    def dequantize(self) -> torch.Tensor:
        """W [out, in] fp32, as `gguf.quants.dequantize` computes it."""
        out = self.q.shape[0]
        if self.format == "q4_1":
            nibbles = self.q.view(out, -1, 16)
            q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).to(torch.float32)
            return (self.scales[..., :1] * q + self.scales[..., 1:]).reshape(out, -1)
        q = self.q.view(out, -1, 32).to(torch.float32)
        return (self.scales[..., None] * q).reshape(out, -1)
