"""The last step of `speckv demo`: the built-in model behind `speckv serve`'s app.

Owns starting the server on a free loopback port, sending the same chat request twice through
the official `openai` client (streaming, with `stream_options.include_usage`), and printing
both responses' `usage.prompt_tokens_details.cached_tokens` side by side, with the client's
time to first token and the server's prefix-cache counter from `/metrics`. Returns False when
the second request was not served from the prefix cache (the demo then exits non-zero).
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

QUESTION = ("You are a concise assistant. In two sentences, say why a server that caches the "
            "KV of a shared prompt prefix answers a repeated request faster.")


def run_server_demo(console: Console, max_tokens: int = 32) -> bool:
    import httpx
    import openai

    from speckv.drafters.builtin import BUILTIN_DRAFTER_METHOD, builtin_speculation_pays
    from speckv.engine.llm import LLM
    from speckv.measure.prometheus import metric_totals
    from speckv.models.llama.builtin import BuiltinModelMissingError
    from speckv.server.app import OpenAIServer, ServerConfig
    from speckv.server.launch import ServerThread

    try:
        speculative = {"speculative_method": BUILTIN_DRAFTER_METHOD, "num_spec_tokens": 3,
                       "speculative_model": "builtin"} if builtin_speculation_pays() else {}
        llm = LLM("builtin", progress=False, **speculative)
    except BuiltinModelMissingError as error:
        console.print(f"[yellow]built-in model unavailable:[/] {error}")
        return True
    server = OpenAIServer(llm.engine, ServerConfig(served_model_name="builtin"), "builtin")
    rows = []
    with ServerThread(server) as thread, openai.OpenAI(base_url=f"{thread.url}/v1",
                                                       api_key="demo") as client:
        console.print(f"[bold]speckv serve[/] on {thread.url} (the same app as `speckv serve`): "
                      "one chat request sent twice through the openai client")
        for label in ("first", "second"):
            start = time.perf_counter()
            ttft = None
            text = ""
            usage = None
            for chunk in client.chat.completions.create(
                    model="builtin", messages=[{"role": "user", "content": QUESTION}],
                    max_tokens=max_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}):
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text += chunk.choices[0].delta.content
                if chunk.usage is not None:
                    usage = chunk.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            rows.append((label, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                         ttft, text))
        hits = metric_totals(httpx.get(f"{thread.url}/metrics").text).get(
            "vllm:prefix_cache_hits_total", 0.0)
    table = Table(title="POST /v1/chat/completions, twice")
    for column in ("request", "prompt_tokens", "cached_tokens", "TTFT (ms)", "answer"):
        table.add_column(column, justify="left" if column in ("request", "answer") else "right")
    for label, prompt_tokens, cached, ttft, text in rows:
        table.add_row(label, str(prompt_tokens), str(cached),
                      f"{1000 * ttft:.0f}" if ttft is not None else "-",
                      text.strip().replace("\n", " ")[:40] + "…")
    console.print(table)
    console.print(f"usage.prompt_tokens_details.cached_tokens: first {rows[0][2]}, second "
                  f"{rows[1][2]}; GET /metrics: vllm:prefix_cache_hits_total {hits:.0f}")
    if rows[1][2] == 0:
        console.print("[red]the repeated request was not served from the prefix cache[/]")
        return False
    return True
