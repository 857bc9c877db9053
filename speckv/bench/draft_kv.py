"""`speckv bench draft-kv`: a hit reads the same target KV and draft KV as a cold run.

The correctness check, on the real engine: send a prompt, then the same prompt again, and
compare the KV of the second request's hit blocks (target and draft, every layer, K and V)
with a cold run of that request on a fresh engine: the max absolute difference per drafter and
dtype. Negative control: legacy hashes with the drop turned off, and a second prompt whose
token after the shared blocks differs, so its last hit block carries draft KV written from
another successor token.

    first  = P[:h] + x + ...      the block ending at h gets draft KV from x
    second = P[:h] + y + ...      lookahead: a miss there; legacy without drop: a stale hit

With `--kv-connector offload` (or `disk`, `offload,disk`) each case also runs through the
tier: the first request is stored in the tier, the local prefix cache is reset, and the second
request's hit then comes from the tier (the table's "tier" column counts those tokens). The
tier keeps target and draft KV, so a tier hit must equal a cold run exactly like a local hit,
and the negative control must still be caught through the tier.

Multi-group models (`--model hybrid-swa`, or a Gemma 3 directory): each layer's KV is read
through its own group's block table; a sliding-window layer is compared over the blocks a hit
at h must hold (the `ceil((W - 1) / B)` blocks before h; older ones are freed), a global layer
over [0, h), and the drafter's KV (full attention) over [0, h) on the draft group's table.

With `--kv-connector store` the second request runs on a *fresh* engine (empty local cache,
its own connector) pointing at the same Valkey/Redis server as the first: the embedded server
is started once by the bench for all engines (or `--kv-store-url` names one), so the hit is
what another engine computed, as between two machines.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from speckv.bench.kv_probe import DRAFTERS, StaleHashesEngine, kv_at
from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.cache.specs import SlidingWindowSpec
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.connectors.shared_store import EMBEDDED
from speckv.engine.llm_engine import LLMEngine


@dataclass(frozen=True)
class DraftKVRow:
    drafter: str  # eagle, eagle3, mtp
    num_modules: int  # draft modules (mtp may have several)
    dtype: str
    case: str  # "lookahead hit" or "negative control"
    hit_tokens: int
    target_max_abs_diff: float
    draft_max_abs_diff: float
    tier: str = "local"  # where the hit came from: "local", or the --kv-connector names
    external_tokens: int = 0  # of hit_tokens, loaded from the tier


@dataclass(frozen=True)
class HitKV:
    """A request's KV over its first `num_tokens` positions after its first step."""

    num_tokens: int
    num_external_tokens: int  # of the request's hit, loaded from a KV tier
    # single group: [num_layers, 2, num_tokens, num_kv_heads, head_dim] fp32; several
    # groups: each group's [group layers, 2, compared tokens, ...] flattened and concatenated
    target: torch.Tensor
    draft: torch.Tensor  # [num_draft_layers, 2, num_tokens, num_kv_heads, head_dim] fp32


def make_engine(model, drafter, dtype: str, block_size: int, engine_type=LLMEngine,
                kv_connector: str | None = None, directory: str | None = None,
                store_url: str = "embedded"):
    """An engine for the check (a tier, if named, small and in `directory`; the store at
    `store_url`)."""
    from speckv.engine.engine_args import engine_config
    from speckv.engine.speculative import speculative_args

    tier = {} if kv_connector is None else {
        "kv_connector": kv_connector, "kv_offload_gib": 0.25, "kv_offload_disk_gib": 0.25,
        "kv_offload_dir": directory if "disk" in kv_connector else None,
        "kv_store_url": store_url,
    }
    config = engine_config(block_size=block_size, num_blocks=256, dtype=dtype,
                           **speculative_args(drafter, 3), hash_seed="0",
                           device=str(model.device), **tier)
    return engine_type(model, config, drafter=drafter, detokenize=False)


def first_step_kv(engine, prompt: list[int], num_tokens: int | None = None) -> HitKV:
    """Add a request, run its first step, read its KV (target, draft) over its hit (local +
    tier) or `num_tokens`; then run it to the end."""
    from speckv.engine.sampling_params import SamplingParams

    request_id = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    request = engine.get_request(request_id)
    length = request.num_cached_tokens if num_tokens is None else num_tokens
    block_size = engine.config.cache.block_size
    target = target_kv(engine, request_id, length)
    draft_ids = engine.runner.block_table(request_id, engine.runner.draft_group)
    draft = kv_at(engine.proposer.kv_cache, draft_ids, length, block_size)
    external = request.num_external_cached_tokens
    while engine.has_unfinished_requests():
        engine.step()
    return HitKV(length, external, target, draft)


def target_kv(engine, request_id: str, num_tokens: int) -> torch.Tensor:
    """The target KV a hit of `num_tokens` must hold, each layer through its group's table
    (see the module docstring for sliding-window layers)."""
    layout = engine.layout
    if layout.num_groups == 1:
        return kv_at(engine.runner.kv_cache, engine.runner.block_table(request_id),
                     num_tokens, engine.config.cache.block_size)
    parts = []
    for g, group in enumerate(layout.groups):
        spec = group.spec
        start = 0
        if isinstance(spec, SlidingWindowSpec):
            num_blocks = max(0, num_tokens // spec.block_size - spec.num_window_blocks)
            start = num_blocks * spec.block_size
        parts.append(kv_at(engine.runner.kv_cache, engine.runner.block_table(request_id, g),
                           num_tokens, spec.block_size, group.layer_indices, start).flatten())
    return torch.cat(parts)


def _send_twice(engine, first: list[int], second: list[int], reader=None) -> HitKV:
    """`first` cold; then `second`, its hit from the tier when the engine has one (the tier
    settled, the local prefix cache reset), else from the local cache. With `reader` (a
    shared store), `second` runs on that fresh engine instead, its hit from the store."""
    first_step_kv(engine, first, 0)
    if engine.connector is not None:
        assert engine.flush_kv_connector(timeout_s=120), "the tier did not settle"
        assert engine.reset_prefix_cache(), "the local prefix cache could not be reset"
    return first_step_kv(engine if reader is None else reader(), second)


def measure(model, drafter, dtype: str, prompt: list[int], block_size: int,
            kv_connector: str | None = None, directory: str | None = None,
            store_url: str = "embedded") -> list[DraftKVRow]:
    """The lookahead hit and the negative control. With "store" in `kv_connector`, an
    embedded `store_url` is one server started here for every engine of the check, and the
    second request of each case runs on a fresh engine."""
    fresh_reader = kv_connector is not None and "store" in kv_connector.split(",")
    if fresh_reader and store_url == EMBEDDED:
        with EmbeddedValkey(GIB) as server:
            return measure(model, drafter, dtype, prompt, block_size, kv_connector, directory,
                           server.url)
    policy = drafter.policy
    model_dtype = model.dtype
    model.to(getattr(torch, dtype))
    drafter.to(getattr(torch, dtype))
    tier = kv_connector or "local"
    engines = []

    def engine(engine_type=LLMEngine, connector=kv_connector):
        made = make_engine(model, drafter, dtype, block_size, engine_type, connector, directory,
                           store_url)
        engines.append(made)
        return made

    def reader(engine_type=LLMEngine):
        return (lambda: engine(engine_type)) if fresh_reader else None

    def row(case: str, warm: HitKV, cold: HitKV) -> DraftKVRow:
        return DraftKVRow(policy.name, policy.num_modules, dtype, case, warm.num_tokens,
                          (warm.target - cold.target).abs().max().item(),
                          (warm.draft - cold.draft).abs().max().item(), tier,
                          warm.num_external_tokens)

    try:
        warm = _send_twice(engine(), prompt, prompt, reader())
        rows = [row("lookahead hit", warm, first_step_kv(engine(connector=None), prompt,
                                                         warm.num_tokens))]
        # negative control: the successor of the shared blocks differs
        shared = (len(prompt) - 2) // block_size * block_size
        vocab_size = model.config.vocab_size
        successor = prompt[shared]
        first = prompt[:shared] + [successor] + prompt[shared + 1:]
        second = prompt[:shared] + [(successor + 1) % vocab_size] + prompt[shared + 1:]
        stale = _send_twice(engine(StaleHashesEngine), first, second,
                            reader(StaleHashesEngine))
        rows.append(row("negative control", stale,
                        first_step_kv(engine(connector=None), second, stale.num_tokens)))
        return rows
    finally:
        for made in engines:
            made.close()
        model.to(model_dtype)
        drafter.to(model_dtype)


def make_drafter(policy: DrafterPolicy, model, builtin_model: bool = True):
    """The built-in EAGLE3 head where it exists (on the built-in model), else a random
    drafter of `policy`."""
    from speckv.drafters.builtin import (
        BUILTIN_DRAFTER_METHOD,
        builtin_drafter_available,
        load_builtin_drafter,
    )
    from speckv.drafters.loaders import random_drafter

    if policy.name == BUILTIN_DRAFTER_METHOD and builtin_model and builtin_drafter_available():
        return load_builtin_drafter(model)
    if policy.name == "mtp":
        return random_drafter("mtp", model, seed=0, num_modules=policy.num_modules)
    return random_drafter(policy.name, model, seed=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin",
                        help="builtin, hybrid-swa / hybrid-gdn (tiny random-init hybrids), an "
                        "HF dir or a .gguf file")
    parser.add_argument("--drafters", default=",".join(DRAFTERS),
                        help="comma-separated: eagle, eagle3, mtp (default: %(default)s)")
    parser.add_argument("--mtp-num-modules", default="1,4",
                        help="module counts to run mtp with, comma-separated "
                        "(default: %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="default 100; 300 on hybrid-swa (past its 128-token window)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-connector", default=None, metavar="NAMES",
                        help="serve the hit from these KV tiers instead of the local cache: "
                        "offload, disk, offload,disk or store (a fresh engine reads the store)")
    parser.add_argument("--kv-store-url", default=EMBEDDED, metavar="URL",
                        help="the store of --kv-connector store (default: an embedded server "
                        "the bench starts once for all engines)")
    parser.add_argument("--kv-offload-dir", default=None,
                        help="disk tier directory (default: a temporary one)")
    parser.add_argument("--mamba-block-size", type=int, default=None,
                        help="--model hybrid-gdn: GDN state unit, tokens (default: 4 blocks)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import load_model

    if args.model == "hybrid-gdn":  # KV and recurrent state of a GDN hybrid
        from speckv.bench.draft_kv_hybrid import run_hybrid_gdn

        return run_hybrid_gdn(args)

    names = [name.strip() for name in args.drafters.split(",")]
    unknown = [name for name in names if name not in DRAFTERS]
    if unknown:
        raise ValueError(f"--drafters: unknown {unknown}; choose from {list(DRAFTERS)}")
    try:
        module_counts = [int(k) for k in args.mtp_num_modules.split(",")]
        policies = [drafter_policy(name, k) for name in names
                    for k in (module_counts if name == "mtp" else [1])]
    except ValueError as error:
        raise ValueError(f"--mtp-num-modules: {error}") from None
    dtypes = [dtype.strip() for dtype in args.dtypes.split(",")]
    if any(dtype not in ("float32", "bfloat16", "float16") for dtype in dtypes):
        raise ValueError("--dtypes: float32, bfloat16 or float16")
    if args.prompt_len is None:
        args.prompt_len = 300 if args.model == "hybrid-swa" else 100
    if args.prompt_len < 2 * args.block_size + 2:
        raise ValueError("--prompt-len must cover at least two blocks plus two tokens")
    if args.kv_offload_dir is not None:  # created if missing, as `speckv generate` does
        Path(args.kv_offload_dir).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    model, tokenizer = load_model(args.model, "float32", "cpu", progress=not args.json)
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(1, vocab, (args.prompt_len,), generator=generator).tolist()
    if tokenizer is not None:  # a real-text prompt: the trained head sees what it knows
        text = tokenizer.apply_chat_template([{"role": "user", "content": (
            "Explain, step by step, how a prefix cache lets a language model server reuse the "
            "attention keys and values of a shared prompt, and why speculative decoding "
            "complicates it. " * max(4, args.prompt_len // 30))}])
        prompt = tokenizer.encode(text)[: args.prompt_len]
    rows = []
    with tempfile.TemporaryDirectory(prefix="speckv-draft-kv-") as scratch:
        directory = args.kv_offload_dir or scratch
        for policy in policies:
            drafter = make_drafter(policy, model, args.model == "builtin")
            for dtype in dtypes:
                rows.extend(measure(model, drafter, dtype, prompt, args.block_size,
                                    args.kv_connector, tempfile.mkdtemp(dir=directory),
                                    args.kv_store_url))
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
        return 0
    source = "the local prefix cache" if args.kv_connector is None else (
        f"the {args.kv_connector} tier (local prefix cache reset)")
    if args.kv_connector is not None and "store" in args.kv_connector.split(","):
        source = f"the {args.kv_connector} tier, read by a fresh engine"
    table = Table(title=f"KV of the hit blocks vs a cold run, max |diff| ({len(prompt)}-token "
                        f"prompt, B={args.block_size}, all layers, K and V); hits from {source}",
                  caption="a hit reads the bytes the first request's prefill wrote, and the cold "
                          "run computes the same prefill on the same shapes: the lookahead hit "
                          "is bit-exact (0 in every dtype); the negative control's draft KV "
                          "must differ")
    numeric = ("hit tokens", "from tier", "target KV", "draft KV")
    for column in ("drafter", "dtype", "case", *numeric):
        table.add_column(column, justify="right" if column in numeric else "left")
    for row in rows:
        label = drafter_policy(row.drafter, row.num_modules).label
        table.add_row(label, row.dtype, row.case, str(row.hit_tokens), str(row.external_tokens),
                      f"{row.target_max_abs_diff:.3g}", f"{row.draft_max_abs_diff:.3g}")
    Console().print(table)
    if args.model == "hybrid-swa":
        from speckv.models.gemma.hybrid_swa import RANDOM_INIT_NOTE

        print(f"{RANDOM_INIT_NOTE}; drafters random-init; KV groups "
              f"{model.kv_cache_layout(args.block_size).describe()}")
    return 0
