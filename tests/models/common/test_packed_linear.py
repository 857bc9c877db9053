"""The oneDNN packed-weight form of `Linear`: the same product as `F.linear` (to fp32
rounding), only from its row threshold on, never on a weight edited after packing or where
autograd needs the product, and chosen by measurement."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from speckv.models.common import packed_linear
from speckv.models.common.layers import Linear
from speckv.models.common.packed_linear import (
    choose_packed_min_rows,
    onednn_available,
    set_packed,
    use_packed_weights_where_faster,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN")


def _layer(bias: bool, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(96, 160, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(160, generator=gen))
    return layer


@needs_onednn
@pytest.mark.parametrize("shape", [(2, 96), (5, 96), (3, 4, 96)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_packed_form_computes_the_plain_product(shape, bias):
    layer = _layer(bias)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    plain = F.linear(x, layer.weight, layer.bias)
    set_packed([layer], min_rows=2)
    with torch.no_grad():
        packed = layer(x)
    assert packed.shape == plain.shape
    # fp32 sums of 96 products of N(0, 1) terms in another order: ~1e-6 relative
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-4)


@needs_onednn
def test_fewer_rows_than_the_threshold_keep_the_plain_kernel():
    layer = _layer(bias=False)
    set_packed([layer], min_rows=2)
    x = torch.randn(1, 96)
    with torch.no_grad():
        assert torch.equal(layer(x), F.linear(x, layer.weight))


@needs_onednn
def test_a_weight_edited_after_packing_or_needing_gradients_is_not_read_packed():
    layer = _layer(bias=True)
    set_packed([layer], min_rows=1)
    x = torch.randn(4, 96)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # a stale packed copy would give the old product
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    set_packed([layer], min_rows=1)
    out = layer(x)  # grad mode, a weight that requires grad: autograd must see the product
    out.sum().backward()
    assert layer.weight.grad is not None
    torch.testing.assert_close(layer.weight.grad, x.sum(0).expand(160, 96))


def test_the_threshold_follows_the_measurement():
    #              rows: (plain s, packed s)
    clear = {1: (1.0, 1.2), 2: (2.0, 1.0), 4: (2.0, 1.5), 8: (2.0, 1.6)}
    assert choose_packed_min_rows(clear) == 2
    assert choose_packed_min_rows({**clear, 1: (1.0, 0.8)}) == 1
    unclear = {1: (1.0, 1.0), 2: (2.0, 1.9), 4: (2.0, 1.95), 8: (2.0, 2.0)}
    assert choose_packed_min_rows(unclear) is None
    assert choose_packed_min_rows({1: (1.0, 0.5)}) is None  # no multi-row measurement


def test_a_model_that_fits_in_the_cache_is_not_packed(monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a cache-resident model must not be timed")

    monkeypatch.setattr(packed_linear, "time_packed", no_timing)
    model = nn.Sequential(Linear(64, 64), nn.ReLU(), Linear(64, 64))
    assert use_packed_weights_where_faster(model) is None
    assert all(m.packed is None for m in model if isinstance(m, Linear))


@needs_onednn
def test_a_model_is_measured_once_per_architecture_and_tied_weights_pack_once(monkeypatch):
    calls = []

    def timed(weights, *args, **kwargs):
        calls.append(len(weights))
        return {1: (1.0, 1.5), 2: (2.0, 1.0), 4: (2.0, 1.0), 8: (2.0, 1.0)}

    monkeypatch.setattr(packed_linear, "time_packed", timed)
    monkeypatch.setattr(packed_linear, "_CHOSEN", {})
    monkeypatch.setattr(packed_linear, "STREAMED_BYTES", 1 << 20)

    def build():  # 4 x 1 MiB of weights, the last tied to the first
        model = nn.Sequential(*(Linear(512, 512, bias=False) for _ in range(4)))
        model[3].weight = model[0].weight
        return model

    first, second = build(), build()
    assert use_packed_weights_where_faster(first) == 2
    assert use_packed_weights_where_faster(second) == 2
    assert calls == [1]  # the first MiB streamed, once for both models
    assert first[0].packed[2] is first[3].packed[2]
    assert all(m.packed_min_rows == 2 for m in second)
