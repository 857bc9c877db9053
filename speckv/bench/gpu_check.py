"""The GPU check (`scripts/gpu_check.sh`): a real-shaped random model through the engine on CUDA.

Owns one prepared run for a CUDA machine, not part of CI: a random-init Llama of Llama-3-8B's
layout (hidden 4096, 32 query / 8 KV heads, MLP 14,336, vocabulary 128,256, rope theta
500,000) with a few layers, and a random EAGLE3 head on it, checked three ways:
1. greedy outputs of the engine with EAGLE3 equal transformers' greedy `generate` on the same
   weights (saved and loaded as an HF directory);
2. a repeated prompt's hit KV blocks equal a fresh engine's cold KV of the same blocks;
3. output tokens/s of the engine beside transformers' batched `generate` on the same prompts.
Without CUDA it stops at once with a message that says so. `--device cpu` runs the same
three steps on a tiny shape (seconds), which is what the tests run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

LLAMA3_8B_LAYOUT: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, rope_theta=500000.0, rms_norm_eps=1e-5,
    max_position_embeddings=8192)
TINY_LAYOUT: dict[str, Any] = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512)
NO_CUDA = ("scripts/gpu_check.sh needs a CUDA GPU: torch.cuda.is_available() is False on this "
           "machine (torch {version}). Run it on a GPU machine, or pass --device cpu for the "
           "tiny CPU rehearsal of the same steps.")


@dataclass(frozen=True)
class GpuCheckResult:
    device: str
    layout: str  # e.g. "Llama-3-8B layout, 4 layers, float32"
    greedy_equal: bool
    first_mismatch: str  # "" when equal
    mean_acceptance_length: float | None
    hit_tokens: int
    hit_kv_max_abs_diff: float
    engine_tok_s: float
    hf_tok_s: float

    @property
    def passed(self) -> bool:
        return self.greedy_equal and self.hit_tokens > 0 and self.hit_kv_max_abs_diff == 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def build_pair(device: torch.device, layers: int, dtype: str, scratch: str):
    """(our model, transformers' model) on the same random weights, and the layout's label."""
    from transformers import LlamaForCausalLM as HFLlama

    from speckv.models import LlamaForCausalLM, ModelConfig
    from speckv.models.llama.loader import save_hf_dir

    tiny = device.type == "cpu"
    shape = TINY_LAYOUT if tiny else LLAMA3_8B_LAYOUT
    config = ModelConfig(**shape, num_hidden_layers=layers, torch_dtype=dtype)
    torch.manual_seed(0)
    # init std 0.2 on the tiny shape (peaked logits, no argmax ties), 0.02 (HF's) on the real one
    model = LlamaForCausalLM.from_config(config, dtype, device, init_std=0.2 if tiny else 0.02)
    save_hf_dir(scratch, config, model.state_dict().items(), dtype=dtype)
    hf = HFLlama.from_pretrained(scratch, dtype=getattr(torch, dtype)).to(device).eval()
    label = "tiny layout" if tiny else "Llama-3-8B layout"
    return model, hf, f"{label}, {layers} layers, {dtype}"


def _engine(model: Any, drafter: Any, num_blocks: int, block_size: int = 16) -> Any:
    from speckv.engine.engine_args import engine_config
    from speckv.engine.llm_engine import LLMEngine

    method = "eagle3" if drafter is not None else None
    extra = {"speculative_method": method, "num_spec_tokens": 3} if method else {}
    return LLMEngine(model, engine_config(block_size=block_size, num_blocks=num_blocks,
                                          max_num_seqs=64, **extra), drafter=drafter)


def _run(engine: Any, prompts: list[list[int]], new_tokens: int) -> list[Any]:
    from speckv.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    finals: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finals[i] for i in ids]


@torch.inference_mode()
def _hf_greedy(hf: Any, prompts: list[list[int]], new_tokens: int,
               device: torch.device) -> tuple[list[list[int]], float]:
    """transformers' batched greedy generate (left padding), and its seconds."""
    width = max(map(len, prompts))
    ids = torch.zeros((len(prompts), width), dtype=torch.int64, device=device)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    _sync(device)
    start = time.perf_counter()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    _sync(device)
    return out[:, width:].tolist(), time.perf_counter() - start


def _hit_kv(model: Any, prompt: list[int], block_size: int = 16) -> tuple[int, float]:
    """(hit tokens of a repeated prompt, max |hit KV - a fresh engine's cold KV|)."""
    def kv(engine: Any, request_id: str, blocks: int) -> torch.Tensor:
        block_ids = engine.manager.get_block_ids(request_id)[0][:blocks]
        return engine.runner.kv_cache.storage[:, :, block_ids].float().cpu()

    warm = _engine(model, None, 64, block_size)
    _run(warm, [prompt], 2)
    from speckv.engine.sampling_params import SamplingParams

    warm.add_request(prompt, SamplingParams(max_tokens=2), "again")
    (out,) = warm.step()
    blocks = out.num_cached_tokens // block_size
    cold = _engine(model, None, 64, block_size)
    cold.add_request(prompt, SamplingParams(max_tokens=2), "cold")
    cold.step()
    diff = (kv(warm, "again", blocks) - kv(cold, "cold", blocks)).abs().max().item() \
        if blocks else float("inf")
    return out.num_cached_tokens, diff


def run_check(device_name: str, layers: int, dtype: str, num_prompts: int, prompt_len: int,
              new_tokens: int) -> GpuCheckResult:
    from speckv.drafters.loaders import random_drafter

    device = torch.device(device_name)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as scratch:
        model, hf, label = build_pair(device, layers, dtype, scratch)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(num_prompts)]
    aux = (0, layers // 2, layers - 1)
    drafter = random_drafter("eagle3", model, init_std=0.2 if device.type == "cpu" else 0.02,
                             seed=3, aux_layers=aux)
    blocks = num_prompts * (-(-(prompt_len + new_tokens + 8) // 16)) + 16
    engine = _engine(model, drafter, blocks)
    _run(engine, prompts[:1], 4)  # warm-up (kernels, allocator)
    _sync(device)
    start = time.perf_counter()
    outputs = _run(engine, prompts, new_tokens)
    _sync(device)
    engine_s = time.perf_counter() - start
    _hf_greedy(hf, prompts[:1], 4, device)  # warm-up
    theirs, hf_s = _hf_greedy(hf, prompts, new_tokens, device)
    ours = [list(o.token_ids) for o in outputs]
    mismatch = next((f"prompt {i}: engine {a} vs transformers {b}"
                     for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), "")
    from speckv.engine.outputs import acceptance_stats

    stats = acceptance_stats(outputs, 3)
    hit_tokens, hit_diff = _hit_kv(model, prompts[0])
    return GpuCheckResult(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        layout=label, greedy_equal=not mismatch, first_mismatch=mismatch,
        mean_acceptance_length=stats[1] if stats else None, hit_tokens=hit_tokens,
        hit_kv_max_abs_diff=hit_diff, engine_tok_s=num_prompts * new_tokens / engine_s,
        hf_tok_s=num_prompts * new_tokens / hf_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda",
                        help="cuda (the check) or cpu (a tiny rehearsal of the same steps)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of the model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(NO_CUDA.format(version=torch.__version__), file=sys.stderr)
        return 1
    if args.layers < 2:
        raise ValueError(f"--layers must be >= 2 (EAGLE3 reads three layers), got {args.layers}")
    result = run_check(args.device, args.layers, args.dtype, args.num_prompts,
                       args.prompt_len, args.new_tokens)
    if args.json:
        print(json.dumps({**asdict(result), "passed": result.passed}))
    else:
        accept = (f"{result.mean_acceptance_length:.2f}"
                  if result.mean_acceptance_length is not None else "-")
        print(f"GPU check on {result.device}: {result.layout}\n"
              f"  greedy with EAGLE3 equals transformers: {result.greedy_equal} "
              f"{result.first_mismatch}(mean acceptance length {accept})\n"
              f"  hit KV equals cold KV: {result.hit_tokens} hit tokens, max |diff| "
              f"{result.hit_kv_max_abs_diff:g}\n"
              f"  output tokens/s: engine {result.engine_tok_s:.1f}, transformers batched "
              f"generate {result.hf_tok_s:.1f} ({args.num_prompts} prompts of "
              f"{args.prompt_len} + {args.new_tokens})\n"
              f"  {'PASSED' if result.passed else 'FAILED'}")
    return 0 if result.passed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
