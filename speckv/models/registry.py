"""Loading a target model by name or path: the one entry point, and the tables behind it.

    BUILTIN_MODELS   name -> loader:  "builtin" (SmolLM2-135M-Instruct, also `None`),
                     "hybrid-swa" (tiny random-init Gemma 3-style), "hybrid-gdn" (small
                     random-init Qwen3-Next-style GDN hybrid)
    FAMILIES         an HF directory's config.json -> its family's loader, first match wins:
                     GDN hybrid (Qwen3-Next / Qwen3.5), Gemma 3 / 4, Llama (the rest)
    a `.gguf` file   the Llama family's GGUF loader

Loaders import their family lazily: naming one model never imports another family's code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speckv.models.base import TargetModel
from speckv.models.common.tokenizer import Tokenizer

Loaded = tuple[TargetModel, Tokenizer | None]


@dataclass(frozen=True)
class BuiltinModel:
    """A model known by name (`--model NAME`)."""

    load: Callable[[str, Any, bool], Loaded]  # (dtype, device, progress) -> (model, tokenizer)
    random_init_note: Callable[[], str] | None = None  # what to tell users of random weights


@dataclass(frozen=True)
class ModelFamily:
    """A family an HF directory can hold, known by its config.json."""

    name: str
    matches: Callable[[Mapping[str, Any]], bool]
    load_dir: Callable[[Path, str, Any], Loaded]  # (dir, dtype, device) -> (model, tokenizer)


def _builtin(dtype: str, device: Any, progress: bool) -> Loaded:
    from speckv.models.llama.builtin import load_builtin_model

    model, tokenizer, _ = load_builtin_model(dtype, device, progress=progress)
    return model, tokenizer


def _hybrid_swa(dtype: str, device: Any, progress: bool) -> Loaded:
    from speckv.models.gemma.hybrid_swa import load_hybrid_swa

    return load_hybrid_swa(dtype, device, progress)


def _hybrid_gdn(dtype: str, device: Any, progress: bool) -> Loaded:
    from speckv.models.hybrid.hybrid_gdn import load_hybrid_gdn

    return load_hybrid_gdn(dtype, device, progress)


def _hybrid_swa_note() -> str:
    from speckv.models.gemma.hybrid_swa import RANDOM_INIT_NOTE

    return RANDOM_INIT_NOTE


def _hybrid_gdn_note() -> str:
    from speckv.models.hybrid.hybrid_gdn import RANDOM_INIT_NOTE

    return RANDOM_INIT_NOTE


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "builtin": BuiltinModel(_builtin),
    "hybrid-swa": BuiltinModel(_hybrid_swa, _hybrid_swa_note),
    "hybrid-gdn": BuiltinModel(_hybrid_gdn, _hybrid_gdn_note),
}


def _is_gdn(config: Mapping[str, Any]) -> bool:
    from speckv.models.hybrid.config import is_hybrid_hf_config

    return is_hybrid_hf_config(config)


def _load_gdn(path: Path, dtype: str, device: Any) -> Loaded:
    from speckv.models.common.weights import load_hf_tokenizer
    from speckv.models.hybrid.loader import load_hybrid_dir

    model, config = load_hybrid_dir(path, dtype, device)
    return model, load_hf_tokenizer(path, config)


def _is_gemma(config: Mapping[str, Any]) -> bool:
    from speckv.models.gemma.gemma3 import is_gemma_config

    return is_gemma_config(config)


def _load_gemma(path: Path, dtype: str, device: Any) -> Loaded:
    from speckv.models.common.weights import load_hf_tokenizer
    from speckv.models.gemma.loader import load_gemma_dir

    model = load_gemma_dir(path, dtype, device)
    return model, load_hf_tokenizer(path, model.config)


def _load_llama(path: Path, dtype: str, device: Any) -> Loaded:
    from speckv.models.common.weights import load_hf_tokenizer
    from speckv.models.llama.loader import load_hf_dir

    model, config = load_hf_dir(path, dtype, device)
    return model, load_hf_tokenizer(path, config)


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("gdn-hybrid", _is_gdn, _load_gdn),
    ModelFamily("gemma", _is_gemma, _load_gemma),
    ModelFamily("llama", lambda _config: True, _load_llama),  # its loader names what it refuses
)


def family_of(path: Path) -> ModelFamily:
    """The family of an HF directory (by its config.json; none: the Llama loader, which says
    that config.json is missing)."""
    from speckv.models.common.model_files import read_json_file

    config_path = path / "config.json"
    config = read_json_file(config_path) if config_path.is_file() else {}
    return next(family for family in FAMILIES if family.matches(config))


def load_model(model: str | Path | None, dtype: str, device: Any, progress: bool = True
               ) -> Loaded:
    """(model, tokenizer) for a name in BUILTIN_MODELS (None: "builtin"), an HF model directory
    or a .gguf file, in `dtype` on `device`, its few-row CPU matmuls in the form this machine
    computes fastest (`speckv.models.common.small_rows`), its projections through oneDNN with
    packed weights where that measured faster (`speckv.models.common.packed_linear`), and its
    products of few enough rows through speckv's own kernel where that measured faster still
    (`speckv.models.common.native_linear`), on panel-packed weights for the batch sizes where
    those measured faster (`speckv.models.common.panel_linear`), and from the weights as the
    checkpoint holds them (a GGUF's blocks, fp16) for the fewest rows where that measured
    faster again (`speckv.models.common.compact_linear`)."""
    from speckv.models.common.compact_linear import attach_half, use_compact_where_faster
    from speckv.models.common.native_linear import use_native_where_faster
    from speckv.models.common.packed_linear import use_packed_weights_where_faster
    from speckv.models.common.panel_linear import use_panels_where_faster
    from speckv.models.common.small_rows import use_fastest_small_row_form

    loaded, tokenizer = _load(model, dtype, device, progress)
    use_fastest_small_row_form(loaded)
    use_packed_weights_where_faster(loaded)
    use_native_where_faster(loaded)
    use_panels_where_faster(loaded)
    attach_half(loaded)  # an fp16 checkpoint run in fp32 (a GGUF's blocks came with the load)
    use_compact_where_faster(loaded)
    return loaded, tokenizer


def _load(model: str | Path | None, dtype: str, device: Any, progress: bool) -> Loaded:
    name = "builtin" if model is None else str(model)
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name].load(dtype, device, progress)
    path = Path(name)
    if path.is_dir():
        return family_of(path).load_dir(path, dtype, device)
    if path.is_file() and path.suffix == ".gguf":
        from speckv.models.llama.loader import load_gguf

        loaded, _, tokenizer = load_gguf(path, dtype, device)
        return loaded, tokenizer
    raise FileNotFoundError(
        f"model {name!r}: not 'builtin', an HF model directory or a .gguf file"
    )


def random_init_note(model: str | Path | None) -> str | None:
    """What to tell a user of a named model with random weights (None for other models)."""
    entry = BUILTIN_MODELS.get(str(model))
    if entry is None or entry.random_init_note is None:
        return None
    return entry.random_init_note()
