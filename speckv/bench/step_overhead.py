"""`speckv bench step-overhead`: the engine's host cost per step and per request-step.

Owns one measurement: `LLMEngine.step` on a one-layer toy Llama (hidden 64, vocabulary 512,
so the forward costs little) with prefix caching on, at several batch sizes, every request in
decode, split by phase:

    schedule   Scheduler.schedule
    prepare    ModelRunner.execute_model minus forward, sample, propose: block tables, input
               ids, positions, attention metadata
    forward    the target model's forward and logits (compute, not host overhead)
    sample     verification / sampling of every request
    propose    the drafter's host work (its module calls excluded: `draft fwd`)
    update     Scheduler.update_from_output: real tokens, block hashes, finishes
    output     OutputProcessor.process: detokenization (the built-in tokenizer when installed),
               RequestOutputs. The requests ask for their final output only, as
               `LLM.generate` does (`--stream`: an output every step, as a streaming server's)
    stats      Scheduler.take_stats

host = step - forward - draft fwd, per request-step in microseconds. Beside it, vLLM 0.33's
`Scheduler.schedule` + `update_from_output` (`vllm_scheduler_peer.py`) driven the same way in
the same process (same prompts, shared prefix hit, block size, batch, drafts per step), and
the ratio of speckv's schedule + update + stats to vLLM's. Drafters are random-init (their
drafts are all but always rejected; the draft length is fixed at `--num-spec-tokens`).

Timings are medians over `--rounds` rounds of `--steps` steps, speckv and vLLM rounds
interleaved, the cyclic garbage collector off while timing (as `timeit` does), in this
thread's CPU time by default (`--clock cpu`: on a shared machine the time spent waiting for a
core would otherwise swamp the figures; `--clock wall` for perf_counter).
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import RequestOutputKind, SamplingParams

PHASES = ("schedule", "prepare", "forward", "sample", "propose", "draft_fwd", "update",
          "output", "stats")
VOCAB_SIZE = 512
BLOCK_SIZE = 16
SHARED_PREFIX_TOKENS = 32  # every prompt starts with them: a prefix-cache hit at admission
MAX_MODEL_LEN = 4096
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.thread_time, "wall": time.perf_counter}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-sizes", default="1,16,64,256",
                        help="comma-separated running batch sizes")
    parser.add_argument("--drafter", default="none,eagle3",
                        help="comma-separated: none, eagle3, mtp (random-init drafters)")
    parser.add_argument("--num-spec-tokens", type=int, default=3,
                        help="drafts per request per step with a drafter")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (median kept)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM column")
    parser.add_argument("--no-detokenize", action="store_true",
                        help="no tokenizer (output processing without text)")
    parser.add_argument("--stream", action="store_true",
                        help="requests get an output (text decoded) every step, as streamed "
                             "ones do (default: the final output only, as LLM.generate's)")
    parser.add_argument("--clock", default="cpu", choices=sorted(CLOCKS),
                        help="cpu: this thread's CPU time (robust on a shared machine: time "
                             "spent waiting for a core is not counted); wall: perf_counter")


class PhaseTimer:
    """Wraps instance methods so their time adds up per phase (outermost call only)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.totals: dict[str, float] = defaultdict(float)
        self._depth: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)
        totals, depth, clock = self.totals, self._depth, self.clock

        def timed(*args: Any, **kwargs: Any) -> Any:
            if depth[phase]:
                return inner(*args, **kwargs)
            depth[phase] += 1
            begin = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[phase] += clock() - begin
                depth[phase] -= 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, float]:
        totals = dict(self.totals)
        self.totals.clear()
        return totals


@dataclass
class Row:
    drafter: str
    batch_size: int
    per_step_ms: float = 0.0
    host_us: float = 0.0  # per request-step
    phases_us: dict[str, float] = field(default_factory=dict)  # per request-step
    vllm_us: float | None = None  # vLLM schedule + update, per request-step
    vllm_schedule_us: float | None = None
    vllm_update_us: float | None = None


def _prompts(batch_size: int, prompt_len: int, seed: int) -> tuple[list[int], list[list[int]]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB_SIZE) for _ in range(SHARED_PREFIX_TOKENS)]
    prompts = [prefix + [rng.randrange(3, VOCAB_SIZE)
                         for _ in range(max(1, prompt_len - SHARED_PREFIX_TOKENS))]
               for _ in range(batch_size)]
    return prefix + [3] * BLOCK_SIZE, prompts


def _toy_model() -> Any:
    from speckv.models.llama.tiny import tiny_model

    return tiny_model(1234, 0.2, vocab_size=VOCAB_SIZE, num_hidden_layers=1,
                      max_position_embeddings=MAX_MODEL_LEN)


def _drafter(name: str, model: Any) -> Any:
    if name == "none":
        return None
    from speckv.drafters.loaders import random_drafter

    if name == "eagle3":
        return random_drafter("eagle3", model, init_std=0.2, seed=5, aux_layers=(0, 0, 0))
    if name == "mtp":
        return random_drafter("mtp", model, init_std=0.2, seed=5, num_modules=1)
    raise ValueError(f"--drafter: unknown drafter {name!r} (none, eagle3, mtp)")


class SpeckvSide:
    """One engine with `batch_size` requests in decode, its phases instrumented."""

    def __init__(self, model: Any, tokenizer: Any, drafter_name: str, batch_size: int,
                 prompts: list[list[int]], primer: list[int], num_spec_tokens: int,
                 max_tokens: int, num_blocks: int, max_num_batched_tokens: int,
                 clock: Callable[[], float], stream: bool = False) -> None:
        drafter = _drafter(drafter_name, model)
        spec: dict[str, Any] = {}
        if drafter is not None:
            spec = dict(speculative_method=drafter.policy.name,
                        num_spec_tokens=num_spec_tokens, adaptive_speculation=False)
        config = engine_config(block_size=BLOCK_SIZE, num_blocks=num_blocks,
                               max_num_seqs=batch_size,
                               max_num_batched_tokens=max_num_batched_tokens,
                               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
                               hash_seed="0", **spec)
        self.engine = engine = LLMEngine(model, config, tokenizer=tokenizer, drafter=drafter)
        self.batch_size = batch_size
        # the primer's blocks are cached when it finishes: every prompt then hits the prefix
        engine.add_request(primer, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=(
            RequestOutputKind.CUMULATIVE if stream else RequestOutputKind.FINAL_ONLY))
        for prompt in prompts:
            engine.add_request(prompt, params)
        self.timer = timer = PhaseTimer(clock)
        runner, scheduler = engine.runner, engine.scheduler
        timer.wrap(scheduler, "schedule", "schedule")
        timer.wrap(runner, "execute_model", "runner")
        timer.wrap(runner.model, "forward", "forward")
        timer.wrap(runner.model, "compute_logits", "forward")
        timer.wrap(runner.sampler, "sample", "sample")
        timer.wrap(runner, "_propose", "propose")
        timer.wrap(scheduler, "update_from_output", "update")
        timer.wrap(engine.output_processor, "process", "output")
        timer.wrap(scheduler, "take_stats", "stats")
        if drafter is not None:
            timer.wrap(drafter, "first_hidden", "draft_fwd")
            for module in drafter.modules_chain:
                for name in ("forward", "write_kv", "draft_token_ids"):
                    timer.wrap(module, name, "draft_fwd")

    def in_decode(self) -> bool:
        scheduler = self.engine.scheduler
        return (len(scheduler.running) == self.batch_size and not scheduler.waiting
                and all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running))

    def step(self) -> None:
        self.engine.step()


def _time_speckv(ours: SpeckvSide, steps: int, clock: Any,
                 rounds: dict[str, list[float]]) -> None:
    """One timed round of speckv's steps: seconds per step, in all and by phase."""
    begin = clock()
    for _ in range(steps):
        ours.step()
    elapsed = clock() - begin
    totals = ours.timer.take()
    rounds["step"].append(elapsed / steps)
    for phase in ("schedule", "forward", "sample", "propose", "draft_fwd",
                  "update", "output", "stats"):
        rounds[phase].append(totals.get(phase, 0.0) / steps)
    rounds["prepare"].append((totals.get("runner", 0.0) - totals.get(
        "forward", 0.0) - totals.get("sample", 0.0) - totals.get(
        "propose", 0.0)) / steps)
    rounds["propose"][-1] -= totals.get("draft_fwd", 0.0) / steps


def _time_vllm(peer: Any, steps: int, rounds: dict[str, list[float]]) -> None:
    """One timed round of vLLM's scheduler: schedule and update seconds per step."""
    schedule = update = 0.0
    for _ in range(steps):
        times = peer.step()
        schedule += times.schedule_s
        update += times.update_s
    rounds["vllm_schedule"].append(schedule / steps)
    rounds["vllm_update"].append(update / steps)


def _measure(args: argparse.Namespace, model: Any, tokenizer: Any, vllm: dict[str, Any] | None,
             drafter_name: str, batch_size: int) -> Row:
    """One batch size: warm-up, then the timed rounds split by phase, speckv and vLLM's
    scheduler alternated (`_time_speckv`, `_time_vllm`)."""
    k = args.num_spec_tokens if drafter_name != "none" else 0
    total_steps = 4 + args.rounds * (args.steps + 1)
    max_tokens = (total_steps + 64) * (1 + k)
    num_blocks = batch_size * (-(-(args.prompt_len + max_tokens + k + 1) // BLOCK_SIZE) + 1) + 16
    max_batched = max(2048, batch_size * (1 + k))
    primer, prompts = _prompts(batch_size, args.prompt_len, seed=batch_size)
    clock = CLOCKS[args.clock]
    ours = SpeckvSide(model, tokenizer, drafter_name, batch_size, prompts, primer, k,
                      max_tokens, num_blocks, max_batched, clock, args.stream)
    peer = None
    if vllm is not None:
        from speckv.bench.vllm_scheduler_peer import VllmSchedulerPeer

        peer = VllmSchedulerPeer(vllm, [], block_size=BLOCK_SIZE, num_blocks=num_blocks,
                                 max_num_seqs=batch_size, max_num_batched_tokens=max_batched,
                                 max_model_len=MAX_MODEL_LEN, num_spec_tokens=k,
                                 max_tokens=max_tokens, vocab_size=VOCAB_SIZE, clock=clock)
        peer.add(primer, max_tokens=1)
        while peer.has_unfinished():
            peer.step()
        for prompt in prompts:
            peer.add(prompt)
    # prefill, then a few decode steps of warm-up
    for _ in range(200):
        if ours.in_decode():
            break
        ours.step()
    for _ in range(200):
        if peer is None or peer.in_decode(batch_size):
            break
        peer.step()
    for _ in range(4):
        ours.step()
        if peer is not None:
            peer.step()
    ours.timer.take()
    rounds: dict[str, list[float]] = defaultdict(list)
    was_enabled = gc.isenabled()
    try:
        for round_index in range(args.rounds):
            sides = ["speckv", "vllm"] if round_index % 2 == 0 else ["vllm", "speckv"]
            for side in sides:
                gc.collect()
                gc.disable()
                if side == "speckv":
                    _time_speckv(ours, args.steps, clock, rounds)
                elif peer is not None:
                    _time_vllm(peer, args.steps, rounds)
                gc.enable()
    finally:
        if not was_enabled:
            gc.disable()
        if peer is not None:
            peer.close()
    med = {name: statistics.median(values) for name, values in rounds.items()}
    per_req = 1e6 / batch_size
    row = Row(drafter_name, batch_size)
    row.per_step_ms = 1e3 * med["step"]
    row.host_us = (med["step"] - med["forward"] - med["draft_fwd"]) * per_req
    row.phases_us = {phase: med[phase] * per_req for phase in PHASES}
    if "vllm_schedule" in med:
        row.vllm_schedule_us = med["vllm_schedule"] * per_req
        row.vllm_update_us = med["vllm_update"] * per_req
        row.vllm_us = row.vllm_schedule_us + row.vllm_update_us
    return row


def _table(rows: list[Row], title: str) -> Table:
    table = Table(title=title)
    for column in ("drafter", "batch", "step ms", "host µs/req", *PHASES, "vLLM sched+upd",
                   "speckv sched+upd+stats", "vLLM / speckv"):
        table.add_column(column, justify="right")
    for row in rows:
        ours_sched = (row.phases_us["schedule"] + row.phases_us["update"]
                      + row.phases_us["stats"])
        vllm_cells = ["skipped", f"{ours_sched:.1f}", "-"]
        if row.vllm_us is not None:
            vllm_cells = [f"{row.vllm_us:.1f} ({row.vllm_schedule_us:.1f}+"
                          f"{row.vllm_update_us:.1f})", f"{ours_sched:.1f}",
                          f"{row.vllm_us / ours_sched:.2f}"]
        table.add_row(row.drafter, str(row.batch_size), f"{row.per_step_ms:.2f}",
                      f"{row.host_us:.1f}", *(f"{row.phases_us[p]:.1f}" for p in PHASES),
                      *vllm_cells)
    return table


def run(args: argparse.Namespace) -> int:
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got "
                         f"{args.batch_sizes!r}") from None
    if not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("--batch-sizes must name at least one batch size >= 1")
    drafters = [d.strip() for d in args.drafter.split(",") if d.strip()]
    for name in drafters:
        if name not in ("none", "eagle3", "mtp"):
            raise ValueError(f"--drafter: unknown drafter {name!r} (none, eagle3, mtp)")
    if args.steps < 1 or args.rounds < 1 or args.num_spec_tokens < 1 or args.prompt_len < 1:
        raise ValueError("--steps, --rounds, --num-spec-tokens and --prompt-len must be >= 1")
    torch.set_num_threads(args.threads)
    console = Console(width=240)
    vllm = None
    if not args.no_vllm:
        from speckv.bench.vllm_scheduler_peer import load

        vllm, reason = load()
        if vllm is None:
            console.print(f"vLLM column skipped: {reason}; install vLLM 0.33 next to speckv in "
                          "a scratch environment (the wheel with --no-deps beside torch 2.13 "
                          "CPU) to compare side by side.")
    tokenizer = None
    if not args.no_detokenize:
        from speckv.models.llama.builtin import builtin_tokenizer

        tokenizer = builtin_tokenizer(progress=False)
        if tokenizer is None:
            console.print("no built-in tokenizer installed: output processing without text")
    model = _toy_model()
    rows = []
    for drafter_name in drafters:
        for batch_size in batch_sizes:
            rows.append(_measure(args, model, tokenizer, vllm, drafter_name, batch_size))
            row = rows[-1]
            console.print(f"{drafter_name}, batch {batch_size}: {row.per_step_ms:.2f} ms/step, "
                          f"host {row.host_us:.1f} µs per request-step")
    title = (f"step overhead, µs per request-step (phases), one-layer toy model, prefix caching "
             f"on, {args.threads} thread(s), {args.clock} time; medians of {args.rounds} rounds "
             f"x {args.steps} steps, "
             + ("an output every step" if args.stream else "final outputs only")
             + (f"; vLLM {vllm['version']} scheduler in the same process" if vllm else ""))
    console.print(_table(rows, title))
    return 0
