"""Our paged Llama-family model reproduces transformers' logits (fp32) from the same weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from speckv.models.common.decoder import ModelOutput
from speckv.models.llama.loader import load_hf_dir
from tests.models.speckv_model_test_utils import TINY, widen_init

transformers = pytest.importorskip("transformers")


def _hf_model(arch: str, **kw: Any) -> Any:
    cfg_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }[arch]
    params = dict(TINY, tie_word_embeddings=False)
    params.update(kw)
    torch.manual_seed(0)
    model = model_cls(cfg_cls(**params)).eval()
    widen_init(model)
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model


def _compare(
    hf: Any, tmp_path: Path, run_prefill: Callable[..., ModelOutput], **save_kw: Any
) -> None:
    hf.save_pretrained(tmp_path, **save_kw)
    model, _ = load_hf_dir(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (37,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None], output_hidden_states=True)
    out = run_prefill(model, ids.tolist(), aux_layers=(0, 2))
    logits = model.compute_logits(out.hidden_states)
    assert logits.dtype == torch.float32
    assert ref.logits.std() > 0.5  # the comparison is not trivially near zero
    torch.testing.assert_close(logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    # aux layer i == output of decoder layer i == HF hidden_states[i + 1]
    torch.testing.assert_close(out.aux_hidden_states[0], ref.hidden_states[1][0], atol=1e-4, rtol=0)
    # the last layer's output is the pre-final-norm hidden state
    assert torch.equal(out.aux_hidden_states[1], out.prenorm_hidden)


@pytest.mark.parametrize(
    ("arch", "kw"),
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 32}),
    ],
)
def test_logits_match_transformers(
    arch: str, kw: dict[str, Any], tmp_path: Path, run_prefill: Callable[..., ModelOutput]
) -> None:
    _compare(_hf_model(arch, **kw), tmp_path, run_prefill)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ],
)
def test_rope_scaling_matches_transformers(
    rope: dict[str, Any], tmp_path: Path, run_prefill: Callable[..., ModelOutput]
) -> None:
    _compare(_hf_model("llama", rope_scaling=dict(rope)), tmp_path, run_prefill)


def test_sharded_safetensors(tmp_path: Path, run_prefill: Callable[..., ModelOutput]) -> None:
    _compare(_hf_model("qwen2"), tmp_path, run_prefill, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()


def test_refuses_pickles(tmp_path: Path) -> None:
    hf = _hf_model("llama")
    hf.config.to_json_file(tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never load"):
        load_hf_dir(tmp_path)
