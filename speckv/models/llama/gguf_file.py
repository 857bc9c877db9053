"""GGUF files -> (ModelConfig, HF-named fp32 tensors, tokenizer metadata).

Owns reading a llama.cpp GGUF with the `gguf` package: metadata -> `ModelConfig`, tensor names
`blk.{i}.attn_q.weight` -> `model.layers.{i}.self_attn.q_proj.weight`, dequantization (Q4_1,
Q8_0, ... via `gguf.quants.dequantize`) and undoing llama.cpp's rotary permutation of q/k for
Llama-arch files so the weights are in Hugging Face layout; and the Q4_1 / Q8_0 weights as the
file stores them (`CompactWeight`), for speckv's kernels that read them as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from speckv.models.common.compact_weight import CompactWeight
from speckv.models.common.config import ModelConfig
from speckv.models.common.model_files import reading

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def hf_name(gguf_name: str) -> str:
    """HF tensor name of a GGUF tensor name; ValueError for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf q/k permutation (HF rotate_half -> interleaved pairs)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama_cpp_unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of `llama_cpp_permute`: interleaved rotary pairs -> HF rotate_half layout."""
    return (
        w.reshape(num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def split_blocks(fmt: str, raw: np.ndarray, num_in: int) -> CompactWeight:
    """Raw GGUF rows [out, bytes] of `fmt` -> `CompactWeight` (scales fp16 -> fp32)."""
    num_out, num_blocks = raw.shape[0], num_in // 32
    if fmt == "q4_1":  # per block: d fp16, min fp16, 16 bytes of nibbles
        blocks = raw.reshape(num_out, num_blocks, 20)
        scales = np.ascontiguousarray(blocks[:, :, :4]).view(np.float16).astype(np.float32)
        q = np.ascontiguousarray(blocks[:, :, 4:]).reshape(num_out, num_blocks * 16)
    else:  # q8_0, per block: d fp16, 32 int8
        blocks = raw.reshape(num_out, num_blocks, 34)
        scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.float16)[..., 0]
        scales = scales.astype(np.float32)
        q = np.ascontiguousarray(blocks[:, :, 2:]).view(np.int8).reshape(num_out, num_in)
    return CompactWeight(fmt, torch.from_numpy(q), torch.from_numpy(scales))


@dataclass(frozen=True)
class GGUFTokenizerData:
    """The `tokenizer.*` metadata of a GGUF file."""

    model: str  # "gpt2" (byte-level BPE) is what we support
    pre: str | None
    tokens: list[str]
    merges: list[str]
    token_types: list[int]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None


class GGUFFile:
    """A parsed GGUF file (memory-mapped; tensors dequantized lazily on iteration)."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {self.path}")
        with reading(self.path, "GGUF file"):
            self.reader = GGUFReader(str(self.path))
            self.fields: dict[str, Any] = {}
            for key, f in self.reader.fields.items():
                if key.startswith("GGUF."):
                    continue
                self.fields[key] = f.contents()
        self.arch = str(self.fields.get("general.architecture", ""))
        if self.arch not in _SUPPORTED_ARCHS:
            raise ValueError(
                f"general.architecture {self.arch!r} is not supported "
                f"(supported: {_SUPPORTED_ARCHS})"
            )
        self._config: ModelConfig | None = None

    def _meta(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.arch}.{key}", default)

    def config(self) -> ModelConfig:
        """ModelConfig from `{arch}.*` metadata; vocab size from the token list (parsed once)."""
        if self._config is None:
            self._config = self._parse_config()
        return self._config

    def _parse_config(self) -> ModelConfig:
        names = {t.name for t in self.reader.tensors}
        tokens = self.fields.get("tokenizer.ggml.tokens")
        vocab_size = self._meta("vocab_size") or (len(tokens) if tokens else None)
        if vocab_size is None:
            embd = next(t for t in self.reader.tensors if t.name == "token_embd.weight")
            vocab_size = int(embd.shape[1])
        num_heads = int(self._meta("attention.head_count"))
        hidden = int(self._meta("embedding_length"))
        head_dim = self._meta("attention.key_length") or self._meta("rope.dimension_count")
        head_dim = int(head_dim) if head_dim else hidden // num_heads
        rope_dim = self._meta("rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise ValueError(f"{self.arch}.rope.dimension_count: partial rotary is not supported")
        if "rope_freqs.weight" in names:
            raise ValueError("rope_freqs.weight: GGUF llama3 rope factors are not supported yet")
        rope_scaling: dict[str, Any] | None = None
        scaling_type = self._meta("rope.scaling.type")
        if scaling_type in ("linear", "yarn"):
            rope_scaling = {
                "rope_type": scaling_type,
                "factor": float(self._meta("rope.scaling.factor")),
            }
            orig = self._meta("rope.scaling.original_context_length")
            if orig is not None:
                rope_scaling["original_max_position_embeddings"] = int(orig)
        elif scaling_type not in (None, "none"):
            raise ValueError(f"{self.arch}.rope.scaling.type {scaling_type!r} is not supported")
        eos = self.fields.get("tokenizer.ggml.eos_token_id")
        return ModelConfig(
            architecture=self.arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden,
            intermediate_size=int(self._meta("feed_forward_length")),
            num_hidden_layers=int(self._meta("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(self._meta("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rope_theta=float(self._meta("rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(self._meta("attention.layer_norm_rms_epsilon", 1e-6)),
            max_position_embeddings=int(self._meta("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            attention_output_bias="blk.0.attn_output.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            sliding_window=None,
            bos_token_id=self.fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            torch_dtype="float32",
        )

    @property
    def num_tensors(self) -> int:
        return len(self.reader.tensors)

    def tensors(
        self, on_tensor: Callable[[str], None] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (HF name, fp32 tensor in HF layout), dequantizing one tensor at a time."""
        from gguf.quants import dequantize

        config = self.config()
        for t in self.reader.tensors:
            if t.name == "output.weight" and config.tie_word_embeddings:
                continue
            name = hf_name(t.name)
            # ggml shapes are reversed (ne0 = innermost); numpy data is already row-major.
            shape = tuple(int(x) for x in reversed(t.shape))
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
            w = self._hf_rows(t.name, torch.from_numpy(arr.reshape(shape).copy()))
            if on_tensor is not None:
                on_tensor(name)
            yield name, w

    def _hf_rows(self, gguf_name: str, w: Any) -> Any:
        """`w` (a tensor or numpy array, rows as the file stores them, any trailing shape) with
        llama.cpp's q/k row permutation undone."""
        config = self.config()
        if self.arch == "llama" and gguf_name.endswith(("attn_q.weight", "attn_q.bias")):
            return llama_cpp_unpermute(w, config.num_attention_heads)
        if self.arch == "llama" and gguf_name.endswith(("attn_k.weight", "attn_k.bias")):
            return llama_cpp_unpermute(w, config.num_key_value_heads)
        return w

    def quantized_blocks(self) -> Iterator[tuple[str, CompactWeight]]:
        """(HF name, blocks in HF row order) of each 2-D Q4_1 or Q8_0 weight, as the file stores
        it: what `gguf.quants.dequantize` widens into the fp32 tensor `tensors` yields."""
        from gguf import GGMLQuantizationType

        formats = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}
        config = self.config()
        for t in self.reader.tensors:
            if (t.tensor_type not in formats or len(t.shape) != 2
                    or (t.name == "output.weight" and config.tie_word_embeddings)):
                continue
            num_in, num_out = int(t.shape[0]), int(t.shape[1])
            # rows of raw bytes permuted as the widened rows are (numpy has the same ops)
            raw = self._hf_rows(t.name, np.asarray(t.data).reshape(num_out, -1))
            yield hf_name(t.name), split_blocks(formats[t.tensor_type], raw, num_in)

    def tokenizer_data(self) -> GGUFTokenizerData:
        f = self.fields
        if "tokenizer.ggml.tokens" not in f:
            raise ValueError("tokenizer.ggml.tokens: the GGUF file has no tokenizer")
        return GGUFTokenizerData(
            model=str(f.get("tokenizer.ggml.model", "")),
            pre=f.get("tokenizer.ggml.pre"),
            tokens=list(f["tokenizer.ggml.tokens"]),
            merges=list(f.get("tokenizer.ggml.merges", [])),
            token_types=[int(x) for x in f.get("tokenizer.ggml.token_type", [])],
            bos_token_id=f.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=f.get("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(f.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=f.get("tokenizer.chat_template"),
        )
