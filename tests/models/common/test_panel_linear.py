"""Panel-packed weights behind `Linear`: the product `F.linear` computes (to fp32 rounding) for
any shape within their row range; a row's bits independent of its batch; the other forms
outside the range, for a weight edited after packing, or where autograd needs the product;
the range chosen by measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from speckv.models.common.native_linear import linear_forms_summary
from speckv.models.common.panel_linear import (
    choose_panel_rows,
    pack_panels,
    panel_rows_of,
    set_panels,
    use_panels_where_faster,
)
from tests.models.common.linear_layers import needs_kernel, seeded_layer


def test_panels_lay_out_32_rows_k_major():
    w = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    panels = pack_panels(w)
    assert panels.shape == (2, 3, 32)
    assert torch.equal(panels[0, 2, 5], w[5, 2]) and torch.equal(panels[1, 1, 7], w[39, 1])
    assert not panels[1, :, 8:].any()  # rows past 40: zeros


@needs_kernel
@pytest.mark.parametrize("out_features", [1, 32, 37, 96])  # whole panels and a partial one
@pytest.mark.parametrize("num_rows", [1, 2, 5, 8, 9, 17])  # chunks of 8 rows + remainders
@pytest.mark.parametrize("bias", [False, True])
def test_panels_compute_the_plain_product(out_features, num_rows, bias):
    layer = seeded_layer(100, out_features, bias)
    x = torch.randn(num_rows, 100, generator=torch.Generator().manual_seed(1))
    plain = F.linear(x, layer.weight, layer.bias)
    set_panels([layer], (1, 32))
    with torch.no_grad():
        out = layer(x)
    # fp32 sums of 100 products of N(0, 1) terms in one chain: ~1e-6 relative
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    layer = seeded_layer(576, 64, bias=True)
    set_panels([layer], (1, 16))
    x = torch.randn(11, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = layer(x)
        for i in range(11):
            assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@needs_kernel
def test_outside_the_range_or_on_an_edited_weight_torch_computes_it():
    layer = seeded_layer(96, 160, bias=True)
    set_panels([layer], (2, 4))
    with torch.no_grad():
        for rows in (1, 5):
            x = torch.randn(rows, 96)
            assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
        layer.weight.mul_(2.0)  # stale panels would give the old product
        x = torch.randn(3, 96)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    set_panels([layer], (1, 4))
    x = torch.randn(2, 96)
    layer(x).sum().backward()  # grad mode: autograd must see the product
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(160, 96))


def test_the_range_is_the_run_without_a_clear_loss_with_the_most_clear_wins():
    #                rows: (other s, panels s)
    timings = {1: (1.0, 1.0), 2: (2.0, 1.0), 4: (2.0, 1.2), 8: (2.0, 1.95), 16: (3.0, 1.0),
               32: (1.0, 1.5), 64: (2.0, 1.0)}
    # 1 and 8 tie (inside the run), 32 is a clear loss: 1-16 holds 3 wins, 64 one
    assert choose_panel_rows(timings) == (1, 16)
    assert choose_panel_rows({1: (1.0, 2.0), 2: (1.0, 0.5), 4: (1.0, 2.0), 8: (1.0, 0.5),
                              16: (1.0, 1.0)}) == (8, 16)  # as many wins: the longer run
    assert choose_panel_rows({1: (1.0, 0.5), 2: (1.0, 0.5)}) == (1, 2)
    assert choose_panel_rows({1: (1.0, 1.0), 2: (1.0, 1.05)}) is None  # ties, no win


@needs_kernel
def test_a_model_in_the_cache_keeps_the_other_forms_and_the_summary_names_them():
    small = torch.nn.Sequential(seeded_layer(64, 64, bias=False))
    assert use_panels_where_faster(small) is None and panel_rows_of(small) is None
    set_panels(list(small), (2, 8))
    assert panel_rows_of(small) == (2, 8)
    assert linear_forms_summary(small).startswith("panel-packed weights for 2-8 rows")
    set_panels(list(small), None)
    assert panel_rows_of(small) is None
