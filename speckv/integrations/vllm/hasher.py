"""The request block hasher the plugin gives vLLM's engine: speckv's lookahead hashes.

Owns the translation of a vLLM `Request` into speckv's hash inputs and the per-request
incremental hasher. The hashes are speckv's own (`RequestBlockHasher` with `LookaheadFormat`),
over vLLM's parent seed (`NONE_HASH`) and algorithm, so for the same tokens, seed and algorithm
they equal speckv's engine's hashes byte for byte:

    block j = [s, e):  H((parent, (t[s], ..., t[e-1]), (E(s, e + L), t[e], ..., t[e+L-1])))

vLLM calls the hasher when a request is created and after each appended output token; it
returns only the hashes that became computable (the block's L successors are real tokens).
Draft tokens never reach it: vLLM keeps them out of `all_token_ids`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from speckv.hashing.extra_keys import HashInputs, LoRARef, MultiModalItem
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo
from speckv.hashing.request_hasher import RequestBlockHasher

_STATE_ATTR = "_speckv_block_hasher"


def hash_inputs_of(request: Any, tensor_bytes: Callable[[Any], Any] | None = None
                   ) -> HashInputs:
    """speckv's `HashInputs` for a vLLM request: its LoRA adapter, multimodal items, cache
    salt and prompt embeddings, tagged in vLLM's order (speckv's extra keys are the same).
    `tensor_bytes` turns the prompt-embeddings tensor into a [rows, bytes-per-row] uint8
    array (the bytes vLLM hashes per row span)."""
    lora = request.lora_request
    items = tuple(
        MultiModalItem(feature.identifier, feature.mm_position.offset,
                       feature.mm_position.length)
        for feature in (request.mm_features or ())
    )
    embeds = getattr(request, "prompt_embeds", None)
    return HashInputs(
        lora=LoRARef(lora.lora_name, lora.lora_path) if lora else None,
        mm_items=items,
        cache_salt=request.cache_salt or None,  # vLLM skips an empty salt too
        prompt_embeds=None if embeds is None or tensor_bytes is None else tensor_bytes(embeds),
    )


def _row_bytes(tensor: Any) -> Any:
    """[rows, hidden] of any dtype -> [rows, hidden * itemsize] uint8: a row span's bytes are
    then exactly the bytes vLLM hashes for it."""
    import torch  # vLLM's own torch; only requests with prompt embeddings get here

    flat = tensor.detach().cpu().contiguous()
    return flat.view(torch.uint8).reshape(flat.shape[0], -1).numpy()


class LookaheadBlockHasher:
    """`request -> new block hashes`, the callable vLLM's `Request` keeps as its hasher."""

    def __init__(self, algo_name: str, none_hash: bytes, hash_block_size: int,
                 lookahead_tokens: int) -> None:
        if lookahead_tokens < 1:
            raise ValueError(f"lookahead_tokens must be >= 1, got {lookahead_tokens}")
        self.algo = get_hash_algo(algo_name)
        self.none_hash = none_hash
        self.block_size = hash_block_size
        self.format = format_for(lookahead_tokens)

    def __call__(self, request: Any) -> list[bytes]:
        hasher = getattr(request, _STATE_ATTR, None)
        if hasher is None or len(hasher.block_hashes) != len(request.block_hashes):
            # first call, or vLLM reset the request's hashes: continue from what it holds
            hasher = RequestBlockHasher(self.algo, self.none_hash, self.block_size,
                                        self.format, hash_inputs_of(request, _row_bytes))
            hasher.block_hashes = list(request.block_hashes)
            setattr(request, _STATE_ATTR, hasher)
        before = len(hasher.block_hashes)
        tokens = getattr(request, "_all_token_ids", None)
        hasher.update(tokens if isinstance(tokens, list) else list(request.all_token_ids))
        return hasher.block_hashes[before:]
