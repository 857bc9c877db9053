"""`speckv bench hybrid-gdn --tiers`: the hybrid hit-length scenario through every tier.

Owns the through-tier table: for each case (no drafter, MTP with lookahead hashes, MTP with
the legacy drop on `hybrid-gdn`, unit 544; EAGLE on `hybrid-swa`), the cached tokens of the
second request on the warm engine (local) and of the same prompt served from the CPU tier,
the disk tier and the store (an embedded Valkey) on a fresh engine, plus the largest
difference between what any of those hits reads and what a cold run computed (target KV,
draft KV, the sliding window's tail, the GDN state; 0 expected: the tier copies the bytes
the first request's prefill wrote, and the cold run computes the same prefill). RANDOM-init
weights, said in the output. `group_reads` is what a hit hands a request, per group (the
tests compare it too).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from speckv.attention.grouped import GroupedKVCache
from speckv.bench.kv_probe import kv_at
from speckv.cache.specs import MambaSpec, SlidingWindowSpec
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

TIER_KINDS = ("offload", "disk", "store")


@dataclass(frozen=True)
class TierRow:
    model: str
    case: str
    unit: int
    local_tokens: int
    cpu_tokens: int
    disk_tokens: int
    store_tokens: int
    max_abs_diff: float  # any tier hit's reads vs the cold run's (0: bit-exact)


def group_reads(engine: LLMEngine, request_id: str, hit: int) -> dict[str, torch.Tensor]:
    """What a hit of `hit` tokens hands the request, per group: full attention's target KV
    over [0, hit), the drafter's KV over [0, hit), a sliding window's tail before hit, the
    GDN conv + recurrent state at hit (fp32, flattened for the state)."""
    tables = engine.manager.get_block_ids(request_id)
    layout, cache = engine.layout, engine.runner.kv_cache
    attention = [g for g, group in enumerate(layout.groups)
                 if not isinstance(group.spec, MambaSpec)]
    reads = {}
    for g, group in enumerate(layout.groups):
        spec = group.spec
        if isinstance(spec, MambaSpec):
            block = tables[g][(hit - 1) // spec.block_size]
            conv, recurrent = engine.runner.states.cache.snapshot(block)
            reads[f"g{g} state"] = torch.cat([conv.float().flatten(), recurrent.flatten()])
            continue
        if isinstance(cache, GroupedKVCache):
            group_cache, layers = cache.caches[g], None
        else:
            group_cache = cache
            layers = None if len(attention) == 1 else list(group.layer_indices)
        start = (max(0, hit - spec.sliding_window + 1)
                 if isinstance(spec, SlidingWindowSpec) else 0)
        reads[f"g{g} target"] = kv_at(group_cache, tables[g], hit, spec.block_size, layers,
                                      start)
        proposer = engine.proposer
        if g == layout.draft_group and proposer is not None and proposer.kv_cache is not None:
            reads[f"g{g} draft"] = kv_at(proposer.kv_cache, tables[g], hit, spec.block_size)
    return reads


def _tier(kind: str, directory: Path, store_url: str, gib: float, fingerprint: str):
    from speckv.connectors import DiskConnector, OffloadConnector, StoreConnector

    # the weights' fingerprint, as the engine's own tiers: the rows share one store, and two
    # models with the same KV shapes must not meet in it
    ident = dict(model_fingerprint=fingerprint, hash_algo="sha256", hash_seed="0")
    if kind == "offload":
        return OffloadConnector(gib)
    if kind == "disk":
        return DiskConnector(directory, gib, **ident)
    return StoreConnector(store_url, gib, **ident)


def _first(engine: LLMEngine, prompt: list[int], request_id: str):
    engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True), request_id)
    while True:  # (a step whose load failed computes nothing for the request)
        outs = [o for o in engine.step() if o.request_id == request_id]
        if outs:
            return outs[0]


def _finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _max_diff(reads: dict[str, torch.Tensor], cold: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for name, value in reads.items():
        if value.shape != cold[name].shape:
            return float("inf")
        if value.numel():
            worst = max(worst, (value - cold[name]).abs().max().item())
    return worst


def tier_row(model, drafter, method: str | None, prompt: list[int], *, label: str, case: str,
             block_size: int, unit: int | None, legacy: bool, directory: Path, store_url: str,
             gib: float = 0.25) -> TierRow:
    """One case through the local cache and every tier (see the module docstring)."""
    spec = {"speculative_method": method, "num_spec_tokens": 1} if drafter is not None else {}
    extra = {"mamba_block_size": unit} if unit is not None else {}

    def engine(connector=None) -> LLMEngine:
        config = engine_config(block_size=block_size, num_blocks=600, hash_seed="0",
                               max_num_batched_tokens=4096,
                               disable_lookahead_block_hashes=legacy, **spec, **extra)
        return LLMEngine(model, config, drafter=drafter, connector=connector,
                         detokenize=False)

    from speckv.connectors import fingerprint_tensors

    named = [(f"target.{n}", t) for n, t in model.named_parameters()]
    if drafter is not None:
        named += [(f"draft.{n}", t) for n, t in drafter.named_parameters()]
    fingerprint = fingerprint_tensors(named)
    hits: dict[str, int] = {}
    local = 0
    worst = 0.0
    cold_engine = engine()
    cold_reads: dict[int, dict[str, torch.Tensor]] = {}
    for kind in TIER_KINDS:
        where = directory / f"{label}-{case}".replace(" ", "_").replace(",", "")
        warm = engine(_tier(kind, where, store_url, gib, fingerprint))
        _first(warm, prompt, "first")
        _finish(warm)
        local = _first(warm, prompt, "local").num_cached_tokens
        _finish(warm)
        warm.connector.flush(60)
        if kind == "offload":
            fresh = warm
            fresh.reset_prefix_cache()
        else:
            warm.close()
            fresh = engine(_tier(kind, where, store_url, gib, fingerprint))
        hit = _first(fresh, prompt, f"fresh-{kind}").num_cached_tokens
        hits[kind] = hit
        if hit:
            if hit not in cold_reads:
                _first(cold_engine, prompt, f"cold-{hit}")
                cold_reads[hit] = group_reads(cold_engine, f"cold-{hit}", hit)
                _finish(cold_engine)
            worst = max(worst, _max_diff(group_reads(fresh, f"fresh-{kind}", hit),
                                         cold_reads[hit]))
        _finish(fresh)
        fresh.close()
    cold_engine.close()
    return TierRow(label, case, unit or block_size, local, hits["offload"], hits["disk"],
                   hits["store"], worst)


def run_tier_table(gdn_model, prompt: list[int], gdn_unit: int, gdn_block: int,
                   swa: bool = True) -> list[TierRow]:
    """The table: hybrid-gdn (no drafter, MTP lookahead, MTP legacy) and hybrid-swa (EAGLE
    lookahead, EAGLE legacy), each through local, CPU, disk and store."""
    from speckv.connectors.embedded_valkey import EmbeddedValkey
    from speckv.drafters.gated_mtp import random_gated_mtp

    rows = []
    mtp = random_gated_mtp(gdn_model)
    with tempfile.TemporaryDirectory(prefix="speckv-hybrid-tiers-") as tmp, \
            EmbeddedValkey(1 << 30) as valkey:
        directory = Path(tmp)
        for case, drafter, legacy in (("no drafter", None, False),
                                      ("MTP, lookahead hashes", mtp, False),
                                      ("MTP, legacy hashes (drop)", mtp, True)):
            rows.append(tier_row(gdn_model, drafter, "mtp", prompt, label="hybrid-gdn",
                                 case=case, block_size=gdn_block, unit=gdn_unit,
                                 legacy=legacy, directory=directory, store_url=valkey.url))
        if swa:
            from speckv.drafters.loaders import random_drafter
            from speckv.models.gemma.hybrid_swa import hybrid_swa_model

            swa_model = hybrid_swa_model(vocab_size=4096)
            eagle = random_drafter("eagle", swa_model, seed=0)
            swa_prompt = [token % 4096 for token in prompt]
            for case, legacy in (("EAGLE, lookahead hashes", False),
                                 ("EAGLE, legacy hashes (drop)", True)):
                rows.append(tier_row(swa_model, eagle, "eagle", swa_prompt, label="hybrid-swa",
                                     case=case, block_size=16, unit=None, legacy=legacy,
                                     directory=directory, store_url=valkey.url))
    return rows
