"""speckv's kernel over a GGUF checkpoint's blocks behind `Linear`: the blocks widen to what
`gguf` dequantizes; the products have `rowdot`'s bits on the widened weight, for any row count
and bias, whatever else is in the batch; blocks attach only where they widen to the loaded
weight exactly, and step aside once the weight changes; the row limit follows the measurement;
on the built-in model every projection gets its blocks and a decode forward keeps its bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from speckv.models.common.block_linear import (
    attach_blocks,
    block_max_rows_of,
    blockdot_instruction_set,
    choose_block_max_rows,
    set_block_max_rows,
    use_blocks_where_faster,
)
from speckv.models.common.layers import Linear
from speckv.models.common.native_linear import set_native_max_rows
from speckv.models.common.quantized_blocks import QuantizedBlocks
from speckv.models.llama.gguf_file import split_blocks

needs_kernel = pytest.mark.skipif(blockdot_instruction_set() is None,
                                  reason="speckv was built without its block kernel")
GGML_TYPES = {"q4_1": GGMLQuantizationType.Q4_1, "q8_0": GGMLQuantizationType.Q8_0}


def file_blocks(fmt: str, out_features: int, in_features: int, seed: int
                ) -> tuple[np.ndarray, QuantizedBlocks]:
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
        layer.weight.copy_(blocks.dequantize())
        if bias:
            gen = torch.Generator().manual_seed(seed)
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    model = torch.nn.Sequential(layer)
    assert attach_blocks(model, [("0.weight", blocks)], lambda name: name) == 1
    return layer


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_the_blocks_widen_to_what_gguf_dequantizes(fmt):
    raw, blocks = file_blocks(fmt, 37, 96, seed=3)
    expected = dequantize(raw, GGML_TYPES[fmt]).reshape(37, 96)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


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
    set_block_max_rows([layer], 16)
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
    set_block_max_rows([layer], 8)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        batch = layer(x)
        for i in range(7):
            assert torch.equal(layer(x[i:i + 1]), batch[i:i + 1])


@needs_kernel
def test_beyond_the_row_limit_or_after_an_edit_the_fp32_weight_computes_it():
    layer = block_layer("q8_0", 160, 96, bias=True)
    set_block_max_rows([layer], 2)
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
        held.weight.copy_(blocks.dequantize())
        other.weight.copy_(blocks.dequantize())
        other.weight[3, 5] = torch.nextafter(other.weight[3, 5], torch.tensor(1e9))  # one ulp
    model = torch.nn.ModuleDict({"held": held, "other": other})
    attached = attach_blocks(model, [("held.weight", blocks), ("other.weight", blocks),
                                     ("absent.weight", blocks)], lambda name: name)
    assert attached == (1 if blockdot_instruction_set() else 0)
    assert other.blocks is None
    with pytest.raises(ValueError, match="without blocks"):
        set_block_max_rows([other], 2)


def test_a_tied_head_shares_its_embeddings_blocks():
    _, blocks = file_blocks("q8_0", 40, 32, seed=5)
    embed, head = torch.nn.Embedding(40, 32), Linear(32, 40, bias=False)
    with torch.no_grad():
        embed.weight.copy_(blocks.dequantize())
    head.weight = embed.weight
    model = torch.nn.ModuleDict({"embed": embed, "head": head})
    attached = attach_blocks(model, [("embed.weight", blocks)], lambda name: name)
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
        QuantizedBlocks("q4_1", q, scales)
    with pytest.raises(ValueError, match="not q4_1 or q8_0"):
        QuantizedBlocks("q5_k", torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, 2))


def test_the_row_limit_follows_the_measurement():
    #                rows: (other forms s, blocks s)
    timings = {1: (2.0, 1.0), 2: (2.0, 1.2), 3: (2.0, 1.9), 4: (2.0, 1.0)}
    assert choose_block_max_rows(timings) == 2  # 3 did not clearly win: stop there
    assert choose_block_max_rows({1: (1.0, 0.95)}) == 0


def test_a_model_without_blocks_or_in_the_cache_keeps_the_fp32_forms():
    assert use_blocks_where_faster(torch.nn.Sequential(Linear(64, 64, bias=False))) == 0
    small = torch.nn.Sequential(block_layer("q4_1", 64, 64, bias=False)) \
        if blockdot_instruction_set() else torch.nn.Sequential(Linear(64, 64))
    assert use_blocks_where_faster(small) == 0  # far below the streamed size
    assert block_max_rows_of(small) == 0


@needs_kernel
def test_the_built_in_model_decodes_from_its_blocks_with_the_fp32_kernels_bits():
    from speckv.models.common.small_rows import cpu_fp32_linears
    from speckv.models.llama.builtin import BuiltinModelMissingError, load_builtin_model

    try:
        model, _, _ = load_builtin_model(progress=False)
    except BuiltinModelMissingError:
        pytest.skip("the built-in model's package is not installed")
    linears = cpu_fp32_linears(model)
    assert len(linears) == 211 and all(m.blocks is not None for m in linears)  # LM head too
    assert {m.blocks[2].format for m in linears} == {"q4_1", "q8_0"}
    hidden = torch.randn(3, 576, generator=torch.Generator().manual_seed(6))  # [rows, hidden]
    for m in (linears[0], linears[6], model.lm_head):  # q_proj, down_proj, the tied head
        set_block_max_rows([m], 4)
        width = m.weight.shape[1]
        x = hidden if width == 576 else torch.randn(3, width)
        with torch.no_grad():
            from_blocks = m(x)
            set_block_max_rows([m], 0)
            set_native_max_rows([m], 4)
            assert torch.equal(from_blocks, m(x))
