"""The engine's cache contract: everything a router needs to reproduce its block hashes and
predict its prefix-cache hits, served as `GET /kv_cache_contract`.

Owns the field names and their meaning (a router reads them by name; `contract_version` changes
when a meaning does) and the tokenizer digest, which a router compares with its own copy of
the tokenizer so that it tokenizes every prompt exactly as the engine will:

    contract_version     1
    engine_epoch         random hex per server start: a restarted engine has a new one (its
                         KV-event sequence numbers start again at 0)
    served_model_name, model, max_model_len, vocab_size
    tokenizer            sha256 of the tokenizer's definition, special tokens and chat
                         template (None: no tokenizer, token-id prompts only)
    prefix_caching       False: the engine never hits
    block_size           tokens per block hash (the cache manager's hash unit)
    alignment_tokens     hits are whole multiples of this (the unit a legacy drop removes)
    hash_algo, hash_seed the algorithm and the seed string of NONE_HASH (None: a random seed)
    hash_mode            {label, lookahead_tokens (L), drops_last_unit, reason}
    divergent_block_reuse  True: a block cached under another successor is copied (hits of
                         j * U + U - L at divergence points)
    kv_groups            [{kind, block_size, sliding_window, lookahead_tokens}] per group
    kv_events            {endpoint, replay_endpoint, topic, hash_encoding} (endpoints as bound,
                         e.g. tcp://*:5557; None: no events published)
    num_blocks           KV blocks of the engine's cache
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from typing import Any

CONTRACT_VERSION = 1
CONTRACT_PATH = "/kv_cache_contract"


def tokenizer_digest(tokenizer: Any) -> str | None:
    """sha256 hex of what decides a prompt's token ids: the tokenizer's own definition, the
    BOS rule, the BOS / EOS texts the chat template sees, and the template. None: no tokenizer.
    Two tokenizers with equal digests encode every prompt alike."""
    if tokenizer is None:
        return None
    eos = tokenizer.eos_token_ids
    facts = {
        "backend": tokenizer.backend.to_str(),
        "bos_token_id": tokenizer.bos_token_id,
        "add_bos_token": tokenizer.add_bos_token,
        "eos_text": tokenizer.token_text(eos[0]) if eos else None,
        "chat_template": tokenizer.chat_template,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()


def new_epoch() -> str:
    return uuid.uuid4().hex


def engine_contract(engine: Any, served_model_name: str, model_path: str, epoch: str,
                    tokenizer_sha: str | None) -> dict[str, Any]:
    """The contract of a built `LLMEngine` (JSON-ready). Pure but for reading PYTHONHASHSEED,
    which the engine read the same way when it built its hashing."""
    config = engine.config.cache
    manager = engine.manager
    mode = engine.hash_mode
    seed = config.hash_seed if config.hash_seed is not None else os.environ.get("PYTHONHASHSEED")
    publisher = engine.event_publisher
    events = None
    if publisher is not None and getattr(publisher, "config", None) is not None:
        pub = publisher.config
        events = {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                  "topic": pub.topic, "hash_encoding": pub.hash_encoding.value}
    groups = [{"kind": m.group.kind, "block_size": m.group.block_size,
               "sliding_window": m.group.sliding_window,
               "lookahead_tokens": m.group.lookahead_tokens} for m in manager.managers]
    return {
        "contract_version": CONTRACT_VERSION,
        "engine_epoch": epoch,
        "served_model_name": served_model_name,
        "model": model_path,
        "max_model_len": engine.max_model_len,
        "vocab_size": engine.vocab_size,
        "tokenizer": tokenizer_sha,
        "prefix_caching": bool(manager.enable_caching),
        "block_size": manager.hash_block_size,
        "alignment_tokens": manager.alignment_tokens,
        "hash_algo": config.hash_algo,
        "hash_seed": seed,
        "hash_mode": {"label": mode.label, "lookahead_tokens": mode.lookahead_tokens,
                      "drops_last_unit": mode.drops_last_unit, "reason": mode.reason},
        "divergent_block_reuse": bool(getattr(manager, "reuses_divergent_blocks", False)),
        "kv_groups": groups,
        "kv_events": events,
        "num_blocks": engine.num_blocks,
    }
