"""The OpenAI-compatible HTTP surface shared by `speckv serve` and `speckv router`.

    errors.py       the OpenAI error shape and the HTTP status of each failure
    protocol.py     request bodies -> validated prompts + SamplingParams; response / chunk shapes
    http_guard.py   the API key, the body limit and the stream-vs-disconnect race
    contract.py     the cache contract a server publishes and a router checks

The server and both routers import these; none of them imports another's app, so `server`
and `router` stay peers above `engine`.
"""
