"""Chunked prefill, mixed batches and decode through the paged cache equal one-shot prefill."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.models.common.config import ModelConfig
from speckv.models.common.decoder import ModelOutput
from speckv.models.llama.model import LlamaForCausalLM
from tests.models.speckv_model_test_utils import TINY, widen_init

BLOCK_SIZE = 4


def _model(**kw: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_config(ModelConfig(**{**TINY, **kw}))
    widen_init(model)
    return model


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, TINY["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


@pytest.mark.parametrize("chunks", [(10, 11, 12), (1, 32), (16, 16, 1)])
@pytest.mark.parametrize("kw", [{}, {"architecture": "qwen3", "qk_norm": True, "head_dim": 32}])
def test_chunked_prefill_equals_one_shot(
    chunks: tuple[int, ...], kw: dict[str, object], run_prefill: Callable[..., ModelOutput]
) -> None:
    model = _model(**kw)
    ids = _ids(sum(chunks), seed=2)
    ref = model.compute_logits(run_prefill(model, ids).hidden_states)
    table = [9, 2, 7, 4, 1, 8, 3, 5, 6]
    kv = model.make_kv_cache(num_blocks=10, block_size=BLOCK_SIZE)
    done = 0
    with torch.inference_mode():
        for n in chunks:
            md = AttentionMetadata.build([n], [done + n], [table], BLOCK_SIZE)
            out = model(torch.tensor(ids[done : done + n]), md.positions(), kv, md)
            logits = model.compute_logits(out.hidden_states)
            torch.testing.assert_close(logits, ref[done : done + n], atol=1e-4, rtol=1e-4)
            done += n


def test_mixed_batch_equals_separate_requests(run_prefill: Callable[..., ModelOutput]) -> None:
    """One forward holding a prefill chunk, two decodes and a 3-token verify, each request at a
    different context length, equals each request's own one-shot logits."""
    model = _model()
    lens = {"a": 20, "b": 9, "c": 14, "d": 6}
    ids = {r: _ids(n, seed=i) for i, (r, n) in enumerate(lens.items())}
    ref = {r: model.compute_logits(run_prefill(model, ids[r]).hidden_states) for r in lens}
    num_new = {"a": 7, "b": 1, "c": 3, "d": 1}
    tables = {"a": [1, 5, 9, 13, 17], "b": [2, 6, 10], "c": [3, 7, 11, 15], "d": [4, 8]}
    kv = model.make_kv_cache(num_blocks=18, block_size=BLOCK_SIZE)
    with torch.inference_mode():
        # Earlier steps: each request's context before its new tokens (also batched).
        old = {r: lens[r] - num_new[r] for r in lens}
        md = AttentionMetadata.build(
            [old[r] for r in lens], [old[r] for r in lens], [tables[r] for r in lens], BLOCK_SIZE
        )
        flat = [t for r in lens for t in ids[r][: old[r]]]
        model(torch.tensor(flat), md.positions(), kv, md)
        md = AttentionMetadata.build(
            [num_new[r] for r in lens],
            [lens[r] for r in lens],
            [tables[r] for r in lens],
            BLOCK_SIZE,
        )
        flat = [t for r in lens for t in ids[r][old[r] :]]
        logits = model.compute_logits(
            model(torch.tensor(flat), md.positions(), kv, md).hidden_states
        )
    start = 0
    for r in lens:
        got = logits[start : start + num_new[r]]
        torch.testing.assert_close(got, ref[r][old[r] :], atol=1e-4, rtol=1e-4)
        start += num_new[r]


def test_bf16_decode_tracks_fp32(run_prefill: Callable[..., ModelOutput]) -> None:
    model = _model()
    ids = _ids(24, seed=5)
    ref = model.compute_logits(run_prefill(model, ids).hidden_states)
    model_bf16 = model.to(torch.bfloat16)
    got = model_bf16.compute_logits(run_prefill(model_bf16, ids).hidden_states)
    assert got.dtype == torch.float32
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_sliding_window_model_runs_chunked(run_prefill: Callable[..., ModelOutput]) -> None:
    model = _model(
        sliding_window=5, layer_types=("sliding_attention", "full_attention", "sliding_attention")
    )
    ids = _ids(21, seed=9)
    ref = model.compute_logits(run_prefill(model, ids).hidden_states)
    kv = model.make_kv_cache(num_blocks=8, block_size=BLOCK_SIZE)
    table = [3, 1, 4, 7, 5, 2]
    with torch.inference_mode():
        md = AttentionMetadata.build([13], [13], [table], BLOCK_SIZE)
        model(torch.tensor(ids[:13]), md.positions(), kv, md)
        md = AttentionMetadata.build([8], [21], [table], BLOCK_SIZE)
        got = model.compute_logits(
            model(torch.tensor(ids[13:]), md.positions(), kv, md).hidden_states
        )
    torch.testing.assert_close(got, ref[13:], atol=1e-4, rtol=1e-4)


def test_aux_layers_validated(run_prefill: Callable[..., ModelOutput]) -> None:
    with pytest.raises(ValueError, match="aux_layers"):
        run_prefill(_model(), [1, 2, 3], aux_layers=(3,))


def test_random_init_is_deterministic() -> None:
    cfg = ModelConfig(**TINY)
    torch.manual_seed(3)
    a = LlamaForCausalLM.from_config(cfg)
    torch.manual_seed(3)
    b = LlamaForCausalLM.from_config(cfg)
    for (na, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), na
