"""GGUF loading: metadata -> config, dequantization, q/k un-permutation, tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from speckv.models.common.decoder import ModelOutput
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.llama.loader import load_gguf
from speckv.models.llama.model import LlamaForCausalLM
from speckv.models.llama.tiny import tiny_model_config
from tests.models.speckv_model_test_utils import widen_init

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. 12345 and 67890!",
    "Paris is the capital of France; Berlin is the capital of Germany.",
    "def f(x):\n    return x * 2  # code with    spaces\n",
] * 20


def _train_tokenizer() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(ours: str) -> str:
    top = {
        "embed_tokens.weight": "token_embd.weight",
        "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if ours in top:
        return top[ours]
    _, i, rest = ours.split(".", 2)
    mod, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_GGUF_NAMES[mod]}.{kind}"


def _write_gguf(
    path: Path, model: LlamaForCausalLM, tok: HFTokenizer, quant: gguf.GGMLQuantizationType | None
) -> None:
    c = model.config
    arch = c.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    types = [3 if t in SPECIALS else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template(TEMPLATE)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy().copy()
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = _permute(arr, c.num_attention_heads, c.num_attention_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = _permute(arr, c.num_attention_heads, c.num_key_value_heads)
        if quant is not None and arr.ndim == 2:
            q = gguf.quants.quantize(arr, quant)
            w.add_tensor(_gguf_name(name), q, raw_shape=q.shape, raw_dtype=quant)
        else:
            w.add_tensor(_gguf_name(name), arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny(arch: str, vocab_size: int, **kw: Any) -> LlamaForCausalLM:
    cfg = tiny_model_config(
        architecture=arch,
        vocab_size=vocab_size,
        intermediate_size=96,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        attention_bias=arch == "qwen2",
        tie_word_embeddings=True,
        **kw,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM.from_config(cfg)
    widen_init(model)
    return model


@pytest.fixture(scope="module")
def trained_tokenizer() -> HFTokenizer:
    return _train_tokenizer()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_f32_gguf_logits_match(
    arch: str,
    tmp_path: Path,
    trained_tokenizer: HFTokenizer,
    run_prefill: Callable[..., ModelOutput],
) -> None:
    vocab = trained_tokenizer.get_vocab_size()
    original = _tiny(arch, vocab)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, original, trained_tokenizer, quant=None)
    loaded, config, tok = load_gguf(path)
    assert config.architecture == arch and config.tie_word_embeddings
    assert config.num_key_value_heads == 2 and config.vocab_size == vocab
    assert tok is not None and config.eos_token_ids == tok.eos_token_ids
    ids = list(range(5, 40))
    ref = original.compute_logits(run_prefill(original, ids).hidden_states)
    got = loaded.compute_logits(run_prefill(loaded, ids).hidden_states)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_q8_0_gguf_dequantizes_close(
    tmp_path: Path, trained_tokenizer: HFTokenizer, run_prefill: Callable[..., ModelOutput]
) -> None:
    original = _tiny("llama", trained_tokenizer.get_vocab_size())
    path = tmp_path / "tiny-q8.gguf"
    _write_gguf(path, original, trained_tokenizer, quant=gguf.GGMLQuantizationType.Q8_0)
    loaded, _, _ = load_gguf(path)
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        # Q8_0: 32-value blocks, int8 with one fp16 scale -> error <= max|block| / 254
        torch.testing.assert_close(b, a, atol=float(a.abs().max()) / 200 + 1e-6, rtol=0, msg=name)
    ids = list(range(3, 30))
    ref = original.compute_logits(run_prefill(original, ids).hidden_states)
    got = loaded.compute_logits(run_prefill(loaded, ids).hidden_states)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_gguf_tokenizer_matches_source(tmp_path: Path, trained_tokenizer: HFTokenizer) -> None:
    original = _tiny("llama", trained_tokenizer.get_vocab_size())
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, original, trained_tokenizer, quant=None)
    _, _, tok = load_gguf(path)
    assert tok is not None
    texts = [*CORPUS[:3], "unseen wörds ünïcode 🙂 and  double  spaces\n\n", ""]
    for text in texts:
        assert tok.encode(text) == trained_tokenizer.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == trained_tokenizer.token_to_id("<|im_start|>")
    assert tok.vocab_size == trained_tokenizer.get_vocab_size()
    # save / reload through tokenizer.json + sidecar
    tok.save(tmp_path / "tok")
    again = Tokenizer.from_dir(tmp_path / "tok")
    assert again.encode(prompt) == tok.encode(prompt)
    assert again.eos_token_ids == tok.eos_token_ids and again.chat_template == TEMPLATE


def test_unpermute_inverts_llama_cpp_permute() -> None:
    from speckv.models.llama.gguf_file import llama_cpp_permute, llama_cpp_unpermute

    w = np.arange(8 * 4 * 3, dtype=np.float32).reshape(8 * 4, 3)
    permuted = torch.from_numpy(_permute(w, 8, 4))
    assert torch.equal(llama_cpp_unpermute(permuted, 4), torch.from_numpy(w))
    assert torch.equal(llama_cpp_permute(torch.from_numpy(w), 4), permuted)


def test_rejects_unknown_arch(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gptneox")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general\.architecture"):
        load_gguf(tmp_path / "x.gguf")
