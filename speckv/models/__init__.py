"""Llama-family target models, their configs and loaders (HF safetensors dirs, GGUF files)."""

from speckv.models.config import ModelConfig
from speckv.models.llama import LlamaDecoderLayer, LlamaForCausalLM, ModelOutput
from speckv.models.loader import build_model, load_gguf, load_hf_dir, load_hf_tokenizer, save_hf_dir
from speckv.models.tokenizer import Tokenizer

__all__ = [
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelOutput",
    "Tokenizer",
    "build_model",
    "load_gguf",
    "load_hf_dir",
    "load_hf_tokenizer",
    "save_hf_dir",
]
