"""LLM: the user-facing API. `LLM(model=...)`, `generate(...)`, and `stream(...)` for deltas.

Owns loading a model (a name, an HF directory or a `.gguf` file through
`speckv.models.registry.load_model`, or an already-built model) onto the configured device
and dtype, and driving an `LLMEngine` until the given prompts finish. A bad prompt gets an
output with `finish_reason == "error"` and `error` set; the others finish.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from speckv.engine.engine_args import EngineArgs
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import RequestOutputKind, SamplingParams
from speckv.engine.speculative import load_configured_drafter
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.registry import load_model, random_init_note

__all__ = ["LLM", "load_model", "random_init_note"]

Prompt = str | Sequence[int]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(p, int) and not isinstance(p, bool) for p in items):
        return [items]  # one token-id prompt
    return items


def _final_only(params_list: list[SamplingParams]) -> list[SamplingParams]:
    """The same params asking for the final output only (one copy per distinct params)."""
    copies: dict[int, SamplingParams] = {}
    out = []
    for params in params_list:
        copy = copies.get(id(params))
        if copy is None:
            copy = copies[id(params)] = (
                params if params.output_kind is RequestOutputKind.FINAL_ONLY
                else dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY))
        out.append(copy)
    return out


class LLM:
    def __init__(
        self,
        model: str | Path | torch.nn.Module | None = None,
        tokenizer: Tokenizer | None = None,
        *,
        progress: bool = True,
        **engine_args: Any,
    ) -> None:
        config = EngineArgs(**engine_args).create_engine_config()
        if config.threads is not None:  # before loading: the loader measures its forms on them
            torch.set_num_threads(config.threads)
        if isinstance(model, torch.nn.Module):  # a TargetModel (speckv.models.base)
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
        """Run the prompts to completion; outputs in prompt order. Each request asks for its
        final output only (`RequestOutputKind.FINAL_ONLY`: its text decoded once, at the end),
        so an output's delta fields hold the whole output."""
        final: dict[str, RequestOutput] = {}
        order: list[str] = []
        for output in self._run(prompts, sampling_params, order, final_only=True):
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
        final_only: bool = False,
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
        if final_only:
            params_list = _final_only(params_list)
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
