"""The built-in model section of `speckv demo` (the demo owner calls `run_model_demo`).

Owns a short, real run of the engine on SmolLM2-135M-Instruct: one chat prompt sent twice
(cached prompt tokens, time to first token and accepted drafts for each), then a small batch
with tokens/s. Speculation follows the measurement: the shipped EAGLE3 head (adaptive draft
length, lookahead block hashes) is on when its recorded held-out figure at batch 1 passes
`speculation_default`, and the first line says so with the measured figure.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

QUESTION = (
    "You are a concise assistant. Explain in two sentences why caching the KV of a shared "
    "prompt prefix makes the second request answer faster."
)
# questions a 135M model answers well greedily (it answered "Il Coriobella, Italy." to the
# capital of Italy): the batch shows throughput, and its answers should not distract from it
BATCH = [
    "Name three primary colors.",
    "What is the capital of France?",
    "What is 2 + 2?",
    "What does a CPU do?",
]


def run_model_demo(console: Console, max_tokens: int = 32) -> None:
    from speckv.drafters.builtin import measured_speedup, speculation_default
    from speckv.engine.llm import LLM
    from speckv.engine.sampling_params import SamplingParams
    from speckv.models.llama.builtin import BuiltinModelMissingError

    measured = measured_speedup()
    default = speculation_default(measured)
    speculative = {"speculative_method": "eagle3", "num_spec_tokens": 3,
                   "speculative_model": "builtin"} if default.on else {}
    try:
        llm = LLM("builtin", **speculative)
    except BuiltinModelMissingError as error:
        console.print(f"[yellow]built-in model unavailable:[/] {error}")
        return
    engine = llm.engine
    spec_line = (
        f"EAGLE3 speculation (the shipped head, up to {engine.num_spec_tokens} drafts, "
        "adaptive: fewer or none where drafting does not pay)" if default.on else
        "speculation off") + f": {default.reason}"
    console.print(
        f"[bold]Built-in model[/] SmolLM2-135M-Instruct on {engine.runner.device} "
        f"({engine.model.dtype}), {engine.num_blocks} KV blocks of "
        f"{engine.config.cache.block_size}, "
        f"{engine.hash_mode.label} block hashes; {spec_line}"
    )
    params = SamplingParams(max_tokens=max_tokens)
    prompt = llm.chat_prompt(QUESTION)
    table = Table(title="one prompt sent twice")
    table.add_column("run")
    table.add_column("prompt", justify="right")
    table.add_column("cached", justify="right")
    table.add_column("TTFT (ms)", justify="right")
    table.add_column("drafts ok", justify="right")
    table.add_column("answer")
    for label in ("first (cold)", "second (prefix hit)"):
        (out,) = llm.generate([prompt], params)
        table.add_row(
            label, str(len(out.prompt_token_ids)), str(out.num_cached_tokens),
            f"{(out.ttft_s or 0) * 1e3:.0f}",
            f"{out.num_accepted_tokens}/{out.num_draft_tokens}",
            out.text.strip().replace("\n", " ")[:40],
        )
    console.print(table)
    start = time.perf_counter()
    outs = llm.generate([llm.chat_prompt(q) for q in BATCH], params)
    elapsed = time.perf_counter() - start
    num_tokens = sum(len(o.token_ids) for o in outs)
    batch = Table(title=f"batch of {len(BATCH)}: {num_tokens} tokens, "
                        f"{num_tokens / elapsed:.1f} tokens/s",
                  caption="SmolLM2-135M answers, greedy, 32 tokens at most: a small model, "
                          "good at short factual questions")
    batch.add_column("prompt")
    batch.add_column("answer")
    for question, out in zip(BATCH, outs):
        batch.add_row(question, out.text.strip().replace("\n", " ")[:70])
    console.print(batch)
