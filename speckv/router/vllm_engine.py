"""vLLM engines behind `speckv router`: their cache contract, built from what vLLM publishes and
from the router's `--vllm-*` flags for what it does not.

vLLM serves no `/kv_cache_contract`. What it publishes is read from it:

    /metrics   vllm:cache_config_info{block_size, enable_prefix_caching,
               prefix_caching_hash_algo, hash_block_size, num_gpu_blocks, ...}
               vllm:spec_decode_* (present iff the engine speculates)
               process_start_time_seconds (the engine's epoch: a restart changes it)
    /v1/models the served model name, its path (`root`, where the router reads the tokenizer)
               and max_model_len

What it does not publish comes from flags in vLLM's own words (`VLLMFlags`): the engine's
`--kv-events-config` JSON (its event endpoints), the `PYTHONHASHSEED` it was started with
(vLLM's NONE_HASH seed: that string when set, else "vllm-none-hash" for sha256 / sha256_cbor and
a random one for xxhash, which nobody can reproduce), its `--speculative-config` JSON (an
EAGLE-family method drops the last matched block unless `disable_eagle_block_drop`), and, with
speckv's vLLM plugin active, its lookahead `L` (lookahead hashes, no drop). A flag that
contradicts the engine is refused naming both values: a speculative config on an engine whose
/metrics show none (or none on one that speculates); a hash seed or lookahead its KV events
do not reproduce (`check_events`, at start, from the replay socket).

Hybrid engines (sliding-window or Mamba layers beside full attention): vLLM publishes no list
of its KV cache groups; its events name each stored block's group (`group_idx`,
`kv_cache_spec_kind`, `kv_cache_spec_sliding_window`, the group's `block_size`), and the router
learns the groups from them (`group_rule`, `hybrid_rule`). vLLM's hybrid hit
(`HybridKVCacheCoordinator.find_longest_cache_hit`: each group shortens a candidate, full
attention first, to a fixed point; sliding window W needs the cdiv(W - 1, B) blocks before the
hit, Mamba the state block ending at it; hits aligned to the LCM of the group block sizes,
blocks hashed every `hash_block_size` tokens, a group's block named by the last hash in it) is
the rule `speckv.cache.group_rules` applies to speckv's hybrid engines. Refused, naming the
group: a kind the router does not know; a Mamba block hashed finer than it is (vLLM's
fine-grained partial hits); a hybrid engine under the EAGLE drop or the plugin (which groups
drop, or hash lookahead tokens, is not in its events).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from speckv.cache.group_rules import GroupRule
from speckv.events.schema import BlockStored, KVEventBatch, low64
from speckv.hashing.functions import HASH_ALGOS, get_hash_algo, make_none_hash
from speckv.router.contract import ContractError, EngineContract, HitRule, connect_endpoint
from speckv.router.index import EngineHashConfig
from speckv.router.pool_mirror import PoolShape
from speckv.router.tokenizer import UNPUBLISHED
from speckv.router.verify import VerifyError, at_hash_unit, recompute_block_hashes

VLLM_DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed (sha256*) without PYTHONHASHSEED
EAGLE_FAMILY = ("eagle", "eagle3", "mtp", "dflash", "dspark")  # vLLM's use_eagle() methods
_NO_VOCAB_LIMIT = 2**31 - 1  # the engine checks token ids itself
# vLLM's kv_cache_spec_kind -> the hit rule of its cache manager (MLA is full attention)
VLLM_KINDS = {"full_attention": "full_attention", "mla_attention": "full_attention",
              "sliding_window": "sliding_window", "mamba": "mamba"}


@dataclass(frozen=True)
class VLLMFlags:
    """What the router is told about one vLLM engine (`--vllm-*` flags)."""

    kv_events_config: Mapping[str, Any] | None = None  # the engine's --kv-events-config
    hash_seed: str | None = None  # the PYTHONHASHSEED it was started with
    speculative_config: Mapping[str, Any] | None = None  # its --speculative-config
    lookahead_tokens: int = 0  # L of speckv's vLLM plugin (0: the plugin is not active)

    @property
    def method(self) -> str | None:
        config = self.speculative_config
        return str(config.get("method")) if config and config.get("method") else None

    @property
    def drops_last_block(self) -> bool:
        """vLLM's EAGLE last-block drop: an EAGLE-family drafter, the drop not disabled, and
        no lookahead hashes (the plugin turns the drop off)."""
        config = self.speculative_config or {}
        return (self.method in EAGLE_FAMILY and not config.get("disable_eagle_block_drop")
                and self.lookahead_tokens == 0)

    @property
    def lookahead_slots(self) -> int:
        """KV slots vLLM reserves past a request's tokens for its drafter (its
        `num_lookahead_tokens`): the draft count under an EAGLE-family or draft-model drafter,
        one more under DFlash."""
        count = int((self.speculative_config or {}).get("num_speculative_tokens") or 0)
        if self.method == "dflash":
            return count + 1
        return count if self.method in (*EAGLE_FAMILY, "draft_model") else 0


def pool_shape(contract: EngineContract, flags: VLLMFlags) -> PoolShape | None:
    """What a `PoolMirror` of a vLLM engine needs: its pool size (`num_gpu_blocks` in its
    /metrics), block size and drafter's lookahead slots; None without prefix caching or a
    published pool size."""
    if not (contract.vllm and contract.hit_rule.prefix_caching and contract.num_blocks >= 2):
        return None
    return PoolShape(contract.num_blocks, contract.hashing.block_size, flags.lookahead_slots,
                     contract.hashing.route_group)


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample of a Prometheus text, by sample name. Pure."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def is_vllm_metrics(text: str) -> bool:
    return "vllm:cache_config_info" in text


def _int_label(engine: str, labels: Mapping[str, str], name: str) -> int | None:
    value = labels.get(name)
    if value in (None, "None", ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ContractError(engine, f"vllm:cache_config_info.{name}", f"{value!r} is not an "
                            "integer") from None


def _seed(engine: str, algo: str, flags: VLLMFlags) -> str:
    if flags.hash_seed is not None:
        return flags.hash_seed
    if not get_hash_algo(algo).cryptographic:
        raise ContractError(engine, "hash_seed", f"vLLM hashes {algo} with a random "
                            "per-process seed unless PYTHONHASHSEED is set: start the engine "
                            f"with PYTHONHASHSEED=S and pass --vllm-hash-seed {engine}=S")
    return VLLM_DEFAULT_SEED


def _check_speculation(engine: str, samples: Mapping[str, Any], flags: VLLMFlags) -> None:
    speculates = any(name.startswith("vllm:spec_decode_") for name in samples)
    if speculates and flags.method is None:
        raise ContractError(engine, "speculative_config", "the engine speculates (its /metrics "
                            "show vllm:spec_decode_*) but --vllm-speculative-config names no "
                            f"method: pass --vllm-speculative-config {engine}='<the engine's "
                            "--speculative-config JSON>'")
    if flags.method is not None and not speculates:
        raise ContractError(engine, "speculative_config", f"--vllm-speculative-config says "
                            f"method {flags.method!r}, but the engine does not speculate (its "
                            "/metrics show no vllm:spec_decode_*)")


def _vocab_size(model_path: str) -> int:
    """The model's vocab size from its config.json where the router can read it."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        return int(config.get("text_config", config)["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return _NO_VOCAB_LIMIT


def vllm_contract(engine: str, url: str, metrics_text: str, models_body: Any,
                  flags: VLLMFlags) -> EngineContract:
    """The contract of a vLLM engine from its /metrics, /v1/models and the router's flags; a
    `ContractError` naming what the router cannot reproduce or a flag the engine
    contradicts."""
    samples = metric_samples(metrics_text)
    infos = samples.get("vllm:cache_config_info")
    if not infos:
        raise ContractError(engine, "vllm:cache_config_info", "not in its /metrics (is it a "
                            "vLLM engine?)")
    labels = infos[0][0]
    block_size = _int_label(engine, labels, "block_size")
    if block_size is None or block_size <= 0:
        raise ContractError(engine, "vllm:cache_config_info.block_size",
                            f"{labels.get('block_size')!r}")
    # a hybrid engine hashes every gcd(group block sizes) tokens; one group, every block
    hash_unit = _int_label(engine, labels, "hash_block_size") or block_size
    algo = labels.get("prefix_caching_hash_algo", "sha256")
    if algo not in HASH_ALGOS:
        raise ContractError(engine, "vllm:cache_config_info.prefix_caching_hash_algo",
                            f"{algo!r} is not one the router can reproduce "
                            f"({', '.join(HASH_ALGOS)})")
    _check_speculation(engine, samples, flags)
    events = flags.kv_events_config
    if not events or not events.get("endpoint"):
        raise ContractError(engine, "kv_events", "no KV events: start the engine with "
                            "--kv-events-config '{\"enable_kv_cache_events\": true, "
                            "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:PORT\", "
                            "\"replay_endpoint\": \"tcp://*:PORT2\"}' and pass the same JSON "
                            f"as --vllm-kv-events-config {engine}='...'")
    if events.get("topic"):
        raise ContractError(engine, "kv_events", f"topic {events['topic']!r}: the router "
                            "subscribes to the empty topic")
    data = models_body.get("data") if isinstance(models_body, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ContractError(engine, "/v1/models", f"no model in {models_body!r:.120}")
    model = data[0]
    root = str(model.get("root") or model["id"])
    lookahead = flags.lookahead_tokens
    hashing = EngineHashConfig(algo=algo, seed=_seed(engine, algo, flags),
                               block_size=hash_unit, lookahead_tokens=lookahead,
                               counts_copies=True)
    drops = flags.drops_last_block
    start = samples.get("process_start_time_seconds", [({}, math.nan)])[0][1]
    label = (f"lookahead L={lookahead} (speckv plugin)" if lookahead
             else "legacy+drop" if drops else "legacy")
    replay = events.get("replay_endpoint")
    return EngineContract(
        engine=engine, epoch=f"vllm-{start:.3f}", served_model_name=str(model["id"]),
        model=root, max_model_len=int(model.get("max_model_len") or 0),
        vocab_size=_vocab_size(root), tokenizer=UNPUBLISHED + root, hashing=hashing,
        # the plugin reuses a block cached under another successor (one full-attention
        # group: a hybrid engine under the plugin is refused from its events)
        hit_rule=HitRule(hash_unit, lookahead, drops,
                         labels.get("enable_prefix_caching") == "True",
                         reuses_divergent_blocks=lookahead > 0),
        hash_mode_label=label,
        events_endpoint=connect_endpoint(str(events["endpoint"]), url),
        replay_endpoint=connect_endpoint(str(replay), url) if replay else None,
        num_blocks=_int_label(engine, labels, "num_gpu_blocks") or 0, vllm=True)


def group_rule(engine: str, event: BlockStored, hash_unit: int) -> GroupRule:
    """The hit rule of the KV cache group a vLLM BlockStored names, or a `ContractError`
    (field `kv_groups`) for a group the router cannot predict."""
    index = event.group_idx or 0
    named = event.kv_cache_spec_kind or "full_attention"
    kind = VLLM_KINDS.get(named)
    if kind is None:
        raise ContractError(engine, "kv_groups", f"its KV events store group {index} of kind "
                            f"{named!r}: the router predicts vLLM groups of kinds "
                            f"{', '.join(VLLM_KINDS)}")
    size, window = event.block_size, event.kv_cache_spec_sliding_window
    if size <= 0 or size % hash_unit:
        raise ContractError(engine, "kv_groups", f"group {index} ({named}) stores blocks of "
                            f"{size} tokens, not a multiple of its hash_block_size {hash_unit}")
    if kind == "mamba" and size > hash_unit:
        raise ContractError(engine, "kv_groups", f"group {index} (mamba) has blocks of {size} "
                            f"tokens hashed every {hash_unit}: vLLM's fine-grained partial "
                            "hits, which the router does not predict")
    if kind == "sliding_window" and not (window or 0) > 0:
        raise ContractError(engine, "kv_groups", f"group {index} (sliding_window) names no "
                            f"sliding window ({window!r})")
    return GroupRule(index, kind, size, 0, window if kind == "sliding_window" else None)


def learn_groups(engine: str, batch: KVEventBatch, groups: dict[int, GroupRule],
                 hash_unit: int) -> bool:
    """Enter the groups the batch's BlockStored events name into `groups` (a group's block
    size is the largest its events show: vLLM stores a prompt's partial tail block under a
    finer hash as well); whether any changed. Raises `ContractError` for a group the router
    cannot predict. Mutates `groups`."""
    changed = False
    for event in batch.events:
        if not isinstance(event, BlockStored):
            continue
        rule = group_rule(engine, event, hash_unit)
        known = groups.get(rule.group_idx)
        if known is not None and (known.kind, known.sliding_window) != (rule.kind,
                                                                          rule.sliding_window):
            raise ContractError(engine, "kv_groups", f"group {rule.group_idx} was "
                                f"{known.kind} and is now {rule.kind}")
        if known is None or rule.block_size > known.block_size:
            groups[rule.group_idx] = rule
            changed = True
    return changed


def hybrid_rule(contract: EngineContract, groups: Mapping[int, GroupRule],
                flags: VLLMFlags) -> HitRule | None:
    """The hit rule of a vLLM engine whose events show the groups `groups`: None for one
    full-attention group of whole blocks (the contract's rule), else vLLM's hybrid rule over
    them, aligned to the LCM of their block sizes. A `ContractError` for a hybrid engine
    under the EAGLE drop or the plugin."""
    rules = tuple(groups[index] for index in sorted(groups))
    unit = contract.hit_rule.block_size
    # several groups, even all of full attention (an EAGLE head of its own spec), make vLLM
    # use its hybrid coordinator, whose EAGLE drop is not the one-group one
    if len(rules) <= 1 and all(r.kind == "full_attention" and r.block_size == unit
                               for r in rules):
        return None
    if flags.drops_last_block or flags.lookahead_tokens:
        raise ContractError(contract.engine, "kv_groups", "a hybrid vLLM engine (groups "
                            + ", ".join(f"{r.group_idx}: {r.kind}" for r in rules)
                            + ") under " + ("the EAGLE last-block drop" if
                                            flags.drops_last_block else "speckv's plugin")
                            + ": which groups drop or hash lookahead tokens is not in its "
                            "events, so the router does not predict it")
    return replace(contract.hit_rule, groups=rules,
                   alignment_tokens=math.lcm(*(r.block_size for r in rules)))


def check_groups(contract: EngineContract, flags: VLLMFlags,
                 batches: list[KVEventBatch]) -> None:
    """Refuse an engine whose events show a group (or groups) the router cannot predict."""
    groups: dict[int, GroupRule] = {}
    for batch in batches:
        learn_groups(contract.engine, batch, groups, contract.hashing.block_size)
    hybrid_rule(contract, groups, flags)


def _first_root_block(batches: list[KVEventBatch], unit: int) -> BlockStored | None:
    """The first block stored from the root, of a group of blocks of `unit` tokens where the
    events show one."""
    roots = [event for batch in batches for event in batch.events
             # vLLM sends one extra-keys entry per block, None where a block has none
             if isinstance(event, BlockStored) and event.parent_block_hash is None
             and event.block_hashes and not any(event.extra_keys or ())]
    return next((event for event in roots if event.block_size == unit),
                roots[0] if roots else None)


def check_events(contract: EngineContract, flags: VLLMFlags,
                 batches: list[KVEventBatch]) -> None:
    """Refuse, naming both values, a hash seed or lookahead the engine's events contradict
    (the first block stored from the root, recomputed with the contract's hashing). Nothing
    to check without such an event."""
    engine = contract.engine
    unit = contract.hashing.block_size
    event = _first_root_block(batches, unit)
    if event is not None and event.block_size % unit:
        raise ContractError(engine, "block_size", f"its KV events store blocks of "
                            f"{event.block_size} tokens, its /metrics say {unit}")
    check_groups(contract, flags, batches)
    if event is None:
        return
    published = len(event.lookahead_token_ids[0]) if event.lookahead_token_ids else 0
    if published != flags.lookahead_tokens:
        raise ContractError(engine, "lookahead_tokens", f"--vllm-lookahead-tokens "
                            f"{flags.lookahead_tokens}, but the engine's KV events carry "
                            f"{published} lookahead tokens per block")
    algo = get_hash_algo(contract.hashing.algo)

    def first_hash(seed: str) -> int | None:
        """The first block's hash: the last of the hash units in it."""
        try:
            return low64(recompute_block_hashes(at_hash_unit(event, unit), algo,
                                                make_none_hash(algo, seed), {})
                         [event.block_size // unit - 1])
        except VerifyError:
            return None

    wire = low64(event.block_hashes[0])
    seed = contract.hashing.seed
    if first_hash(seed) in (wire, None):
        return
    hint = ""
    for candidate in (VLLM_DEFAULT_SEED, "0"):
        if candidate != seed and first_hash(candidate) == wire:
            hint = f"; seed {candidate!r} reproduces them"
            break
    raise ContractError(engine, "hash_seed", f"--vllm-hash-seed {seed!r} does not reproduce the "
                        f"engine's block hashes (its first block {wire:#018x}, with seed "
                        f"{seed!r} {first_hash(seed):#018x}){hint}")
