"""LLM: the user-facing API. `LLM(model=...)`, `generate(...)`, and `stream(...)` for deltas.

Owns loading a model by name (None / "builtin": the built-in SmolLM2-135M-Instruct;
"hybrid-swa": a tiny random-init Gemma 3-style sliding-window model; "hybrid-gdn": a small
random-init Qwen3-Next-style Gated DeltaNet hybrid; a directory: an HF safetensors dir
(Llama family, Gemma 3 or 4 text, Qwen3-Next / Qwen3.5 text); a `.gguf` file; or an
already-built model) onto the configured device and dtype, and driving an `LLMEngine` until
the given prompts finish. A bad prompt gets an output with `finish_reason == "error"` and
`error` set; the others finish.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from speckv.engine.config import EngineConfig
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import load_configured_drafter
from speckv.models.llama import LlamaForCausalLM
from speckv.models.tokenizer import Tokenizer

Prompt = str | Sequence[int]


def load_model(
    model: str | Path | None, dtype: str, device: Any, progress: bool = True
) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """(model, tokenizer) for a model name: None / "builtin", an HF dir or a .gguf file."""
    if model is None or str(model) == "builtin":
        from speckv.models.builtin import load_builtin_model

        loaded, tokenizer, _ = load_builtin_model(dtype, device, progress=progress)
        return loaded, tokenizer
    if str(model) == "hybrid-swa":
        from speckv.models.hybrid_swa import load_hybrid_swa

        return load_hybrid_swa(dtype, device, progress)  # type: ignore[return-value]
    if str(model) == "hybrid-gdn":
        from speckv.models.hybrid_gdn import load_hybrid_gdn

        return load_hybrid_gdn(dtype, device, progress)  # type: ignore[return-value]
    path = Path(model)
    if path.is_dir() and _hf_config_is(path, "hybrid"):
        from speckv.models.hybrid_loader import load_hybrid_dir
        from speckv.models.loader import load_hf_tokenizer

        gdn, gdn_config = load_hybrid_dir(path, dtype, device)
        return gdn, load_hf_tokenizer(path, gdn_config)  # type: ignore[return-value,arg-type]
    if path.is_dir() and _is_gemma_dir(path):
        from speckv.models.gemma_loader import load_gemma_dir
        from speckv.models.loader import load_hf_tokenizer

        gemma = load_gemma_dir(path, dtype, device)
        return gemma, load_hf_tokenizer(path, gemma.config)  # type: ignore[return-value]
    if path.is_dir():
        from speckv.models.loader import load_hf_dir, load_hf_tokenizer

        loaded, config = load_hf_dir(path, dtype, device)
        return loaded, load_hf_tokenizer(path, config)
    if path.is_file() and path.suffix == ".gguf":
        from speckv.models.loader import load_gguf

        loaded, _, tokenizer = load_gguf(path, dtype, device)
        return loaded, tokenizer
    raise FileNotFoundError(
        f"model {str(model)!r}: not 'builtin', an HF model directory or a .gguf file"
    )


def random_init_note(model: str | Path | None) -> str | None:
    """What to tell a user of a built-in model with random weights (None for other models)."""
    if str(model) == "hybrid-swa":
        from speckv.models.hybrid_swa import RANDOM_INIT_NOTE

        return RANDOM_INIT_NOTE
    if str(model) == "hybrid-gdn":
        from speckv.models.hybrid_gdn import RANDOM_INIT_NOTE

        return RANDOM_INIT_NOTE
    return None


def _hf_config_is(path: Path, family: str) -> bool:
    """Whether the HF dir's config.json is of a family ("hybrid": Qwen3-Next / Qwen3.5)."""
    from speckv.models.hybrid_config import is_hybrid_hf_config
    from speckv.models.model_files import read_json_file

    config = path / "config.json"
    return config.is_file() and is_hybrid_hf_config(read_json_file(config))


def _is_gemma_dir(path: Path) -> bool:
    from speckv.models.gemma import is_gemma_config
    from speckv.models.model_files import read_json_file

    config = path / "config.json"
    return config.is_file() and is_gemma_config(read_json_file(config))


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [items]  # one token-id prompt
    return items


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        config = EngineConfig(**engine_args)
        if isinstance(model, torch.nn.Module):  # LlamaForCausalLM, GemmaForCausalLM
            loaded = model
        else:
            loaded, loaded_tokenizer = load_model(
                model, config.resolved_dtype(), config.resolved_device(), progress
            )
            tokenizer = tokenizer or loaded_tokenizer
        self.tokenizer = tokenizer
        drafter = load_configured_drafter(config, loaded)
        self.engine = LLMEngine(loaded, config, tokenizer, drafter=drafter)
        self._request_ids = itertools.count()
        # as vLLM after start-up: what exists now (modules, tokenizer, engine tables) lives as
        # long as the engine; frozen out of the cyclic collector's generations, a full
        # collection during a step no longer walks it (~40 ms per collection otherwise)
        gc.collect()
        gc.freeze()

    def reset_prefix_cache(self, reset_connector: bool = False) -> bool:
        """Forget the local prefix cache; with `reset_connector`, the KV connector's tiers too
        (a disk tier's files included). False while requests hold blocks."""
        return self.engine.reset_prefix_cache(reset_connector)

    def close(self) -> None:
        """Settle the KV tiers' pending stores and stop them (a disk tier then holds everything
        this engine stored). Idempotent; the LLM cannot generate afterwards."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def chat_prompt(self, user_text: str) -> str:
        """`user_text` wrapped in the model's chat template (the text itself without one)."""
        if self.tokenizer is None or not self.tokenizer.chat_template:
            return user_text
        return self.tokenizer.apply_chat_template([{"role": "user", "content": user_text}])

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order."""
        final: dict[str, RequestOutput] = {}
        order: list[str] = []
        for output in self._run(prompts, sampling_params, order):
            if output.finished:
                final[output.request_id] = output
        return [final[request_id] for request_id in order]

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[RequestOutput]:
        """Outputs as they come: one per request per step with its new tokens (`delta_*`)."""
        yield from self._run(prompts, sampling_params, [])

    def _run(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        order: list[str],
    ) -> Iterator[RequestOutput]:
        items = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(
                    f"sampling_params: {len(params_list)} given for {len(items)} prompts"
                )
        engine = self.engine
        pending: set[str] = set()
        errors: list[RequestOutput] = []
        for prompt, params in zip(items, params_list):
            request_id = f"llm-{id(self):x}-{next(self._request_ids)}"
            order.append(request_id)
            try:
                engine.add_request(prompt, params, request_id)
                pending.add(request_id)
            except ValueError as error:
                token_ids = [] if isinstance(prompt, str) else list(prompt)
                errors.append(
                    RequestOutput(request_id, token_ids, [], "", [], "", 0, None, "error",
                                  error=str(error))
                )
        yield from errors
        while pending:
            for output in engine.step():
                if output.request_id in pending:
                    if output.finished:
                        pending.discard(output.request_id)
                    yield output
            if pending and not engine.has_unfinished_requests():
                raise RuntimeError(f"requests vanished from the engine: {sorted(pending)}")
