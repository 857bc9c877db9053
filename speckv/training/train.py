"""`speckv train-draft`: train the built-in EAGLE3 head (reduced draft vocabulary) on CPU.

Owns the whole recipe, each stage with its own wall-clock budget:

1. data (`--data-minutes`): the target answers a broad generated prompt set (chat, code,
   lists, maths, rewriting, facts; `prompts.py`), mostly greedy, a fifth with light sampling,
   then answers follow-up turns to a share of its own greedy answers (multi-turn). The engine
   generates with continuous batching in `--dtype` (speculation and prefix caching off) while
   a recording runner keeps the features the head reads (`distill.py`). The held-out prompts'
   greedy answers are generated too: they are the evaluation set and never train.
2. draft vocabulary (`--draft-vocab`): the K most frequent answer tokens of the training data
   (EAGLE3 `d2t`); `auto` picks the smallest K in `VOCAB_CHOICES` covering
   `--vocab-coverage` of the held-out answers (coverage caps acceptance, each extra 1,000
   rows costs the drafter's LM head time).
3. training (`--train-minutes`): EAGLE3 with training-time test. Step 1 reads the target's
   fused features; steps 2..`--ttt-steps` read the head's OWN previous output (as drafts 2..S
   do at inference) and attend to the real positions' draft KV plus their own earlier steps'
   keys. Loss: cross-entropy against the target's distribution over the draft vocabulary,
   steps weighted 1, 0.8, 0.64, ...; AdamW, in bfloat16 autocast where `--dtype` is
   bfloat16. The head starts as the target's last decoder layer over the high aux layer (so
   it first predicts what the target predicts one position earlier), its LM head as the
   target's rows of the draft vocabulary.
   Every `--eval-every` steps: held-out loss and per-step top-1 accuracy, from which the
   expected acceptance length 1 + p1 + p1 p2 + ... (the curve PNG).
4. evaluation: the real mean acceptance length with `--spec-tokens` drafts on the held-out
   prompts (greedy verification against the fp32 target, `evaluate.py`).
5. output: an EAGLE3 directory in the public layout (config.json with draft_vocab_size and
   eagle_aux_hidden_state_layer_ids, model.safetensors with d2t / t2d; no embeddings), the
   loss / acceptance curve PNG, train_summary.json and train_log.txt; `--install-asset`
   copies them to the package (`speckv/assets/smollm2-eagle3`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from speckv.drafters.builtin import BUILTIN_DRAFTER_DIR
from speckv.drafters.eagle3 import Eagle3Drafter
from speckv.drafters.loaders import build_drafter, load_drafter, save_drafter
from speckv.engine.sampling_params import SamplingParams
from speckv.models.base import TargetModel
from speckv.training.compute_dtype import CHOICES, training_dtype
from speckv.training.distill import (
    AUX_LAYERS,
    DistillSequence,
    answer_token_counts,
    chat_ids,
    coverage,
    draft_vocabulary,
    generate_sequences,
    load_sequences,
    save_sequences,
)
from speckv.training.evaluate import mean_acceptance_length, speculative_generate
from speckv.training.head_init import (
    aux_feature_scale,
    fold_aux_scale,
    init_from_head,
    init_from_target,
)
from speckv.training.prompts import FOLLOW_UPS, PROMPT_SETS, eval_prompts, train_prompts
from speckv.training.ttt import (
    Batch,
    expected_acceptance_length,
    heldout_metrics,
    make_batches,
    ttt_forward,
)

if TYPE_CHECKING:
    from speckv.models.common.tokenizer import Tokenizer

VOCAB_CHOICES: tuple[int, ...] = (2048, 4096, 8192, 16384)
Log = Callable[[str], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="eagle3-smollm2", help="output directory")
    parser.add_argument("--data-cache", default="",
                        help="safetensors file to reuse generated data from (written when "
                        "missing; its held-out part goes next to it as *.heldout.safetensors)")
    parser.add_argument("--data-minutes", type=float, default=45.0,
                        help="wall-clock budget of data generation")
    parser.add_argument("--train-minutes", type=float, default=30.0,
                        help="wall-clock budget of training")
    parser.add_argument("--prompts", default="base", choices=PROMPT_SETS,
                        help="training prompt set: base (the shipped head's), wide (base and "
                        "~4,100 more), new (only the additional ones: to continue a base head)")
    parser.add_argument("--max-prompts", type=int, default=0,
                        help="use at most this many training prompts (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=160, help="tokens per answer")
    parser.add_argument("--gen-batch", type=int, default=96, help="requests decoded together")
    parser.add_argument("--multi-turn", type=float, default=0.15,
                        help="share of greedy answers that get a follow-up turn")
    parser.add_argument("--draft-vocab", default="auto",
                        help=f"draft vocabulary size, or 'auto' (smallest of {VOCAB_CHOICES} "
                        "covering --vocab-coverage of the held-out answers)")
    parser.add_argument("--vocab-coverage", type=float, default=0.93,
                        help="held-out answer-token coverage 'auto' asks of the draft vocabulary")
    parser.add_argument("--ttt-steps", type=int, default=3,
                        help="drafting steps simulated in training (training-time test)")
    parser.add_argument("--batch-tokens", type=int, default=1536,
                        help="padded tokens per training step")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW peak learning rate")
    parser.add_argument("--feature-weight", type=float, default=0.0,
                        help="weight of EAGLE-1's feature regression next to the token loss")
    parser.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: time)")
    parser.add_argument("--eval-every", type=int, default=100, help="held-out eval period, steps")
    parser.add_argument("--spec-tokens", type=int, default=3, help="drafts per step in eval")
    parser.add_argument("--eval-prompts", type=int, default=24)
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--save-dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument("--install-asset", action="store_true",
                        help=f"also copy the head to {BUILTIN_DRAFTER_DIR} (package asset)")
    parser.add_argument("--init-from", default="",
                        help="continue training this EAGLE3 head (its draft vocabulary is "
                        "kept) instead of starting from the target's last layer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto", choices=CHOICES,
                        help="data generation and training dtype: auto takes bfloat16 only "
                        "where this CPU runs it clearly faster than float32 (timed at start)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1 is fastest on a shared CPU)")


# ---- 1. data ------------------------------------------------------------------------------------


def collect_data(
    model: TargetModel, tokenizer: Tokenizer, args: argparse.Namespace, log: Log
) -> tuple[list[DistillSequence], list[DistillSequence]]:
    """(training sequences, held-out sequences) generated by the target itself."""
    from tqdm.auto import tqdm

    start = time.monotonic()
    budget = args.data_minutes * 60.0
    rng = random.Random(args.seed)
    bar = tqdm(desc="generating data", unit="answer")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    heldout_texts = eval_prompts(args.eval_prompts)
    greedy = SamplingParams(max_tokens=args.eval_new_tokens)
    heldout = generate_sequences(
        model, tokenizer, [chat_ids(tokenizer, t) for t in heldout_texts],
        [greedy] * len(heldout_texts), max_num_seqs=args.gen_batch, progress=progress)
    log(f"held-out: {len(heldout)} greedy answers, {sum(len(s.answer) for s in heldout)} tokens")

    texts = train_prompts(args.seed, args.prompts)
    if args.max_prompts:
        texts = texts[: args.max_prompts]
    params = [
        SamplingParams(max_tokens=args.max_new_tokens, temperature=0.7, top_p=0.95,
                       seed=args.seed * 100_003 + i)
        if i % 5 == 4 else SamplingParams(max_tokens=args.max_new_tokens)
        for i in range(len(texts))
    ]
    first_deadline = start + budget * (1.0 - args.multi_turn)
    single = generate_sequences(
        model, tokenizer, [chat_ids(tokenizer, t) for t in texts], params,
        max_num_seqs=args.gen_batch, deadline=first_deadline, progress=progress)
    log(f"single turn: {len(single)} answers, {sum(len(s.tokens) for s in single)} tokens "
        f"({time.monotonic() - start:.0f} s)")

    # follow-up turns on the model's own greedy answers that ended with EOS
    eos = set(model.config.eos_token_ids)
    finished = [(text, seq) for text, seq, p in zip(texts, single, params)
                if p.greedy and seq.tokens[-1] in eos]
    rng.shuffle(finished)
    conversations = []
    for text, seq in finished[: int(len(single) * args.multi_turn)]:
        answer = tokenizer.decode(seq.answer[:-1], skip_special_tokens=True)
        conversations.append([
            {"role": "user", "content": text},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": rng.choice(FOLLOW_UPS)},
        ])
    multi = generate_sequences(
        model, tokenizer, [chat_ids(tokenizer, c) for c in conversations],
        [SamplingParams(max_tokens=args.max_new_tokens)] * len(conversations),
        max_num_seqs=args.gen_batch, deadline=start + budget, progress=progress)
    bar.close()
    data = single + multi
    log(f"data: {len(single)} single-turn + {len(multi)} multi-turn sequences, "
        f"{sum(len(s.tokens) for s in data)} tokens ({sum(len(s.answer) for s in data)} "
        f"answer tokens) in {time.monotonic() - start:.0f} s")
    return data, heldout


def load_or_collect(model, tokenizer, args, log: Log
                    ) -> tuple[list[DistillSequence], list[DistillSequence]]:
    cache = Path(args.data_cache) if args.data_cache else None
    heldout_path = cache.with_suffix(".heldout.safetensors") if cache is not None else None
    if cache is not None and cache.is_file() and heldout_path is not None \
            and heldout_path.is_file():
        data, heldout = load_sequences(cache), load_sequences(heldout_path)
        log(f"data: {len(data)} sequences ({sum(len(s.tokens) for s in data)} tokens) and "
            f"{len(heldout)} held-out from {cache}")
        return data, heldout
    data, heldout = collect_data(model, tokenizer, args, log)
    if cache is not None and heldout_path is not None:
        save_sequences(data, cache)
        save_sequences(heldout, heldout_path)
        log(f"data saved to {cache}")
    return data, heldout


# ---- 2. draft vocabulary ------------------------------------------------------------------------


def choose_vocab(data, heldout, args, eos_ids: Sequence[int], log: Log) -> list[int]:
    counts = answer_token_counts(data)
    log(f"answer tokens: {sum(counts.values())}, distinct {len(counts)}")
    table = {k: coverage(draft_vocabulary(counts, k, eos_ids), heldout) for k in VOCAB_CHOICES}
    log("held-out answer coverage by draft vocabulary size: "
        + ", ".join(f"{k}: {c:.4f}" for k, c in table.items()))
    if args.draft_vocab == "auto":
        size = next((k for k, c in table.items() if c >= args.vocab_coverage), VOCAB_CHOICES[-1])
    else:
        size = int(args.draft_vocab)
    log(f"draft vocabulary: {size} tokens")
    return draft_vocabulary(counts, size, eos_ids)


# ---- 3. training --------------------------------------------------------------------------------


def train(drafter: Eagle3Drafter, model: TargetModel, data, heldout, vocab, args,
          aux_scale: torch.Tensor, log: Log, dtype: torch.dtype = torch.float32) -> dict:
    from tqdm.auto import tqdm

    rng = random.Random(args.seed)
    target_head = model.lm_head.weight[torch.tensor(vocab)].detach().float()  # [K, H]
    weights = [0.8**u for u in range(args.ttt_steps)]
    params = [p for p in drafter.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    heldout_batches = [Batch([heldout[i] for i in idx])
                       for idx in make_batches(heldout, args.batch_tokens, rng)]
    history: dict[str, list] = {"step": [], "loss": [], "eval_step": [], "eval_loss": [],
                                "eval_acc": [], "eval_expected_al": []}

    def evaluate_now(step: int) -> None:
        drafter.eval()
        loss, acc = heldout_metrics(drafter, heldout_batches, target_head, args.ttt_steps,
                                    aux_scale, dtype)
        drafter.train()
        al = expected_acceptance_length(acc)
        history["eval_step"].append(step)
        history["eval_loss"].append(loss)
        history["eval_acc"].append(acc)
        history["eval_expected_al"].append(al)
        log(f"step {step}: held-out loss {loss:.3f}, top-1 by step "
            + " ".join(f"{a:.3f}" for a in acc) + f", expected acceptance length {al:.3f}")

    evaluate_now(0)
    start = time.monotonic()
    deadline = start + args.train_minutes * 60.0
    batches: list[list[int]] = []
    step = 0
    bar = tqdm(desc="training EAGLE3 head", unit="step", total=args.max_steps or None)
    drafter.train()
    while time.monotonic() < deadline and (not args.max_steps or step < args.max_steps):
        if not batches:
            batches = make_batches(data, args.batch_tokens, rng)
        batch = Batch([data[i] for i in batches.pop()])
        frac = (time.monotonic() - start) / (deadline - start)
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        lr = args.lr * min(1.0, (step + 1) / 30) * (0.1 + 0.9 * 0.5 * (1 + math.cos(
            math.pi * min(1.0, frac))))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            loss, _, _ = ttt_forward(drafter, batch, target_head, args.ttt_steps, weights,
                                     aux_scale, args.feature_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 5.0)
        opt.step()
        step += 1
        history["step"].append(step)
        history["loss"].append(float(loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss):.3f}", lr=f"{lr:.1e}")
        if step % args.eval_every == 0:
            evaluate_now(step)
    bar.close()
    if not history["eval_step"] or history["eval_step"][-1] != step:
        evaluate_now(step)
    for p in params:
        p.requires_grad_(False)
    drafter.eval()
    history["train_seconds"] = time.monotonic() - start
    history["train_steps"] = step
    log(f"trained {step} steps in {history['train_seconds']:.0f} s")
    return history


def save_curves(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    loss = history["loss"]
    k = 20
    smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1])
              for i in range(len(loss))]
    ax[0].plot(history["step"], smooth, label="train (weighted TTT loss, smoothed)")
    ax[0].plot(history["eval_step"], history["eval_loss"], "o-", label="held-out (mean step loss)")
    ax[0].set_title("cross-entropy vs the target's distribution")
    ax[0].set_xlabel("step")
    ax[0].legend()
    for u in range(len(history["eval_acc"][0]) if history["eval_acc"] else 0):
        ax[1].plot(history["eval_step"], [a[u] for a in history["eval_acc"]], "o-",
                   label=f"top-1, draft {u + 1}")
    ax[1].set_title("held-out: per-draft top-1 accuracy")
    ax[1].set_xlabel("step")
    twin = ax[1].twinx()
    twin.plot(history["eval_step"], history["eval_expected_al"], "k--",
              label="expected acceptance length")
    twin.set_ylabel("expected acceptance length")
    ax[1].legend(loc="lower left")
    twin.legend(loc="lower right")
    for a in ax:
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---- 4. evaluation ------------------------------------------------------------------------------


def evaluate(model, tokenizer, drafter, args, log: Log) -> tuple[float, list[float]]:
    """(mean acceptance length, per-position acceptance rate) with greedy verification."""
    from tqdm.auto import tqdm

    results = []
    for text in tqdm(eval_prompts(args.eval_prompts), desc="evaluating", unit="prompt"):
        results.append(speculative_generate(
            model, drafter, chat_ids(tokenizer, text), args.eval_new_tokens,
            args.spec_tokens, stop_token_ids=model.config.eos_token_ids))
    al = mean_acceptance_length(results)
    steps = [a for r in results for a in r.accepted_per_step]
    per_position = [sum(a >= j for a in steps) / max(1, len(steps))
                    for j in range(1, args.spec_tokens + 1)]
    log(f"mean acceptance length ({args.spec_tokens} drafts, greedy, {len(results)} held-out "
        f"prompts, {args.eval_new_tokens} tokens): {al:.3f}; draft j accepted in "
        + ", ".join(f"{p:.1%}" for p in per_position) + " of steps")
    return al, per_position


# ---- entry --------------------------------------------------------------------------------------


def _command_line(args: argparse.Namespace) -> str:
    """The `speckv train-draft` command line that repeats this run's recipe."""
    return ("speckv train-draft " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in sorted(vars(args).items())
        if k in ("data_minutes", "train_minutes", "draft_vocab", "ttt_steps", "lr",
                 "batch_tokens", "seed", "init_from", "dtype", "threads") and v != "")
        + (f" --prompts {args.prompts}" if args.prompts != "base" else "")
        + (f" --max-prompts {args.max_prompts}" if args.max_prompts else ""))


def run(args: argparse.Namespace) -> int:
    from speckv.models.llama.builtin import load_builtin_model

    if args.ttt_steps < 1 or args.spec_tokens < 1 or args.batch_tokens < 16:
        raise ValueError("--ttt-steps and --spec-tokens must be >= 1, --batch-tokens >= 16")
    t0 = time.monotonic()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:7.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    # data (and training) in bfloat16 only where this CPU runs it faster; evaluation on the
    # fp32 model
    dtype = training_dtype(args.dtype)
    log(f"computing in {str(dtype).removeprefix('torch.')} (--dtype {args.dtype})")
    data_model, tokenizer, _ = load_builtin_model(dtype, "cpu", progress=False)
    t_data = time.monotonic()
    data, heldout = load_or_collect(data_model, tokenizer, args, log)
    data_seconds = time.monotonic() - t_data
    del data_model
    model, tokenizer, _ = load_builtin_model(torch.float32, "cpu", progress=False)
    aux_scale = aux_feature_scale(data)
    if args.init_from:
        drafter, vocab = init_from_head(Path(args.init_from), model, aux_scale)
        log(f"continuing {args.init_from} (draft vocabulary: {len(vocab)} tokens)")
    else:
        vocab = choose_vocab(data, heldout, args, model.config.eos_token_ids, log)
        drafter = build_drafter("eagle3", model, draft_vocab_size=len(vocab),
                                aux_layers=AUX_LAYERS)
        assert isinstance(drafter, Eagle3Drafter)
        init_from_target(drafter, model, vocab, aux_scale)
    history = train(drafter, model, data, heldout, vocab, args, aux_scale, log, dtype)
    fold_aux_scale(drafter, aux_scale)
    save_drafter(drafter, out, dtype=args.save_dtype)
    save_curves(history, out / "loss_curve.png")
    # evaluate what was saved (fp16 weights back in the target's dtype)
    saved = load_drafter(out, model)
    al, per_position = evaluate(model, tokenizer, saved, args, log)
    size = (out / "model.safetensors").stat().st_size
    log(f"saved {out} ({size / 1e6:.2f} MB safetensors), total {time.monotonic() - t0:.0f} s")
    summary = {
        "method": "eagle3",
        "draft_vocab_size": len(vocab),
        "aux_layers_vllm": [i + 1 for i in AUX_LAYERS],
        "ttt_steps": args.ttt_steps,
        "acceptance_length": al,
        "acceptance_per_position": per_position,
        "spec_tokens": args.spec_tokens,
        "heldout_prompts": args.eval_prompts,
        "heldout_new_tokens": args.eval_new_tokens,
        "expected_acceptance_length_ttt": history["eval_expected_al"][-1],
        "train_steps": history["train_steps"],
        "train_seconds": round(history["train_seconds"]),
        "data_seconds": round(data_seconds),
        "data_sequences": len(data),
        "data_tokens": sum(len(s.tokens) for s in data),
        "dtype": str(dtype).removeprefix("torch."),
        "safetensors_bytes": size,
        "wall_seconds": round(time.monotonic() - t0),
        "command": _command_line(args),
    }
    previous = Path(args.init_from) / "train_summary.json" if args.init_from else None
    if previous is not None and previous.is_file():
        # the whole recipe: this run continues that one (its data and training time count)
        summary["continued_from"] = json.loads(previous.read_text())
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    if args.install_asset:
        _install_asset(out, log)
    return 0


def _install_asset(out: Path, log: Log) -> None:
    """Copy the trained head into the package: it becomes the built-in model's drafter."""
    BUILTIN_DRAFTER_DIR.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "train_summary.json", "loss_curve.png",
                 "train_log.txt"):
        shutil.copy2(out / name, BUILTIN_DRAFTER_DIR / name)
    log(f"installed the head as {BUILTIN_DRAFTER_DIR}")


def main() -> int:  # `python -m speckv.training.train`
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
