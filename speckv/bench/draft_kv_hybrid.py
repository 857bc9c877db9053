"""`speckv bench draft-kv --model hybrid-gdn`: on a Gated DeltaNet hybrid, a hit reads the same
target KV, draft KV AND recurrent state as a cold run.

Owns the hybrid variant of the draft-KV check (`draft_kv.py`): the `hybrid-gdn` model (RANDOM
weights, said in the title) with a random-init drafter, an engine whose GDN state unit is
`--mamba-block-size`, and three diffs per case: the target KV of the attention layers over the
hit, the drafter's KV over the hit, and every linear layer's conv + recurrent state at the hit
(the checkpoint block the hit restores) against the state a cold run checkpoints there.
Negative control as in `draft_kv.py`: legacy hashes with the drop off and a different token
after the shared units; its draft KV is stale (caught), its state is not (the state at h does
not depend on tokens after h, which is why Mamba groups keep legacy hashes).

With `--kv-connector offload|disk|store` the second request's hit comes from the tier (the
first request stored, the tier settled, the local prefix cache reset; the store read by a fresh
engine), and the table's "from tier" column counts the tokens the tier served.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from speckv.bench.kv_probe import DRAFTERS, StaleHashesEngine, kv_at
from speckv.cache.drafter_policy import drafter_policy
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.connectors.shared_store import EMBEDDED
from speckv.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class HybridDraftKVRow:
    drafter: str
    num_modules: int
    dtype: str
    case: str
    hit_tokens: int
    target_max_abs_diff: float
    draft_max_abs_diff: float
    state_max_abs_diff: float
    tier: str = "local"  # where the hit came from: "local", or the --kv-connector names
    external_tokens: int = 0  # of hit_tokens, loaded from the tier


@dataclass(frozen=True)
class _HitState:
    num_tokens: int
    target: torch.Tensor  # [attn_layers, 2, num_tokens, kv_heads, head_dim] fp32
    draft: torch.Tensor  # [draft_layers, 2, num_tokens, kv_heads, head_dim] fp32
    state: torch.Tensor  # every linear layer's conv and recurrent state, flattened, fp32
    external_tokens: int = 0  # of num_tokens, loaded from a KV tier


@dataclass(frozen=True)
class _Tier:
    """The KV tier the second request's hit comes from (None: the local cache)."""

    kv_connector: str | None = None
    directory: str | None = None
    store_url: str = EMBEDDED

    def options(self) -> dict:
        if self.kv_connector is None:
            return {}
        return {"kv_connector": self.kv_connector, "kv_offload_gib": 0.25,
                "kv_offload_disk_gib": 0.25, "kv_store_url": self.store_url,
                "kv_offload_dir": self.directory if "disk" in self.kv_connector else None}


def _engine(model, drafter, dtype, block_size, unit, engine_type=LLMEngine,
            tier: _Tier = _Tier()):
    from speckv.engine.engine_args import engine_config
    from speckv.engine.speculative import speculative_args

    config = engine_config(block_size=block_size, mamba_block_size=unit, num_blocks=256,
                           dtype=dtype, hash_seed="0", **speculative_args(drafter, 3),
                           **tier.options())
    return engine_type(model, config, drafter=drafter, detokenize=False)


def _send_twice(engine, first: list[int], second: list[int], reader=None) -> _HitState:
    """`first` cold, then `second`: its hit from the tier when the engine has one (settled,
    local cache reset; `reader`: a fresh engine reads the shared store), else local."""
    _first_step(engine, first, 0)
    if engine.connector is not None:
        assert engine.flush_kv_connector(timeout_s=120), "the tier did not settle"
        assert engine.reset_prefix_cache(), "the local prefix cache could not be reset"
    return _first_step(engine if reader is None else reader(), second)


def _first_step(engine: LLMEngine, prompt: list[int], num_tokens: int | None = None
                ) -> _HitState:
    from speckv.engine.sampling_params import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    request = engine.get_request(rid)
    length = request.num_cached_tokens if num_tokens is None else num_tokens
    external = request.num_external_cached_tokens
    tables = engine.runner.block_tables(rid)
    bs = engine.config.cache.block_size
    draft_table = tables[engine.layout.draft_group or 0]
    target = kv_at(engine.runner.kv_cache, draft_table, length, bs)
    draft = kv_at(engine.proposer.kv_cache, draft_table, length, bs)
    states = engine.runner.states
    if length:
        conv, rec = states.cache.snapshot(tables[states.group][(length - 1) // states.unit])
        state = torch.cat([conv.float().flatten(), rec.flatten()])
    else:
        state = torch.zeros(1)
    while engine.has_unfinished_requests():
        engine.step()
    return _HitState(length, target, draft, state, external)


def measure_hybrid(model, drafter, dtype: str, prompt: list[int], block_size: int, unit: int,
                   tier: _Tier = _Tier()) -> list[HybridDraftKVRow]:
    fresh_reader = tier.kv_connector is not None and "store" in tier.kv_connector.split(",")
    if fresh_reader and tier.store_url == EMBEDDED:  # one server for every engine here
        with EmbeddedValkey(GIB) as server:
            return measure_hybrid(model, drafter, dtype, prompt, block_size, unit,
                                  _Tier(tier.kv_connector, tier.directory, server.url))
    policy = drafter.policy
    original = model.dtype
    model.to(getattr(torch, dtype))
    drafter.to(getattr(torch, dtype))

    def row(case: str, warm: _HitState, cold: _HitState) -> HybridDraftKVRow:
        return HybridDraftKVRow(
            policy.name, policy.num_modules, dtype, case, warm.num_tokens,
            (warm.target - cold.target).abs().max().item(),
            (warm.draft - cold.draft).abs().max().item(),
            (warm.state - cold.state).abs().max().item(), tier.kv_connector or "local",
            warm.external_tokens)

    def reader(engine_type=LLMEngine):
        if not fresh_reader:
            return None
        return lambda: _engine(model, drafter, dtype, block_size, unit, engine_type, tier)

    try:
        warm = _send_twice(_engine(model, drafter, dtype, block_size, unit, tier=tier), prompt,
                           prompt, reader())
        cold = _first_step(_engine(model, drafter, dtype, block_size, unit), prompt,
                           warm.num_tokens)
        rows = [row("lookahead hit", warm, cold)]
        shared = (len(prompt) - 2) // unit * unit
        successor = prompt[shared]
        first = prompt[:shared] + [successor] + prompt[shared + 1:]
        second = prompt[:shared] + [(successor + 1) % model.config.vocab_size] \
            + prompt[shared + 1:]
        stale = _send_twice(_engine(model, drafter, dtype, block_size, unit, StaleHashesEngine,
                                    tier), first, second, reader(StaleHashesEngine))
        rows.append(row("negative control", stale, _first_step(
            _engine(model, drafter, dtype, block_size, unit), second, stale.num_tokens)))
        return rows
    finally:
        model.to(original)
        drafter.to(original)


def run_hybrid_gdn(args: argparse.Namespace) -> int:
    """The `--model hybrid-gdn` path of `speckv bench draft-kv`."""
    from speckv.drafters.hybrid_mtp import random_hybrid_drafter
    from speckv.models.hybrid.hybrid_gdn import RANDOM_INIT_NOTE, hybrid_gdn_model

    names = [name.strip() for name in args.drafters.split(",")]
    unknown = [name for name in names if name not in DRAFTERS]
    if unknown:
        raise ValueError(f"--drafters: unknown {unknown}; choose from {list(DRAFTERS)}")
    module_counts = [int(k) for k in args.mtp_num_modules.split(",")]
    dtypes = [dtype.strip() for dtype in args.dtypes.split(",")]
    unit = args.mamba_block_size or 4 * args.block_size
    if unit % args.block_size:
        raise ValueError("--mamba-block-size must be a multiple of --block-size")
    torch.set_num_threads(1)
    model = hybrid_gdn_model(vocab_size=4096)
    prompt_len = max(args.prompt_len or 100, 2 * unit + 2)
    prompt = torch.randint(1, 4096, (prompt_len,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    if args.kv_offload_dir is not None:  # created if missing, as `speckv generate` does
        from pathlib import Path

        Path(args.kv_offload_dir).mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="speckv-draft-kv-") as scratch:
        for name in names:
            for k in module_counts if name == "mtp" else [1]:
                drafter = random_hybrid_drafter(name, model, k)
                for dtype in dtypes:
                    tier = _Tier(args.kv_connector,
                                 tempfile.mkdtemp(dir=args.kv_offload_dir or scratch),
                                 args.kv_store_url)
                    rows.extend(measure_hybrid(model, drafter, dtype, prompt,
                                               args.block_size, unit, tier))
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
        return 0
    table = Table(title=f"[{RANDOM_INIT_NOTE}] hit vs a cold run, max |diff| ({prompt_len}-token "
                        f"prompt, KV block {args.block_size}, GDN state unit {unit}): target KV "
                        "(attention layers), draft KV, GDN conv + recurrent state at the hit",
                  caption="a hit reads the bytes the first request's prefill wrote, and the cold "
                          "run computes the same prefill on the same shapes: the lookahead hit "
                          "is bit-exact (0 in every dtype); the negative control's draft KV "
                          "must differ")
    numeric = ("hit tokens", "from tier", "target KV", "draft KV", "GDN state")
    for column in ("drafter", "dtype", "case", "tier", *numeric):
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        table.add_row(drafter_policy(row.drafter, row.num_modules).label, row.dtype, row.case,
                      row.tier, str(row.hit_tokens), str(row.external_tokens),
                      f"{row.target_max_abs_diff:.3g}", f"{row.draft_max_abs_diff:.3g}",
                      f"{row.state_max_abs_diff:.3g}")
    Console().print(table)
    return 0
