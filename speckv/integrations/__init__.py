"""Integrations of speckv's cache rules into other engines (today: vLLM, `integrations.vllm`).

Owns nothing itself; each subpackage imports only what its host engine already ships.
"""
