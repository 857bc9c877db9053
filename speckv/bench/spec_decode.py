"""`speckv bench spec-decode`: decode speed with speculation versus without, same prompts.

The built-in model (fp32, CPU, `--threads` torch threads), greedy, at each batch size, on the
held-out prompt set (`speckv/drafters/heldout_prompts.py`, named in the output): chat, code and
list requests in templates and on topics that neither the drafter's training prompts nor the
prompts its training and the adaptive policy were evaluated on use, and random-token prompts
(no chat template). Per batch size and family: output tokens/s without speculation, with the
built-in EAGLE3 head (adaptive draft length: the engine drafts fewer tokens or none when that is
faster) and optionally with the head at a fixed length or n-gram prompt lookup; the ratios, by
wall time and by the process's CPU time (steadier where other processes share the cores); the
drafts' mean acceptance length and per-position acceptance; which draft lengths the engine
chose; and whether every output equals the plain run's (it must: greedy verification is
lossless). The `all` rows pool the families (tokens over seconds).

Each (batch size, family) gets fresh engines, so every figure includes the policy's learning.
The modes decode each wave (`batch` prompts decoded together; batch 1 runs one prompt at a
time) side by side, one engine step each in turn, the order reversed every step, and only the
steps are timed: a shared machine's load, which swings by tens of percent within seconds, lands
on every mode alike. Every (batch size, family) is measured `--rounds` times on fresh engines;
the ratios shown are the median over the rounds, with their range. `--record` stores the
EAGLE3 figures next to the shipped head (`benchmark.json`), where `speckv generate`, `serve`
and the demo read them to decide whether speculation is on by default
(`speckv/drafters/builtin.py`).

`--model hybrid-swa` or `--model DIR` (e.g. a Gemma 4 checkpoint with `--speculative-model` its
MTP assistant) runs the `mtp` modes instead (adaptive, and `mtp-fixed`: always S drafts), with
the same columns: the acceptance of that drafter on the same prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    cpu_seconds: float = 0.0  # the process's CPU time over the same waves
    draft_cpu_seconds: float = 0.0  # of it, in the proposer (draft-KV catch-up + drafting)
    outputs: list[list[int]] = field(default_factory=list)
    num_drafts_by_position: list[int] = field(default_factory=list)
    num_accepted_by_position: list[int] = field(default_factory=list)
    steps_by_num_spec_tokens: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_tokens / self.cpu_seconds if self.cpu_seconds else 0.0

    def merged(self, other: ModeResult) -> ModeResult:
        """Both results pooled (tokens and seconds summed, counters added)."""
        out = ModeResult(self.mode, self.num_tokens + other.num_tokens,
                         self.seconds + other.seconds, self.cpu_seconds + other.cpu_seconds,
                         self.draft_cpu_seconds + other.draft_cpu_seconds,
                         self.outputs + other.outputs)
        for name in ("num_drafts_by_position", "num_accepted_by_position",
                     "steps_by_num_spec_tokens"):
            for part in (self, other):
                _add(getattr(out, name), getattr(part, name))
        return out

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
    from speckv.engine.engine_args import engine_config
    from speckv.engine.llm_engine import LLMEngine

    speculative: dict = {}
    drafter = drafters.get(DRAFTER_MODES.get(mode, ""))
    if drafter is not None:
        method = drafter.speculative_method
        speculative = {"speculative_method": method, "num_spec_tokens": num_spec,
                       "adaptive_speculation": not mode.endswith("-fixed")}
    elif mode == "ngram":
        speculative = {"speculative_method": "ngram", "num_spec_tokens": num_spec}
    config = engine_config(max_num_seqs=batch_size, num_blocks=max(256, 16 * batch_size),
                           dtype=str(model.dtype).removeprefix("torch."), **speculative)
    return LLMEngine(model, config, tokenizer, drafter=drafter)


def _start_wave(engine, prompts, max_tokens) -> list[str]:
    from speckv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    return [engine.add_request(prompt, params) for prompt in prompts]


def _timed_step(engine, result: ModeResult, done: dict) -> None:
    """One engine step, its wall and CPU seconds (and the proposer's share) added to `result`."""
    from speckv.speculation.proposer import ProposeTiming

    proposer = engine.proposer
    if proposer is not None:
        proposer.last_timing = ProposeTiming()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.step()
    result.seconds += time.perf_counter() - start
    result.cpu_seconds += time.process_time() - cpu_start
    if proposer is not None:  # timed on the engine's clock: CPU time on CPU
        result.draft_cpu_seconds += proposer.last_timing.catch_up_s \
            + proposer.last_timing.draft_s
    for output in outputs:
        if output.finished:
            done[output.request_id] = output


def _finish_wave(ids: list[str], done: dict, result: ModeResult) -> None:
    for request_id in ids:
        output = done[request_id]
        result.num_tokens += len(output.token_ids)
        result.outputs.append(output.token_ids)
        _add(result.num_drafts_by_position, output.num_drafts_by_position)
        _add(result.num_accepted_by_position, output.num_accepted_by_position)


def measure(model, tokenizer, drafter, prompts, batch_size, max_tokens, num_spec, modes,
            first_wave: int = 0) -> dict[str, ModeResult]:
    """Every mode over all `prompts` (texts or token ids), `batch_size` at a time, on fresh
    engines. The modes decode each wave side by side, one engine step each in turn (the order
    reversed every step and every wave; `first_wave`: the index of the first wave in a longer
    run), and only the steps are timed: load that other processes put on the machine lands on
    every mode alike within a step or two. `drafter`: the EAGLE3 drafter, or {family: drafter}
    ("eagle3", "mtp")."""
    drafters = drafter if isinstance(drafter, dict) else {"eagle3": drafter}
    engines = {mode: _engine(model, tokenizer, drafters, mode, batch_size, num_spec)
               for mode in modes}
    results = {mode: ModeResult(mode) for mode in modes}
    for wave_start in range(0, len(prompts), batch_size):
        wave = prompts[wave_start : wave_start + batch_size]
        index = first_wave + wave_start // batch_size
        order = list(modes) if index % 2 == 0 else list(reversed(modes))
        ids = {mode: _start_wave(engines[mode], wave, max_tokens) for mode in order}
        done: dict[str, dict] = {mode: {} for mode in modes}
        step = 0
        while True:
            active = [m for m in order if engines[m].has_unfinished_requests()]
            if not active:
                break
            for mode in (active if step % 2 == 0 else reversed(active)):
                _timed_step(engines[mode], results[mode], done[mode])
            step += 1
        for mode in order:
            _finish_wave(ids[mode], done[mode], results[mode])
    for mode, engine in engines.items():
        stats = engine.spec_decode_stats()
        if stats is not None:
            results[mode].steps_by_num_spec_tokens = list(stats.steps_by_num_spec_tokens)
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from speckv.drafters.heldout_prompts import FAMILIES, HELDOUT_SET
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
    parser.add_argument("--max-tokens", type=int, default=48, help="output tokens per prompt")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated prompt families of the held-out set "
                        f"{HELDOUT_SET}: {', '.join(FAMILIES)}")
    parser.add_argument("--num-prompts", type=int, default=4,
                        help="distinct prompts per family and batch size (at least the batch "
                        "size: a batch decodes that many distinct prompts)")
    parser.add_argument("--modes", default=None,
                        help=f"comma-separated subset of {', '.join(MODES)}; 'none' is the "
                        "reference and always runs (default none,eagle3 on the built-in model, "
                        "none,mtp,mtp-fixed otherwise)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="times every (batch size, family) is measured, on fresh engines; "
                        "the ratios are the median over the rounds, with their range")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--record", action="store_true",
                        help="store the EAGLE3 figures with the shipped head (benchmark.json)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def _check(args: argparse.Namespace) -> tuple[list[int], tuple[str, ...], tuple[str, ...]]:
    from speckv.drafters.heldout_prompts import FAMILIES, family_size
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
    families = tuple(dict.fromkeys(f.strip() for f in args.families.split(",") if f.strip()))
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"--families: unknown {unknown}; choose from {list(FAMILIES)}")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    for family in families:
        size = family_size(family)
        need = max(args.num_prompts, *batch_sizes)
        if size is not None and need > size:
            raise ValueError(f"--num-prompts / --batch-sizes: the {family} family has {size} "
                             f"distinct prompts, {need} needed")
    if args.max_tokens < 1 or args.threads < 1 or args.rounds < 1:
        raise ValueError("--max-tokens, --threads and --rounds must be >= 1")
    if args.modes is None:
        args.modes = "none,eagle3" if args.model == "builtin" else "none,mtp,mtp-fixed"
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
    return batch_sizes, families, modes


def family_prompts(tokenizer, family: str, num: int, vocab_size: int | None = None) -> list:
    """`num` prompts of a held-out family: chat-templated texts, or token ids (random). A model
    without a tokenizer (`vocab_size` given) gets the texts' bytes as token ids."""
    from speckv.drafters.heldout_prompts import random_token_prompts, text_prompts

    if family == "random":
        special = tokenizer.backend.get_added_tokens_decoder() if tokenizer else {}
        vocab = tokenizer.vocab_size if tokenizer is not None else vocab_size
        return random_token_prompts(num, vocab, exclude=sorted(special))
    texts = text_prompts(family, num)
    if tokenizer is None:
        assert vocab_size is not None
        return [[b % vocab_size for b in text.encode()] for text in texts]
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}])
            for text in texts]


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    batch_sizes, families, modes = _check(args)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, "float32", "cpu", progress=not args.json)
    drafter = {}
    for kind in dict.fromkeys(DRAFTER_MODES[m] for m in modes if m in DRAFTER_MODES):
        name = args.speculative_model
        if kind == "mtp" and name == "builtin":  # hybrid-swa: a random-init assistant
            name = "random-assistant"
        drafter[kind] = load_drafter_model(name, model, kind)
    vocab_size = model.config.vocab_size
    payload = []
    wave = 0
    for batch_size in batch_sizes:
        count = max(args.num_prompts, batch_size)
        prompts = {family: family_prompts(tokenizer, family, count, vocab_size)
                   for family in families}
        by_family: dict[str, list[dict[str, ModeResult]]] = {f: [] for f in families}
        for _ in range(args.rounds):  # fresh engines every round: each includes the learning
            for family in families:
                by_family[family].append(measure(
                    model, tokenizer, drafter, prompts[family], batch_size, args.max_tokens,
                    args.num_spec_tokens, modes, first_wave=wave))
                wave += -(-count // batch_size)
        for family in families:
            payload += _rows(batch_size, family, count, by_family[family])
        if len(families) > 1:
            pooled_rounds = [_pooled([by_family[f][r] for f in families])
                             for r in range(args.rounds)]
            payload += _rows(batch_size, "all", count * len(families), pooled_rounds)
    if args.record:
        _record(payload, args)
    if args.json:
        print(json.dumps(payload))
        return 0
    _print(payload, args)
    return 0


def _pooled(parts: list[dict[str, ModeResult]]) -> dict[str, ModeResult]:
    """Per mode, the parts' results merged (tokens and seconds summed, counters added)."""
    out: dict[str, ModeResult] = {}
    for part in parts:
        out = {mode: out[mode].merged(r) if mode in out else r for mode, r in part.items()}
    return out


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _rows(batch_size: int, family: str, num_prompts: int,
          rounds: list[dict[str, ModeResult]]) -> list[dict]:
    """One row per mode: counters and tokens/s pooled over the rounds; the ratios to no spec
    per round (`speedups`, `cpu_speedups`), their median (`speedup`, `cpu_speedup`)."""
    results = _pooled(rounds)
    plain = results["none"]
    rows = []
    for mode, result in results.items():
        wall = [r[mode].tokens_per_s / r["none"].tokens_per_s for r in rounds]
        cpu = [r[mode].tokens_per_cpu_s / r["none"].tokens_per_cpu_s for r in rounds]
        rows.append({
            "batch_size": batch_size, "family": family, "num_prompts": num_prompts,
            "mode": mode, "rounds": len(rounds),
            "tokens_per_s": result.tokens_per_s,
            "speedup": _median(wall), "speedups": wall,
            "cpu_speedup": _median(cpu), "cpu_speedups": cpu,
            "draft_share": result.draft_cpu_seconds / result.cpu_seconds if result.cpu_seconds
            else 0.0,
            "mean_acceptance_length": result.mean_acceptance_length,
            "acceptance_by_position": result.acceptance_by_position,
            "steps_by_num_spec_tokens": result.steps_by_num_spec_tokens,
            "identical_to_no_spec": result.outputs == plain.outputs,
            **{k: v for k, v in asdict(result).items()
               if k in ("num_tokens", "seconds", "cpu_seconds")},
        })
    return rows


def _command(args: argparse.Namespace) -> str:
    return (f"speckv bench spec-decode --batch-sizes {args.batch_sizes} --families "
            f"{args.families} --num-prompts {args.num_prompts} --max-tokens {args.max_tokens} "
            f"--num-spec-tokens {args.num_spec_tokens} --rounds {args.rounds} "
            f"--threads {args.threads}")


def _record(payload: list[dict], args: argparse.Namespace) -> None:
    from speckv.drafters.builtin import BENCHMARK_FILE, BUILTIN_DRAFTER_DIR
    from speckv.drafters.heldout_prompts import HELDOUT_SET

    pooled_family = "all" if any(r["family"] == "all" for r in payload) else payload[0]["family"]
    rows = [r for r in payload if r["mode"] == "eagle3"]
    pooled = [r for r in rows if r["family"] == pooled_family]
    smallest = min(r["batch_size"] for r in pooled)
    lengths = [r["mean_acceptance_length"] for r in pooled
               if r["batch_size"] == smallest and r["mean_acceptance_length"] is not None]
    record = {
        "prompt_set": HELDOUT_SET,
        "families": args.families,
        "speedup_by_batch": {str(r["batch_size"]): round(r["speedup"], 3) for r in pooled},
        "cpu_speedup_by_batch": {str(r["batch_size"]): round(r["cpu_speedup"], 3)
                                 for r in pooled},
        "speedup_by_family": {f"{r['family']}@{r['batch_size']}": round(r["speedup"], 3)
                              for r in rows if r["family"] != "all"},
        "mean_acceptance_length": round(lengths[0], 3) if lengths else 1.0,
        "num_spec_tokens": args.num_spec_tokens,
        "command": _command(args),
        "rows": payload,
    }
    (BUILTIN_DRAFTER_DIR / BENCHMARK_FILE).write_text(json.dumps(record, indent=1) + "\n")


def _ratio(median: float, values: list[float]) -> str:
    if len(values) < 2:
        return f"{median:.2f}"
    return f"{median:.2f} ({min(values):.2f}-{max(values):.2f})"


def _print(payload: list[dict], args: argparse.Namespace) -> None:
    from speckv.drafters.heldout_prompts import HELDOUT_SET

    model = "built-in model" if args.model == "builtin" else args.model
    table = Table(title=f"greedy decode, {model} (fp32, {args.threads} thread), held-out "
                        f"prompt set {HELDOUT_SET} ({args.families}), {args.max_tokens} output "
                        f"tokens, up to {args.num_spec_tokens} drafts, {args.rounds} round(s), "
                        f"modes stepped in turn", title_justify="left")
    for column in ("B", "prompts", "mode", "tok/s", "x", "x cpu", "draft %", "AL", "acc. %",
                   "steps by k", "same"):
        table.add_column(column, justify="left" if column in ("mode", "prompts") else "right",
                         no_wrap=True)
    for i, row in enumerate(payload):
        length = row["mean_acceptance_length"]
        following = payload[i + 1] if i + 1 < len(payload) else None
        table.add_row(
            str(row["batch_size"]), f"{row['family']} ({row['num_prompts']})",
            LABELS[row["mode"]], f"{row['tokens_per_s']:.1f}",
            _ratio(row["speedup"], row["speedups"]),
            _ratio(row["cpu_speedup"], row["cpu_speedups"]),
            f"{100 * row['draft_share']:.1f}" if row["mode"] != "none" else "-",
            f"{length:.2f}" if length is not None else "-",
            "/".join(f"{100 * a:.0f}" for a in row["acceptance_by_position"]) or "-",
            "/".join(str(n) for n in row["steps_by_num_spec_tokens"]) or "-",
            "yes" if row["identical_to_no_spec"] else "NO",
            end_section=following is None or (following["batch_size"], following["family"])
            != (row["batch_size"], row["family"]),
        )
    console = Console(width=None if sys.stdout.isatty() else 150)  # a pipe: do not wrap at 80
    console.print(table)
    console.print("[dim]B: batch size. prompts: held-out family (distinct prompts); all: the "
                  "families pooled. EAGLE3 and n-gram choose their draft length per step "
                  "(adaptive); EAGLE3 k=S always drafts S. x: tokens/s over no spec's (wall "
                  "time), the median over the rounds (fresh engines each) and their range; "
                  "x cpu: the same by the process's CPU time. draft %: share of the mode's "
                  "CPU time spent in the proposer (draft-KV catch-up and drafting): what "
                  "speculation costs before any draft is accepted. AL: mean acceptance length, "
                  "tokens per verification step with drafts (accepted + 1). acc. %: share of "
                  "those steps that accepted draft 1, 2, ... steps by k: decode steps that "
                  "drafted k = 0, 1, ... tokens. same: greedy output equals no spec's.[/dim]")
