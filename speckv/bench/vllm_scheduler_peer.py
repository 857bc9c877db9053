"""vLLM 0.33's `Scheduler` driven on CPU, for `speckv bench step-overhead`.

Owns building vLLM's real v1 scheduler (`Scheduler.schedule` + `update_from_output`, its
`KVCacheManager` with prefix caching, its request block hasher) from a small `VllmConfig`
the way vLLM's own `tests/v1/core` utilities do, and driving it with a fake model runner
that samples one token per request (and, with drafts, proposes `num_spec_tokens` drafts that
are all rejected). vLLM is never a dependency: without it `load` says why and the bench skips
its column. Its model config needs an HF `config.json`; a one-layer Llama shape is written to a
temporary directory (no download, no weights, no tokenizer).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PeerStepTimes:
    """One step of vLLM's scheduler, seconds."""

    schedule_s: float
    update_s: float  # update_from_output + update_draft_token_ids
    num_sampled: int  # requests that sampled in the step


class VllmSchedulerPeer:
    """vLLM's Scheduler over `requests` (token-id prompts), stepped with a fake runner."""

    def __init__(self, modules: dict[str, Any], prompts: Sequence[list[int]], *,
                 block_size: int, num_blocks: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, num_spec_tokens: int,
                 max_tokens: int, vocab_size: int,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        m = modules
        self._m = m
        self._dir = tempfile.TemporaryDirectory(prefix="speckv-vllm-peer-")
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": max_model_len, "torch_dtype": "float32",
            "eos_token_id": 2, "bos_token_id": 1,
        }
        with open(os.path.join(self._dir.name, "config.json"), "w") as f:
            json.dump(config, f)
        model_config = m["ModelConfig"](
            model=self._dir.name, tokenizer=self._dir.name, skip_tokenizer_init=True,
            dtype="float32", max_model_len=max_model_len, seed=0)
        scheduler_config = m["SchedulerConfig"](
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, is_encoder_decoder=False)
        cache_config = m["CacheConfig"](block_size=block_size, gpu_memory_utilization=0.9,
                                        cache_dtype="auto", enable_prefix_caching=True)
        cache_config.num_gpu_blocks = num_blocks
        # the ngram method needs no draft model; the scheduler only sees num_spec_tokens
        spec = (m["SpeculativeConfig"](model="ngram", num_speculative_tokens=num_spec_tokens)
                if num_spec_tokens else None)
        vllm_config = m["VllmConfig"](
            scheduler_config=scheduler_config, model_config=model_config,
            cache_config=cache_config, device_config=m["DeviceConfig"](device="cpu"),
            speculative_config=spec)
        torch = m["torch"]
        kv_config = m["KVCacheConfig"](
            num_blocks=num_blocks, kv_cache_tensors=[],
            kv_cache_groups=[m["KVCacheGroupSpec"](["layer.0"], m["FullAttentionSpec"](
                block_size=block_size, num_kv_heads=2, head_size=16, dtype=torch.float32))])
        self.scheduler = m["Scheduler"](
            vllm_config=vllm_config, kv_cache_config=kv_config, log_stats=True,
            structured_output_manager=m["StructuredOutputManager"](vllm_config),
            block_size=block_size)
        m["init_none_hash"](m["sha256"])
        self._hasher = m["get_request_block_hasher"](block_size, m["sha256"])
        self.num_spec_tokens = num_spec_tokens
        self._clock = clock
        self.max_tokens = max_tokens
        self._counter = 0
        for prompt in prompts:
            self.add(prompt)

    def add(self, prompt: list[int], max_tokens: int | None = None) -> None:
        params = self._m["SamplingParams"](max_tokens=max_tokens or self.max_tokens,
                                           ignore_eos=True)
        self.scheduler.add_request(self._m["Request"](
            f"vllm-{self._counter}", list(prompt), params, None, block_hasher=self._hasher))
        self._counter += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> PeerStepTimes:
        """One schedule + update; the fake runner's work between them is not timed."""
        scheduler = self.scheduler
        clock = self._clock
        begin = clock()
        output = scheduler.schedule()
        scheduled = clock()
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for request_id in ids:
            request = scheduler.requests[request_id]
            # a request samples once its scheduled tokens reach its last real token
            sampled.append([5] if request.num_computed_tokens >= request.num_tokens else [])
        runner_output = self._m["ModelRunnerOutput"](
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled)
        drafted = [r for r, s in zip(ids, sampled) if s]
        drafts = [[7] * self.num_spec_tokens for _ in drafted]
        updating = clock()
        scheduler.update_from_output(output, runner_output)
        if self.num_spec_tokens:
            scheduler.update_draft_token_ids(self._m["DraftTokenIds"](drafted, drafts))
        end = clock()
        return PeerStepTimes(scheduled - begin, end - updating, len(drafted))

    def in_decode(self, batch_size: int) -> bool:
        """Every one of `batch_size` running requests is past its prefill."""
        scheduler = self.scheduler
        running = scheduler.running
        return (len(running) == batch_size and not scheduler.waiting
                and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running))

    def close(self) -> None:
        self._dir.cleanup()


def load() -> tuple[dict[str, Any] | None, str]:
    """vLLM's scheduler modules, or None and why they cannot be used here."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model config is a local directory
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import torch
        import vllm
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            ModelConfig,
            SchedulerConfig,
            SpeculativeConfig,
            VllmConfig,
        )
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager
    except Exception as exc:  # ImportError, or a vLLM that fails to import on this machine
        return None, f"vllm is not importable here ({type(exc).__name__}: {exc})"
    modules = dict(
        version=getattr(vllm, "__version__", "?"), torch=torch, CacheConfig=CacheConfig,
        DeviceConfig=DeviceConfig, ModelConfig=ModelConfig, SchedulerConfig=SchedulerConfig,
        SpeculativeConfig=SpeculativeConfig, VllmConfig=VllmConfig,
        SamplingParams=SamplingParams, sha256=sha256,
        get_request_block_hasher=get_request_block_hasher, init_none_hash=init_none_hash,
        Scheduler=Scheduler, FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, DraftTokenIds=DraftTokenIds,
        ModelRunnerOutput=ModelRunnerOutput, Request=Request,
        StructuredOutputManager=StructuredOutputManager,
    )
    return modules, ""
