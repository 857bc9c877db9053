"""Target models: the seam every family implements (`base.TargetModel`), loading by name or
path (`registry.load_model`), one subpackage per family (llama/, gemma/, hybrid/) and what
they share (common/). This package exports the Llama family's names for convenience."""

from speckv.models.base import TargetModel
from speckv.models.common.config import ModelConfig
from speckv.models.common.decoder import ModelOutput
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.common.weights import load_hf_tokenizer
from speckv.models.llama.loader import (
    build_model,
    load_gguf,
    load_hf_dir,
    save_hf_dir,
)
from speckv.models.llama.model import LlamaDecoderLayer, LlamaForCausalLM

__all__ = [
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "ModelConfig",
    "ModelOutput",
    "TargetModel",
    "Tokenizer",
    "build_model",
    "load_gguf",
    "load_hf_dir",
    "load_hf_tokenizer",
    "save_hf_dir",
]
