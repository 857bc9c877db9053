"""speckv's one-pass element-wise steps (`native_pointwise`): SiLU(gate) * up, RMSNorm and
RoPE equal torch's ops to fp32 rounding over widths with tails and extreme inputs; a row's bits
do not depend on its batch; torch's ops run wherever the kernel does not apply (autograd, other
dtypes, strided views), and the layers that use them still train."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speckv.models.common import native_pointwise
from speckv.models.common.layers import RMSNorm, SwiGLUMLP
from speckv.models.common.rope import apply_rope

needs_kernel = pytest.mark.skipif(not native_pointwise.pointwise_available(),
                                  reason="speckv was built without its native kernels")


def _rotate_reference(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _norm_reference(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize("width", [1, 7, 16, 37, 1536])
def test_silu_mul_equals_torch(width):
    gen = torch.Generator().manual_seed(width)
    gate = torch.randn(5, width, generator=gen) * 8
    gate[0, :min(width, 4)] = torch.tensor([-100.0, -88.0, 0.0, 100.0])[:min(width, 4)]
    up = torch.randn(5, width, generator=gen)
    out = native_pointwise.silu_mul(gate, up)
    torch.testing.assert_close(out, F.silu(gate) * up, atol=1e-6, rtol=2e-6)
    scratch = gate.clone()  # in place: written over the gate, same values
    assert native_pointwise.silu_mul(scratch, up, in_place=True) is scratch
    assert torch.equal(scratch, out)


@needs_kernel
@pytest.mark.parametrize("dim", [8, 13, 64, 576])
def test_rms_norm_equals_torch(dim):
    gen = torch.Generator().manual_seed(dim)
    x, weight = torch.randn(6, 3, dim, generator=gen) * 30, torch.randn(dim, generator=gen)
    out = native_pointwise.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(out, _norm_reference(x, weight, 1e-5), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [2, 10, 64, 128])
def test_rope_equals_torch(head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(7, 5, head_dim, generator=gen)
    cos, sin = torch.randn(2, 7, 1, head_dim, generator=gen)
    out = native_pointwise.rope(x, cos, sin)
    torch.testing.assert_close(out, _rotate_reference(x, cos, sin), atol=1e-6, rtol=1e-5)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(3)
    gate, up = torch.randn(2, 9, 100, generator=gen)
    assert torch.equal(native_pointwise.silu_mul(gate[4:5].contiguous(), up[4:5].contiguous()),
                       native_pointwise.silu_mul(gate, up)[4:5])
    weight = torch.randn(100, generator=gen)
    assert torch.equal(native_pointwise.rms_norm(gate[4:5].contiguous(), weight, 1e-6),
                       native_pointwise.rms_norm(gate, weight, 1e-6)[4:5])
    x = torch.randn(9, 4, 32, generator=gen)
    cos, sin = torch.randn(2, 9, 1, 32, generator=gen)
    assert torch.equal(native_pointwise.rope(x[2:3].contiguous(), cos[2:3].contiguous(),
                                             sin[2:3].contiguous()),
                       native_pointwise.rope(x, cos, sin)[2:3])


def test_torch_runs_where_the_kernel_does_not_apply():
    x = torch.randn(4, 16)
    assert native_pointwise.silu_mul(x.bfloat16(), x.bfloat16()) is None  # dtype
    assert native_pointwise.silu_mul(x.t(), x.t()) is None  # strided
    assert native_pointwise.silu_mul(x, x[:, :8]) is None  # shapes differ
    assert native_pointwise.rms_norm(x, torch.ones(8), 1e-6) is None  # width
    assert native_pointwise.rope(x.view(4, 1, 16), torch.ones(4, 1, 8), torch.ones(4, 1, 8)) \
        is None
    wants_grad = x.clone().requires_grad_()
    assert native_pointwise.silu_mul(wants_grad, x) is None
    with torch.no_grad():
        expected = native_pointwise.pointwise_available()
        assert (native_pointwise.silu_mul(wants_grad, x) is not None) == expected


def test_the_layers_still_train():
    """Under autograd the layers take torch's ops, so gradients reach their weights."""
    torch.manual_seed(0)
    norm, mlp = RMSNorm(16, 1e-6), SwiGLUMLP(16, 24)
    x = torch.randn(3, 16)
    cos, sin = torch.randn(2, 3, 1, 16)
    y = mlp(norm(x)).sum() + apply_rope(norm(x).view(3, 1, 16), cos, sin).sum()
    y.backward()
    assert norm.weight.grad is not None and mlp.gate_proj.weight.grad is not None
    with torch.no_grad():  # and the inference forms agree with them
        torch.testing.assert_close(mlp(norm(x)), F.linear(
            F.silu(F.linear(_norm_reference(x, norm.weight, 1e-6), mlp.gate_proj.weight))
            * F.linear(_norm_reference(x, norm.weight, 1e-6), mlp.up_proj.weight),
            mlp.down_proj.weight), atol=1e-5, rtol=1e-5)
