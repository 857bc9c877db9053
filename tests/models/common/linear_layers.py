"""What the tests of `Linear`'s native forms share: a seeded layer and the skip without the
native kernel."""

from __future__ import annotations

import pytest
import torch

from speckv.models.common.layers import Linear
from speckv.models.common.native_linear import rowdot_available

needs_kernel = pytest.mark.skipif(not rowdot_available(),
                                  reason="speckv was built without its native kernel")


def seeded_layer(in_features: int, out_features: int, bias: bool, seed: int = 0) -> Linear:
    """A `Linear` with N(0, 1) weight (and bias) from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer
