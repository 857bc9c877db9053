"""`speckv train-draft`: train an EAGLE head for the built-in SmolLM2-135M-Instruct on CPU.

Owns the whole recipe, within a wall-clock budget (`--minutes`, default 14):
1. self-distillation data: the target answers varied chat prompts (greedy, a third with light
   sampling), batched over the paged cache; its post-norm hidden state at every position is
   recorded as it decodes (no second pass);
2. training fc + the decoder layer with the EAGLE losses: smooth-L1 between the drafter's output
   at p and the target feature at p + 1, plus cross-entropy against the target's token
   distribution at p + 1 (softmax of its LM head), restricted to the vocabulary seen in the data
   (cheap on CPU; the LM head stays the target's, shared and frozen);
3. evaluation: mean acceptance length with `--spec-tokens` drafts on held-out prompts, greedy
   verification (`evaluate.speculative_generate`);
4. output: HF-format dir (config.json + model.safetensors, public EAGLE names, no embedding or
   LM head stored), a loss curve PNG, and optionally the shipped asset (`--install-asset`).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from speckv.attention import AttentionMetadata
from speckv.drafters.builtin import BUILTIN_EAGLE_DIR
from speckv.drafters.eagle import EagleDrafter
from speckv.drafters.evaluate import mean_acceptance_length, speculative_generate
from speckv.drafters.loaders import build_drafter, save_drafter
from speckv.drafters.prompts import eval_prompts, train_prompts
from speckv.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from speckv.models.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="eagle-smollm2", help="output dir (HF format)")
    parser.add_argument("--minutes", type=float, default=14.0, help="total wall-clock budget")
    parser.add_argument("--max-steps", type=int, default=0, help="stop training after N steps")
    parser.add_argument(
        "--gen-fraction",
        type=float,
        default=0.3,
        help="share of the budget spent generating training data",
    )
    parser.add_argument("--max-new-tokens", type=int, default=160, help="tokens per answer")
    parser.add_argument("--gen-batch", type=int, default=64, help="requests decoded together")
    parser.add_argument("--batch-tokens", type=int, default=1536, help="tokens per train step")
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--ce-weight", type=float, default=0.1, help="weight of the token loss")
    parser.add_argument(
        "--noise",
        type=float,
        default=0.0,
        help="uniform noise U(-a, a) on input features (EAGLE: robustness to its own errors)",
    )
    parser.add_argument(
        "--unroll",
        type=int,
        default=1,
        help="drafting steps simulated in training (2+: later steps read the head's own "
        "predicted features, as drafts 2..S do; each costs one more forward)",
    )
    parser.add_argument("--spec-tokens", type=int, default=3, help="drafts per step in eval")
    parser.add_argument("--eval-prompts", type=int, default=8)
    parser.add_argument("--eval-new-tokens", type=int, default=96)
    parser.add_argument("--save-dtype", default="float16", choices=("float16", "bfloat16"))
    parser.add_argument(
        "--install-asset",
        action="store_true",
        help=f"also copy the head to {BUILTIN_EAGLE_DIR} (package asset)",
    )
    parser.add_argument(
        "--data-cache",
        default="",
        help="file to reuse generated data from (written if missing; safetensors, no pickle)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch default; 1 is fastest on a shared CPU)",
    )


# ---- 1. data ------------------------------------------------------------------------------------


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of `text` as one user turn of the chat template (training and evaluation)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return tokenizer.encode(prompt, add_special_tokens=False)


@torch.inference_mode()
def generate_batch(
    model: LlamaForCausalLM,
    prompts: list[list[int]],
    max_new_tokens: int,
    temperature: float,
    stop_ids: tuple[int, ...],
    gen: torch.Generator,
    block_size: int = 16,
) -> list[tuple[list[int], torch.Tensor]]:
    """Decode all prompts together; per request (tokens, features [len(tokens) - 1, hidden]).

    features[p] is the target's post-norm hidden state at position p (computed when token p was
    fed), so the last token has none.
    """
    n = len(prompts)
    lens = [len(p) + max_new_tokens for p in prompts]
    blocks = [-(-x // block_size) for x in lens]
    tables, nxt = [], 1
    for b in blocks:
        tables.append(list(range(nxt, nxt + b)))
        nxt += b
    kv = model.make_kv_cache(nxt, block_size)
    toks = [list(p) for p in prompts]
    feats: list[list[torch.Tensor]] = [[] for _ in range(n)]
    live = list(range(n))
    fed = [0] * n
    while live:
        q = [len(toks[i]) - fed[i] for i in live]
        s = [len(toks[i]) for i in live]
        md = AttentionMetadata.build(q, s, [tables[i] for i in live], block_size, model.device)
        ids = torch.tensor([t for i in live for t in toks[i][fed[i] :]], dtype=torch.int64)
        hidden = model(ids, md.positions(), kv, md).hidden_states  # [num_tokens, hidden]
        ends = torch.tensor(q).cumsum(0) - 1
        logits = model.compute_logits(hidden[ends])  # [num_live, vocab]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, -1)
            picks = torch.multinomial(probs, 1, generator=gen)[:, 0].tolist()
        else:
            picks = logits.argmax(-1).tolist()
        o = 0
        still = []
        for i, qi, tok in zip(live, q, picks):
            feats[i].append(hidden[o : o + qi].clone())
            o += qi
            fed[i] = len(toks[i])
            toks[i].append(int(tok))
            if tok not in stop_ids and len(toks[i]) < lens[i]:
                still.append(i)
        live = still
    return [(toks[i], torch.cat(feats[i])) for i in range(n)]


def collect_data(
    model, tokenizer, args, deadline: float, log
) -> list[tuple[list[int], torch.Tensor]]:
    from tqdm.auto import tqdm

    rng = random.Random(args.seed)
    texts = train_prompts()
    rng.shuffle(texts)
    gen = torch.Generator().manual_seed(args.seed)
    stop = tuple(model.config.eos_token_ids)
    data: list[tuple[list[int], torch.Tensor]] = []
    bar = tqdm(total=len(texts), desc="generating data", unit="prompt")
    for b0 in range(0, len(texts), args.gen_batch):
        if time.monotonic() > deadline:
            break
        chunk = texts[b0 : b0 + args.gen_batch]
        ids = [chat_ids(tokenizer, t) for t in chunk]
        temperature = 0.6 if (b0 // args.gen_batch) % 3 == 2 else 0.0
        data += generate_batch(model, ids, args.max_new_tokens, temperature, stop, gen)
        bar.update(len(chunk))
        bar.set_postfix(tokens=sum(len(t) for t, _ in data))
    bar.close()
    log(f"data: {len(data)} sequences, {sum(len(t) for t, _ in data)} tokens")
    return data


def save_data(data: list[tuple[list[int], torch.Tensor]], path: Path) -> None:
    """Sequences as safetensors: tokens_i (int64) and feats_i (fp32) per sequence."""
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {}
    for i, (toks, feats) in enumerate(data):
        state[f"tokens_{i}"] = torch.tensor(toks, dtype=torch.int64)
        state[f"feats_{i}"] = feats.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))


def load_data(path: Path) -> list[tuple[list[int], torch.Tensor]]:
    from safetensors.torch import load_file

    state = load_file(str(path))
    n = sum(1 for k in state if k.startswith("tokens_"))
    return [(state[f"tokens_{i}"].tolist(), state[f"feats_{i}"]) for i in range(n)]


# ---- 2. training --------------------------------------------------------------------------------


def init_from_target(drafter: EagleDrafter, model: LlamaForCausalLM) -> None:
    """Start as the identity map h[p] -> h[p] (a cheap first guess of the next feature).

    fc = [~0 | I] passes the target feature through; the decoder layer starts from the target's
    last layer (a useful basis) with its two output projections zeroed, so its residual branches
    add nothing until trained (a copied, live layer applied to post-norm features started at
    feature loss ~38 in our runs; the identity starts at ~0.73, the distance between
    consecutive target features).
    """
    m = drafter.module
    src = model.layers[-1]
    with torch.no_grad():
        m.layer.self_attn.load_state_dict(src.self_attn.state_dict())
        m.layer.mlp.load_state_dict(src.mlp.state_dict())
        m.layer.post_attention_layernorm.load_state_dict(src.post_attention_layernorm.state_dict())
        m.layer.self_attn.o_proj.weight.zero_()
        m.layer.mlp.down_proj.weight.zero_()
        h = model.config.hidden_size
        m.fc.weight[:, h:] = torch.eye(h)
        m.fc.weight[:, :h].normal_(0.0, 0.01)
        if m.fc.bias is not None:
            m.fc.bias.zero_()


def make_batches(data, batch_tokens: int, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(data)), key=lambda i: len(data[i][0]))
    batches, cur, cur_max = [], [], 0
    for i in order:
        L = len(data[i][0])
        if cur and max(cur_max, L) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, L)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def batch_tensors(data, idx: list[int]):
    """Padded (ids t[p+1], feats f[p], target f[p+1], mask) for p in 0 .. len - 3."""
    T = max(len(data[i][0]) for i in idx) - 2
    h = data[idx[0]][1].shape[1]
    ids = torch.zeros(len(idx), T, dtype=torch.int64)
    x = torch.zeros(len(idx), T, h)
    y = torch.zeros(len(idx), T, h)
    mask = torch.zeros(len(idx), T, dtype=torch.bool)
    for b, i in enumerate(idx):
        toks, f = data[i]
        n = len(toks) - 2  # positions p with f[p + 1] known (f has len(toks) - 1 rows)
        ids[b, :n] = torch.tensor(toks[1 : n + 1])
        x[b, :n] = f[:n]
        y[b, :n] = f[1 : n + 1]
        mask[b, :n] = True
    return ids, x, y, mask


def train(drafter: EagleDrafter, model, data, args, deadline: float, log):
    from tqdm.auto import tqdm

    rng = random.Random(args.seed)
    vocab = sorted({t for toks, _ in data for t in toks})
    w_sub = model.lm_head.weight[vocab].detach().float()  # [|V'|, hidden]
    log(f"train vocabulary: {len(vocab)} tokens")
    m = drafter.module
    m.requires_grad_(True)
    params = list(m.parameters())  # the target's embedding / LM head are not m's parameters
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    steps_hint = args.max_steps or 10**9
    start = time.monotonic()
    losses: list[tuple[int, float, float, float]] = []  # step, total, feature, token
    batches: list[list[int]] = []
    bar = tqdm(desc="training EAGLE head", unit="step", total=args.max_steps or None)
    step = 0
    while step < steps_hint and time.monotonic() < deadline:
        if not batches:
            batches = make_batches(data, args.batch_tokens, rng)
        idx = batches.pop()
        ids, x, y, mask = batch_tensors(data, idx)
        pos = torch.arange(ids.shape[1])
        # LR: short warmup, then cosine by elapsed share of the budget.
        frac = min(1.0, (time.monotonic() - start) / max(1.0, deadline - start))
        if args.max_steps:
            frac = max(frac, step / args.max_steps)
        lr = (
            args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        if args.noise > 0:  # the drafter later reads its own, imperfect features
            x = x + (torch.rand_like(x) * 2 - 1) * args.noise
        loss = x.new_zeros(())
        feat_loss = tok_loss = x.new_zeros(())
        out = x
        for u in range(args.unroll):
            if u > 0:  # step u reads the previous step's prediction of its feature
                x, ids, y, mask = out[:, :-1], ids[:, 1:], y[:, 1:], mask[:, 1:]
                pos = pos[1:]
            out, _, _ = m.dense_forward(ids, x, pos)  # [b, T - u, hidden]
            o, tgt = out[mask], y[mask]  # [m, hidden]
            fl = F.smooth_l1_loss(o, tgt)
            with torch.no_grad():
                p_t = torch.softmax(tgt @ w_sub.T, -1)  # target distribution over V'
            tl = -(p_t * torch.log_softmax(o @ w_sub.T, -1)).sum(-1).mean()
            loss = loss + (0.5**u) * (fl + args.ce_weight * tl)
            if u == 0:
                feat_loss, tok_loss = fl, tl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        losses.append((step, float(loss), float(feat_loss), float(tok_loss)))
        bar.update(1)
        bar.set_postfix(
            loss=f"{float(loss):.3f}", feat=f"{float(feat_loss):.3f}", tok=f"{float(tok_loss):.3f}"
        )
    bar.close()
    m.requires_grad_(False)
    log(f"trained {step} steps in {time.monotonic() - start:.0f} s")
    return losses


def save_loss_curve(losses, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not losses:
        return
    steps = [s for s, *_ in losses]

    def smooth(v: list[float], k: int = 10) -> list[float]:
        return [
            sum(v[max(0, i - k + 1) : i + 1]) / len(v[max(0, i - k + 1) : i + 1])
            for i in range(len(v))
        ]

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(steps, smooth([f for _, _, f, _ in losses]))
    ax[0].set_title("feature loss (smooth L1)")
    ax[1].plot(steps, smooth([t for *_, t in losses]))
    ax[1].set_title("token loss (CE vs target distribution)")
    for a in ax:
        a.set_xlabel("step")
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- 3. evaluation ------------------------------------------------------------------------------


def evaluate(model, tokenizer, drafter, args, log) -> float:
    from tqdm.auto import tqdm

    results = []
    for text in tqdm(eval_prompts(args.eval_prompts), desc="evaluating", unit="prompt"):
        results.append(
            speculative_generate(
                model,
                drafter,
                chat_ids(tokenizer, text),
                args.eval_new_tokens,
                args.spec_tokens,
                stop_token_ids=model.config.eos_token_ids,
            )
        )
    al = mean_acceptance_length(results)
    log(
        f"mean acceptance length ({args.spec_tokens} spec tokens, greedy, "
        f"{len(results)} held-out prompts): {al:.3f}"
    )
    return al


# ---- entry --------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    from speckv.models.builtin import load_builtin_model

    t0 = time.monotonic()
    budget = args.minutes * 60.0
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_lines: list[str] = []

    def log(msg: str) -> None:
        line = f"[{time.monotonic() - t0:6.1f}s] {msg}"
        print(line, flush=True)
        log_lines.append(line)

    model, tokenizer, _ = load_builtin_model(torch.float32, "cpu")
    cache = Path(args.data_cache) if args.data_cache else None
    if cache is not None and cache.is_file():
        data = load_data(cache)
        log(f"data: {len(data)} sequences from {cache}")
    else:
        data = collect_data(model, tokenizer, args, t0 + budget * args.gen_fraction, log)
        if cache is not None:
            save_data(data, cache)
    drafter = build_drafter("eagle", model)  # EAGLE-1 layout: no input layernorm, fc bias
    assert isinstance(drafter, EagleDrafter)
    init_from_target(drafter, model)
    # Leave time for evaluation (~ 10 % of the budget, at least 60 s).
    eval_reserve = max(60.0, 0.1 * budget)
    losses = train(drafter, model, data, args, t0 + budget - eval_reserve, log)
    drafter.eval()
    save_drafter(drafter, out, dtype=args.save_dtype)
    save_loss_curve(losses, out / "loss_curve.png")
    al = evaluate(model, tokenizer, drafter, args, log)
    size = (out / "model.safetensors").stat().st_size
    log(f"saved {out} ({size / 1e6:.2f} MB safetensors), total {time.monotonic() - t0:.0f} s")
    summary = {
        "acceptance_length": al,
        "spec_tokens": args.spec_tokens,
        "train_steps": len(losses),
        "final_loss": losses[-1][1] if losses else None,
        "data_tokens": sum(len(t) for t, _ in data),
        "safetensors_bytes": size,
        "wall_seconds": time.monotonic() - t0,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1))
    (out / "train_log.txt").write_text("\n".join(log_lines) + "\n")
    if args.install_asset:
        BUILTIN_EAGLE_DIR.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors", "train_summary.json", "loss_curve.png"):
            if (out / f).exists():
                shutil.copy2(out / f, BUILTIN_EAGLE_DIR / f)
        log(f"installed the head as {BUILTIN_EAGLE_DIR}")
    return 0


def main() -> int:  # `python -m speckv.drafters.train`
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    raise SystemExit(main())
