"""`--vs-vllm`: vLLM's own request block hasher and KVCacheManager, run on the benches' inputs.

Owns everything the benches need from vLLM: importing it (it is never a dependency; without
it the benches print why and skip), building vLLM requests and managers for the same prompts,
block size and lookahead as speckv's, and the side-by-side timing loop. vLLM 0.33's
scheduler-side code runs on a CPU-only torch. To compare, in a scratch virtual environment:

    pip install torch==2.13.0 && pip install -e /path/to/speckv
    pip install --no-deps vllm==0.33.0     # --no-deps: its pins would pull a CUDA torch
    pip install --no-deps <the requirements the vllm wheel lists (`pip show vllm`, Requires),
                           except torch and the CUDA-only ones>

Both sides run in this one process, on identical token lists; the hash bench checks the two
hash chains are byte-identical before timing.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

SETUP_HINT = ("install vLLM 0.33 next to speckv in a scratch environment (the wheel with "
              "--no-deps beside torch 2.13 CPU) to compare side by side")


@dataclass(frozen=True)
class VllmModules:
    """The vLLM entry points the benches use."""

    version: str
    kv_cache_utils: Any  # vllm.v1.core.kv_cache_utils
    sha256: Callable[[Any], bytes]  # vllm.utils.hashing.sha256
    Request: Any  # vllm.v1.request.Request
    SamplingParams: Any
    KVCacheManager: Any  # vllm.v1.core.kv_cache_manager.KVCacheManager
    KVCacheConfig: Any
    KVCacheGroupSpec: Any
    FullAttentionSpec: Any
    torch: Any


def load_vllm() -> tuple[VllmModules | None, str]:
    """vLLM's modules, or None and the reason it cannot be used here."""
    try:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.request import Request
    except Exception as exc:  # ImportError, or a vLLM that fails to import on this machine
        return None, f"vllm is not importable here ({type(exc).__name__}: {exc})"
    modules = VllmModules(
        version=getattr(vllm, "__version__", "?"), kv_cache_utils=kv_cache_utils, sha256=sha256,
        Request=Request, SamplingParams=SamplingParams, KVCacheManager=KVCacheManager,
        KVCacheConfig=KVCacheConfig, KVCacheGroupSpec=KVCacheGroupSpec,
        FullAttentionSpec=FullAttentionSpec, torch=torch,
    )
    return modules, ""


def skip_message(reason: str) -> str:
    return f"--vs-vllm skipped: {reason}; {SETUP_HINT}."


def init_none_hash(vllm: VllmModules) -> str:
    """Set vLLM's NONE_HASH for sha256 and return the seed it used (speckv then uses it too,
    so block 0 has the same parent on both sides)."""
    utils = vllm.kv_cache_utils
    utils.init_none_hash(vllm.sha256)
    return utils.get_none_hash_seed()


def vllm_request(vllm: VllmModules, request_id: str, token_ids: list[int],
                 block_hasher: Callable | None = None) -> Any:
    return vllm.Request(request_id, token_ids, vllm.SamplingParams(max_tokens=4), None,
                        block_hasher=block_hasher)


def vllm_prompt_hasher(vllm: VllmModules, block_size: int, lookahead_tokens: int,
                       token_ids: list[int]) -> Callable[[], list[bytes]]:
    """One whole-prompt call of vLLM's request block hasher (a request with no hashes yet)."""
    hasher = vllm.kv_cache_utils.get_request_block_hasher(block_size, vllm.sha256,
                                                          lookahead_tokens)
    request = vllm_request(vllm, "bench", token_ids)  # no hasher: block_hashes stays empty
    return lambda: hasher(request)


def vllm_manager(vllm: VllmModules, block_size: int, num_blocks: int, max_model_len: int,
                 lookahead_tokens: int) -> Any:
    """vLLM's KVCacheManager with one full-attention group, prefix caching on."""
    spec = vllm.FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=64,
                                  dtype=vllm.torch.float16)
    config = vllm.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                kv_cache_groups=[vllm.KVCacheGroupSpec(["layer.0"], spec)])
    return vllm.KVCacheManager(
        config, max_model_len=max_model_len, scheduler_block_size=block_size,
        # vLLM's scheduler clears use_eagle when lookahead hashes are on (no block drop)
        hash_block_size=block_size, enable_caching=True, use_eagle=False,
        num_hash_lookahead_tokens=lookahead_tokens,
    )


def time_side_by_side(calls: dict[str, Callable[[], object]], rounds: int,
                      calls_per_round: int) -> dict[str, float]:
    """Median over rounds of each call's best time in that round, in ms. The order rotates
    every round, so drift and cache warmth are shared evenly. The cyclic garbage collector is
    off while timing (as `timeit` does): otherwise whichever side allocates more containers
    also pays for collections of everything else in the process (torch, vLLM)."""
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    was_enabled = gc.isenabled()
    try:
        for round_index in range(rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                gc.disable()
                best = float("inf")
                for _ in range(calls_per_round):
                    begin = time.perf_counter()
                    calls[name]()
                    best = min(best, time.perf_counter() - begin)
                gc.enable()
                samples[name].append(best)
    finally:
        if not was_enabled:
            gc.disable()
    return {name: 1e3 * statistics.median(values) for name, values in samples.items()}


def ratio(peer_ms: float, ours_ms: float) -> float:
    return peer_ms / ours_ms if ours_ms > 0 else float("inf")


def same_hashes(ours: Sequence[bytes], theirs: Sequence[bytes]) -> bool:
    return len(ours) == len(theirs) and all(bytes(a) == bytes(b) for a, b in zip(ours, theirs))
