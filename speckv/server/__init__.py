"""`speckv serve`: an OpenAI-compatible HTTP server over the engine.

Request parsing, errors, the HTTP guard and the cache contract live in `speckv.api`,
shared with the router.

    engine_loop.py  the one thread that owns the `LLMEngine` (continuous batching over HTTP)
    async_client.py the asyncio side: per-request queues, acceptance, streams, aborts
    metrics.py      Prometheus metrics under vLLM's names (+ the hash mode in force)
    app.py          the Starlette app: endpoints, API key, body limit, queue bound, disconnects
    launch.py       building a server from engine arguments; running it on a socket or a thread
    cli.py          the `speckv serve` command
"""
