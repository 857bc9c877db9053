"""`speckv bench spec-decode`: decode speed with speculation versus without, same prompts.

The built-in model (fp32, CPU, `--threads` torch threads), greedy, on held-out chat prompts
(never in the drafter's training data), at each batch size: output tokens/s without
speculation, with the built-in EAGLE3 head (adaptive draft length: the engine drafts fewer
tokens or none when that is faster) and with n-gram prompt lookup as a peer; the ratios; the
drafts' mean acceptance length and per-position acceptance; which draft lengths the engine
chose; and whether every output equals the plain run's (it must: greedy verification is
lossless).

The modes run interleaved, wave by wave (a wave = `batch` prompts decoded together; batch 1
runs one prompt at a time), so slow drift in a shared machine's load hits every mode alike.
`--record` stores the EAGLE3 figures next to the shipped head (`benchmark.json`), where
`speckv generate` and the demo read them to decide whether speculation is on by default.

`--model hybrid-swa` or `--model DIR` (e.g. a Gemma 4 checkpoint with `--speculative-model` its
MTP assistant) runs the `mtp` modes instead (adaptive, and `mtp-fixed`: always S drafts), with
the same columns: the acceptance of that drafter on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass, field

import torch
from rich.console import Console
from rich.table import Table

MODES = ("none", "eagle3", "eagle3-fixed", "ngram", "mtp", "mtp-fixed")
LABELS = {"none": "no spec", "eagle3": "EAGLE3", "eagle3-fixed": "EAGLE3 k=S",
          "ngram": "n-gram", "mtp": "MTP", "mtp-fixed": "MTP k=S"}
DRAFTER_MODES = {"eagle3": "eagle3", "eagle3-fixed": "eagle3", "mtp": "mtp",
                 "mtp-fixed": "mtp"}  # mode -> the drafter family it runs


@dataclass
class ModeResult:
    mode: str
    num_tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    num_drafts_by_position: list[int] = field(default_factory=list)
    num_accepted_by_position: list[int] = field(default_factory=list)
    steps_by_num_spec_tokens: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def mean_acceptance_length(self) -> float | None:
        steps = self.num_drafts_by_position[0] if self.num_drafts_by_position else 0
        return 1 + sum(self.num_accepted_by_position) / steps if steps else None

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0
                for a, d in zip(self.num_accepted_by_position, self.num_drafts_by_position)]


def _add(into: list[int], values) -> None:
    values = list(values)
    into.extend([0] * (len(values) - len(into)))
    for i, v in enumerate(values):
        into[i] += v


def _engine(model, tokenizer, drafters, mode: str, batch_size: int, num_spec: int):
    from speckv.engine.config import EngineConfig
    from speckv.engine.llm_engine import LLMEngine

    speculative: dict = {}
    drafter = drafters.get(DRAFTER_MODES.get(mode, ""))
    if drafter is not None:
        method = getattr(drafter, "speculative_method", drafter.policy.name)
        speculative = {"speculative_method": method, "num_spec_tokens": num_spec,
                       "adaptive_speculation": not mode.endswith("-fixed")}
    elif mode == "ngram":
        speculative = {"speculative_method": "ngram", "num_spec_tokens": num_spec}
    config = EngineConfig(max_num_seqs=batch_size, num_blocks=max(256, 16 * batch_size),
                          dtype=str(model.dtype).removeprefix("torch."), **speculative)
    return LLMEngine(model, config, tokenizer, drafter=drafter)


def _run_wave(engine, prompts, max_tokens, result: ModeResult) -> None:
    from speckv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    result.seconds += time.perf_counter() - start
    for request_id in ids:
        output = done[request_id]
        result.num_tokens += len(output.token_ids)
        result.outputs.append(output.token_ids)
        _add(result.num_drafts_by_position, output.num_drafts_by_position)
        _add(result.num_accepted_by_position, output.num_accepted_by_position)


def measure(model, tokenizer, drafter, prompts, batch_size, max_tokens, num_spec, modes
            ) -> dict[str, ModeResult]:
    """Every mode over all `prompts`, `batch_size` at a time, the modes interleaved per wave.
    `drafter`: the EAGLE3 drafter, or {family: drafter} ("eagle3", "mtp")."""
    drafters = drafter if isinstance(drafter, dict) else {"eagle3": drafter}
    engines = {mode: _engine(model, tokenizer, drafters, mode, batch_size, num_spec)
               for mode in modes}
    results = {mode: ModeResult(mode) for mode in modes}
    for wave_start in range(0, len(prompts), batch_size):
        wave = prompts[wave_start : wave_start + batch_size]
        order = list(modes) if (wave_start // batch_size) % 2 == 0 else list(reversed(modes))
        for mode in order:
            _run_wave(engines[mode], wave, max_tokens, results[mode])
    for mode, engine in engines.items():
        stats = engine.spec_decode_stats()
        if stats is not None:
            results[mode].steps_by_num_spec_tokens = list(stats.steps_by_num_spec_tokens)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from speckv.engine.config import MAX_NUM_SPEC_TOKENS

    parser.add_argument("--model", default="builtin",
                        help="'builtin', 'hybrid-swa' (random-init) or a model directory "
                        "(e.g. a Gemma 4 checkpoint, with --speculative-model its assistant)")
    parser.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                        default="builtin",
                        help="EAGLE3 drafter dir or 'builtin' (the shipped head) for the eagle3 "
                        "modes; an MTP drafter dir (e.g. a Gemma 4 assistant) for the mtp modes "
                        "('random-assistant' on hybrid-swa by default); --draft-model is a "
                        "deprecated alias")
    parser.add_argument("--num-spec-tokens", type=int, default=3,
                        help=f"most drafts per step, 1..{MAX_NUM_SPEC_TOKENS}")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per prompt")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--num-prompts", type=int, default=24,
                        help="held-out chat prompts (at least the largest batch is decoded: "
                        "prompts repeat to fill it)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of {', '.join(MODES)}; 'none' is the "
                        "reference and always runs (default none,eagle3,ngram on the built-in "
                        "model, none,mtp,mtp-fixed,ngram otherwise)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--record", action="store_true",
                        help="store the EAGLE3 figures with the shipped head (benchmark.json)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _check(args: argparse.Namespace) -> tuple[list[int], tuple[str, ...]]:
    from speckv.drafters.prompts import eval_prompts
    from speckv.engine.config import MAX_NUM_SPEC_TOKENS

    try:
        batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    except ValueError:
        raise ValueError(f"--batch-sizes: not a comma-separated list of ints: "
                         f"{args.batch_sizes!r}") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("--batch-sizes must all be >= 1")
    if not 1 <= args.num_spec_tokens <= MAX_NUM_SPEC_TOKENS:
        raise ValueError(f"--num-spec-tokens must be between 1 and {MAX_NUM_SPEC_TOKENS}")
    available = len(eval_prompts(None))
    if not 1 <= args.num_prompts <= available:
        raise ValueError(f"--num-prompts must be between 1 and {available} (held-out prompts)")
    if args.max_tokens < 1 or args.threads < 1:
        raise ValueError("--max-tokens and --threads must be >= 1")
    if args.modes is None:
        args.modes = ("none,eagle3,ngram" if args.model == "builtin"
                      else "none,mtp,mtp-fixed,ngram")
    modes = tuple(dict.fromkeys(["none", *(m.strip() for m in args.modes.split(","))]))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if args.record and (args.speculative_model != "builtin" or "eagle3" not in modes
                        or args.model != "builtin"):
        raise ValueError("--record needs the built-in model, its head and the eagle3 mode")
    if args.model != "builtin" and any(m.startswith("eagle3") for m in modes) \
            and args.speculative_model == "builtin":
        raise ValueError("--modes eagle3: the shipped EAGLE3 head is the built-in model's; give "
                         "--speculative-model DIR for another --model")
    if any(m.startswith("mtp") for m in modes) and args.model not in ("hybrid-swa",) \
            and args.speculative_model == "builtin":
        raise ValueError("--modes mtp needs --speculative-model DIR (an MTP drafter, e.g. the "
                         "Gemma 4 assistant of --model)")
    if any(m.startswith("eagle3") for m in modes) and any(m.startswith("mtp") for m in modes) \
            and args.speculative_model != "builtin":
        raise ValueError("--modes: eagle3 and mtp modes each need their own drafter; run them "
                         "separately")
    return batch_sizes, modes


def run(args: argparse.Namespace) -> int:
    from speckv.drafters.prompts import eval_prompts
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    batch_sizes, modes = _check(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, "float32", "cpu", progress=not args.json)
    drafters = {}
    for family in dict.fromkeys(DRAFTER_MODES[m] for m in modes if m in DRAFTER_MODES):
        name = args.speculative_model
        if family == "mtp" and name == "builtin":  # hybrid-swa: a random-init assistant
            name = "random-assistant"
        drafters[family] = load_drafter_model(name, model, family)
    texts = eval_prompts(args.num_prompts)
    if tokenizer is not None:
        chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    else:  # a directory without a tokenizer: the texts' bytes as token ids
        vocab = model.config.vocab_size
        chats = [[b % vocab for b in t.encode()] for t in texts]
    table_rows = []
    for batch_size in batch_sizes:
        count = max(len(chats), batch_size)
        prompts = [chats[i % len(chats)] for i in range(count)]
        results = measure(model, tokenizer, drafters, prompts, batch_size, args.max_tokens,
                          args.num_spec_tokens, modes)
        table_rows.append((batch_size, len(prompts), results))
    payload = []
    for batch_size, num_prompts, results in table_rows:
        plain = results["none"]
        for mode, result in results.items():
            payload.append({
                "batch_size": batch_size, "num_prompts": num_prompts, "mode": mode,
                "tokens_per_s": result.tokens_per_s,
                "speedup": result.tokens_per_s / plain.tokens_per_s,
                "mean_acceptance_length": result.mean_acceptance_length,
                "acceptance_by_position": result.acceptance_by_position,
                "steps_by_num_spec_tokens": result.steps_by_num_spec_tokens,
                "identical_to_no_spec": result.outputs == plain.outputs,
                **{k: v for k, v in asdict(result).items()
                   if k in ("num_tokens", "seconds")},
            })
    if args.record:
        _record(payload, args)
    if args.json:
        print(json.dumps(payload))
        return 0
    _print(payload, args, len(texts))
    return 0


def _record(payload: list[dict], args: argparse.Namespace) -> None:
    from speckv.drafters.builtin import BENCHMARK_FILE, BUILTIN_DRAFTER_DIR

    rows = [r for r in payload if r["mode"] == "eagle3"]
    lengths = [r["mean_acceptance_length"] for r in rows if r["batch_size"] == min(
        x["batch_size"] for x in rows) and r["mean_acceptance_length"] is not None]
    record = {
        "speedup_by_batch": {str(r["batch_size"]): round(r["speedup"], 3) for r in rows},
        "mean_acceptance_length": round(lengths[0], 3) if lengths else 1.0,
        "num_spec_tokens": args.num_spec_tokens,
        "command": (f"speckv bench spec-decode --batch-sizes {args.batch_sizes} "
                    f"--num-prompts {args.num_prompts} --max-tokens {args.max_tokens} "
                    f"--threads {args.threads}"),
        "rows": payload,
    }
    (BUILTIN_DRAFTER_DIR / BENCHMARK_FILE).write_text(json.dumps(record, indent=1))


def _print(payload: list[dict], args: argparse.Namespace, num_texts: int) -> None:
    name = "built-in model" if args.model == "builtin" else args.model
    if args.model == "hybrid-swa":
        name += " (RANDOM-INIT weights, random-init MTP assistant: few drafts accepted)"
    table = Table(title=f"greedy decode, {name} (fp32, {args.threads} thread), "
                        f"{num_texts} held-out chat prompts, {args.max_tokens} output tokens, "
                        f"up to {args.num_spec_tokens} drafts", title_justify="left")
    for column in ("B", "mode", "tok/s", "x", "AL", "acc. %", "steps by k", "same"):
        table.add_column(column, justify="left" if column == "mode" else "right", no_wrap=True)
    for row in payload:
        length = row["mean_acceptance_length"]
        table.add_row(
            str(row["batch_size"]), LABELS[row["mode"]], f"{row['tokens_per_s']:.1f}",
            f"{row['speedup']:.2f}", f"{length:.2f}" if length is not None else "-",
            "/".join(f"{100 * a:.0f}" for a in row["acceptance_by_position"]) or "-",
            "/".join(str(n) for n in row["steps_by_num_spec_tokens"]) or "-",
            "yes" if row["identical_to_no_spec"] else "NO",
        )
    console = Console()
    console.print(table)
    console.print("[dim]B: batch size. EAGLE3, MTP and n-gram choose their draft length per "
                  "step (adaptive); EAGLE3 / MTP k=S always draft S. x: tokens/s over no "
                  "spec's. AL: mean acceptance length, tokens per verification step with "
                  "drafts (accepted + 1). "
                  "acc. %: share of those steps that accepted draft 1, 2, ... steps by k: "
                  "decode steps that drafted k = 0, 1, ... tokens. same: greedy output equals "
                  "no spec's.[/dim]")
