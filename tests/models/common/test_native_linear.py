"""speckv's own few-row kernel behind `Linear`: the product `F.linear` computes (to fp32
rounding) for any width, bias or row count up to its limit; a row's bits independent of the
rest of its batch; torch's kernels wherever it does not apply (more rows, autograd, a
non-contiguous input); chosen by measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speckv.models.common.native_linear import (
    choose_native_max_rows,
    native_max_rows_of,
    rowdot_instruction_set,
    set_native_max_rows,
    use_native_where_faster,
)
from tests.models.common.linear_layers import needs_kernel, seeded_layer


@needs_kernel
@pytest.mark.parametrize("in_features", [1, 31, 32, 96, 100, 576])  # the 32-wide steps + tail
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 9])  # chunks of 4 rows + remainders
@pytest.mark.parametrize("bias", [False, True])
def test_the_native_form_computes_the_plain_product(in_features, num_rows, bias):
    layer = seeded_layer(in_features, 37, bias)  # an odd number of outputs
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    plain = F.linear(x, layer.weight, layer.bias)
    set_native_max_rows([layer], 16)
    with torch.no_grad():
        native = layer(x)
    assert native.shape == plain.shape and native.dtype == torch.float32
    # fp32 sums of up to 576 products of N(0, 1) terms in another order: ~1e-6 relative
    torch.testing.assert_close(native, plain, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    layer = seeded_layer(576, 64, bias=True)
    set_native_max_rows([layer], 8)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = layer(x)
        for i in range(7):
            assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@needs_kernel
def test_where_the_native_form_does_not_apply_torch_computes_it():
    layer = seeded_layer(96, 160, bias=True)
    set_native_max_rows([layer], 2)
    three = torch.randn(3, 96)
    with torch.no_grad():
        assert torch.equal(layer(three), F.linear(three, layer.weight, layer.bias))
        strided = torch.randn(96, 2).t()  # [2, 96], not contiguous
        assert torch.equal(layer(strided), F.linear(strided, layer.weight, layer.bias))
        batched = torch.randn(1, 2, 96)  # leading dims: not a 2-D input
        assert torch.equal(layer(batched), F.linear(batched, layer.weight, layer.bias))
    x = torch.randn(2, 96)
    out = layer(x)  # grad mode, a weight that requires grad: autograd must see the product
    out.sum().backward()
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(160, 96))
    with torch.no_grad(), pytest.raises(RuntimeError):
        layer(torch.randn(2, 95))  # a wrong width is refused as torch refuses it


@needs_kernel
def test_the_kernel_names_its_instruction_set():
    assert rowdot_instruction_set() in {"avx512", "avx2", "baseline"}


def test_the_row_limit_follows_the_measurement():
    #                rows: (other form s, native s)
    timings = {1: (2.0, 1.0), 2: (2.0, 1.2), 3: (2.0, 1.9), 4: (2.0, 1.0)}
    assert choose_native_max_rows(timings) == 2  # 3 did not clearly win: stop there
    assert choose_native_max_rows({1: (1.0, 0.95)}) == 0
    assert choose_native_max_rows({}) == 0


def test_a_model_in_the_cache_keeps_torchs_kernels():
    small = torch.nn.Sequential(seeded_layer(64, 64, bias=False))  # far below the streamed size
    assert use_native_where_faster(small) == 0
    assert native_max_rows_of(small) == 0


def test_without_the_kernel_nothing_can_turn_it_on(monkeypatch):
    from speckv.models.common import native_linear

    monkeypatch.setattr(native_linear, "_rowdot", None)
    assert not native_linear.rowdot_available()
    assert native_linear.rowdot_instruction_set() is None
    with pytest.raises(RuntimeError, match="native kernel"):
        set_native_max_rows([seeded_layer(8, 8, bias=False)], 2)


@needs_kernel
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # the width-0 layer
def test_empty_inputs_give_empty_or_bias_only_products():
    layer = seeded_layer(96, 160, bias=True)
    set_native_max_rows([layer], 4)
    with torch.no_grad():
        assert layer(torch.empty(0, 96)).shape == (0, 160)
        width_zero = seeded_layer(0, 5, bias=True)
        set_native_max_rows([width_zero], 4)
        assert torch.equal(width_zero(torch.empty(2, 0)), width_zero.bias.expand(2, 5))


@needs_kernel
def test_the_summary_names_the_forms_by_row_count():
    from speckv.models.common.native_linear import linear_forms_summary

    model = torch.nn.Sequential(seeded_layer(32, 32, bias=False), seeded_layer(32, 32, bias=False))
    assert linear_forms_summary(model) == "torch's kernels"
    set_native_max_rows(list(model), 3)
    summary = linear_forms_summary(model)
    assert summary.startswith(f"speckv's kernel ({rowdot_instruction_set()}) up to 3 rows")
    assert summary.endswith("torch's kernels otherwise")
    for layer in model:
        layer.transposed_rows = frozenset({2, 3, 4, 5})
    assert "W @ x^T for 4, 5 rows" in linear_forms_summary(model)  # 2, 3: the kernel's
    assert linear_forms_summary(torch.nn.ReLU()) == "torch's kernels"
