"""speckv's kernel over weights as the checkpoint holds them (GGUF blocks, fp16) behind
`Linear`: blocks widen to what `gguf` dequantizes, every body widens every finite fp16 value
exactly; the products have `rowdot`'s bits on the widened weight, for any row count and bias,
whatever else is in the batch; a compact weight attaches only where it widens to the loaded
weight exactly, and steps aside once the weight changes; the row limit follows the
measurement; on the built-in model every projection gets its blocks, and its EAGLE3 head its
fp16 weights, with the fp32 kernel's bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from speckv.models.common.compact_linear import (
    attach_compact,
    attach_half,
    blockdot_instruction_set,
    compact_max_rows_of,
    set_compact_max_rows,
    use_compact_where_faster,
)
from speckv.models.common.compact_weight import CompactWeight, half_of
from speckv.models.common.layers import Linear
from speckv.models.common.native_linear import set_native_max_rows
from speckv.models.llama.gguf_file import split_blocks

needs_kernel = pytest.mark.skipif(blockdot_instruction_set() is None,
                                  reason="speckv was built without its block kernel")
GGML_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def file_blocks(fmt: str, out_features: int, in_features: int, seed: int
                ) -> tuple[np.ndarray, CompactWeight]:
    """(raw GGUF rows, their blocks) of an N(0, 1) weight quantized by the `gguf` package."""
    weight = np.random.default_rng(seed).standard_normal((out_features, in_features))
    raw = quantize(weight.astype(np.float32), GGML_TYPES[fmt])
    return raw, split_blocks(fmt, raw, in_features)


def block_layer(fmt: str, out_features: int, in_features: int, bias: bool, seed: int = 0
                ) -> Linear:
    """A `Linear` holding the widened weight of seeded blocks, the blocks attached."""
    _, blocks = file_blocks(fmt, out_features, in_features, seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(blocks.widen())
        if bias:
            gen = torch.Generator().manual_seed(seed)
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    model = torch.nn.Sequential(layer)
    assert attach_compact(model, [("0.weight", blocks)], lambda name: name) == 1
    return layer


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_blocks_widen_to_what_gguf_dequantizes(fmt):
    raw, blocks = file_blocks(fmt, 37, 96, seed=3)
    expected = dequantize(raw, GGML_TYPES[fmt]).reshape(37, 96)
    assert torch.equal(blocks.widen(), torch.from_numpy(np.ascontiguousarray(expected)))


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("in_features", [32, 96, 576])
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 9])  # chunks of 4 rows + remainders
@pytest.mark.parametrize("bias", [False, True])
def test_the_block_form_has_rowdots_bits_on_the_widened_weight(fmt, in_features, num_rows,
                                                                 bias):
    layer = block_layer(fmt, 37, in_features, bias)
    twin = Linear(in_features, 37, bias=bias)  # the widened weight in speckv's fp32 kernel
    twin.load_state_dict(layer.state_dict())
    set_native_max_rows([twin], 16)
    set_compact_max_rows([layer], 16)
    x = torch.randn(num_rows, in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        from_blocks, from_fp32 = layer(x), twin(x)
    assert torch.equal(from_blocks, from_fp32)
    # and it is the product (another summation order than torch's: ~1e-6 relative)
    torch.testing.assert_close(from_blocks, F.linear(x, layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    layer = block_layer("q4_1", 64, 576, bias=True)
    set_compact_max_rows([layer], 8)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = layer(x)
        for i in range(7):
            assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@needs_kernel
def test_beyond_the_row_limit_or_after_an_edit_the_fp32_weight_computes_it():
    layer = block_layer("q8_0", 160, 96, bias=True)
    set_compact_max_rows([layer], 2)
    with torch.no_grad():
        three = torch.randn(3, 96)
        assert torch.equal(layer(three), F.linear(three, layer.weight, layer.bias))
        layer.weight[0, 0] += 1.0  # the blocks no longer hold this weight
        two = torch.randn(2, 96)
        assert torch.equal(layer(two), F.linear(two, layer.weight, layer.bias))


def test_blocks_attach_only_where_they_widen_to_the_loaded_weight():
    _, blocks = file_blocks("q4_1", 8, 64, seed=4)
    held, other = Linear(64, 8, bias=False), Linear(64, 8, bias=False)
    with torch.no_grad():
        held.weight.copy_(blocks.widen())
        other.weight.copy_(blocks.widen())
        other.weight[3, 5] = torch.nextafter(other.weight[3, 5], torch.tensor(1e9))  # one ulp
    model = torch.nn.ModuleDict({"held": held, "other": other})
    attached = attach_compact(model, [("held.weight", blocks), ("other.weight", blocks),
                                     ("absent.weight", blocks)], lambda name: name)
    assert attached == (1 if blockdot_instruction_set() else 0)
    assert other.compact is None
    with pytest.raises(ValueError, match="without a compact weight"):
        set_compact_max_rows([other], 2)


def test_a_tied_head_shares_its_embeddings_blocks():
    _, blocks = file_blocks("q8_0", 40, 32, seed=5)
    embed, head = torch.nn.Embedding(40, 32), Linear(32, 40, bias=False)
    with torch.no_grad():
        embed.weight.copy_(blocks.widen())
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    attached = attach_compact(model, [("embed.weight", blocks)], lambda name: name)
    assert attached == (1 if blockdot_instruction_set() else 0)


@pytest.mark.parametrize("q, scales", [
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, 2, dtype=torch.float64)),
    (torch.zeros(4, 15, dtype=torch.uint8), torch.zeros(4, 0, 2)),  # 30 inputs
    (torch.zeros(4, 16, dtype=torch.int8), torch.zeros(4, 1, 2)),
    (torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, 1)),
    (torch.zeros(4, 32, dtype=torch.uint8).t(), torch.zeros(32, 0, 2)),  # not contiguous
])
def test_blocks_outside_the_layout_are_refused(q, scales):
    with pytest.raises(ValueError, match="not the layout"):
        CompactWeight("q4_1", q, scales)
    with pytest.raises(ValueError, match="is not one of"):
        CompactWeight("q5_k", torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, 2))
    with pytest.raises(ValueError, match="not the layout"):  # fp16 has no scales
        CompactWeight("f16", torch.zeros(4, 32, dtype=torch.float16), torch.zeros(4, 1))


def test_a_model_without_blocks_or_in_the_cache_keeps_the_fp32_forms():
    assert use_compact_where_faster(torch.nn.Sequential(Linear(64, 64, bias=False))) == 0
    small = torch.nn.Sequential(block_layer("q4_1", 64, 64, bias=False)) \
        if blockdot_instruction_set() else torch.nn.Sequential(Linear(64, 64))
    assert use_compact_where_faster(small) == 0  # far below the streamed size
    assert compact_max_rows_of(small) == 0


@needs_kernel
def test_the_built_in_model_decodes_from_its_blocks_with_the_fp32_kernels_bits():
    from speckv.models.common.small_rows import cpu_fp32_linears
    from speckv.models.llama.builtin import BuiltinModelMissingError, load_builtin_model

    try:
        model, _, _ = load_builtin_model(progress=False)
    except BuiltinModelMissingError:
        pytest.skip("the built-in model's package is not installed")
    linears = cpu_fp32_linears(model)
    assert len(linears) == 211 and all(m.compact is not None for m in linears)  # LM head too
    assert {m.compact[2].format for m in linears} == {"q4_1", "q8_0"}
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))  # [rows, hidden]
    for m in (linears[0], linears[6], model.lm_head):  # q_proj, down_proj, the tied head
        set_compact_max_rows([m], 4)
        width = m.weight.shape[1]
        x = hidden if width == 576 else torch.randn(3, width)
        with torch.no_grad():
            from_blocks = m(x)
            set_compact_max_rows([m], 0)
            set_native_max_rows([m], 4)
            assert torch.equal(from_blocks, m(x))


def half_layer(out_features: int, in_features: int, bias: bool, seed: int = 0) -> Linear:
    """A `Linear` of fp16-exact N(0, 1) weights, its fp16 copy attached."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen).half())
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    assert attach_half(torch.nn.Sequential(layer)) == 1
    return layer


def test_only_fp16_exact_weights_get_an_fp16_copy():
    exact = torch.randn(8, 64).half().float()
    assert torch.equal(half_of(exact).widen(), exact)
    inexact = exact.clone()
    inexact[2, 3] = 1.0 + 2.0 ** -12  # between two fp16 values
    assert half_of(inexact) is None
    assert half_of(exact[:, :48]) is None  # not a multiple of 32 inputs
    assert half_of(exact.double()) is None
    layer = Linear(64, 8, bias=False)
    with torch.no_grad():
        layer.weight.copy_(inexact)
    assert attach_half(torch.nn.Sequential(layer)) == 0 and layer.compact is None


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 5])
@pytest.mark.parametrize("bias", [False, True])
def test_the_fp16_form_has_rowdots_bits_on_the_widened_weight(num_rows, bias):
    layer = half_layer(37, 1152, bias)
    twin = Linear(1152, 37, bias=bias)
    twin.load_state_dict(layer.state_dict())
    set_native_max_rows([twin], 16)
    set_compact_max_rows([layer], 16)
    x = torch.randn(num_rows, 1152, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        assert torch.equal(layer(x), twin(x))


@pytest.fixture
def each_body():
    """Run a test under every kernel body this CPU has, back to its own choice after."""
    from speckv.models.common import _blockdot

    own = _blockdot.instruction_set()
    bodies = [b for b in ("baseline", "avx2", "avx512") if _blockdot.select_body(b)]
    yield bodies, _blockdot.select_body
    _blockdot.select_body(own)


@needs_kernel
def test_every_body_widens_every_finite_fp16_value_exactly(each_body):
    bodies, select = each_body
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    values = bits.view(torch.float16)
    finite = values[torch.isfinite(values)]  # 63,488 values: zeros, subnormals, normals
    weight = finite[: finite.numel() // 32 * 32].reshape(-1, 32)  # [1984, 32]
    compact = CompactWeight("f16", weight.contiguous())
    identity = torch.eye(32)  # row i picks input i: y[i, j] = W[j, i] + exact zeros
    for body in bodies:
        select(body)
        widened = compact.product(identity, None).t()
        assert torch.equal(widened, weight.float()), body


@needs_kernel
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_every_body_computes_the_product_from_blocks(each_body, fmt):
    bodies, select = each_body
    layer = block_layer(fmt, 40, 576, bias=True)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(8))
    plain = F.linear(x, layer.weight, layer.bias)
    set_compact_max_rows([layer], 8)
    for body in bodies:
        select(body)
        with torch.no_grad():
            # each body sums in its own vector width: fp32 rounding apart (~1e-6 relative)
            torch.testing.assert_close(layer(x), plain, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_the_built_in_eagle3_head_reads_its_fp16_weights():
    from speckv.drafters.resolve import load_drafter_model
    from speckv.models.common.small_rows import cpu_fp32_linears
    from speckv.models.llama.builtin import BuiltinModelMissingError
    from speckv.models.registry import load_model

    try:
        model, _ = load_model("builtin", "float32", "cpu", progress=False)
    except BuiltinModelMissingError:
        pytest.skip("the built-in model's package is not installed")
    drafter = load_drafter_model("builtin", model, "eagle3")
    own = [m for m in cpu_fp32_linears(drafter) if m.compact is not None
           and m.compact[2].format == "f16"]
    assert len(own) == 9  # fc, q, k, v, o, gate, up, down, its LM head
    head = own[-1]
    assert tuple(head.weight.shape) == (8192, 576)
    x = torch.randn(1, 576, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        rows = head.compact_max_rows
        set_compact_max_rows([head], 1)
        from_half = head(x)
        set_compact_max_rows([head], 0)
        set_native_max_rows([head], 1)
        assert torch.equal(from_half, head(x))
        set_compact_max_rows([head], rows)
