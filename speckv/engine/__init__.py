"""The serving engine: requests, scheduler, model runner, output processor, LLM API.

Public names are imported lazily (`speckv.engine.request` stays torch-free for cache tools).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "speckv.engine.llm",
    "LLMEngine": "speckv.engine.llm_engine",
    "EngineArgs": "speckv.engine.engine_args",
    "EngineConfig": "speckv.engine.config",
    "SamplingParams": "speckv.engine.sampling_params",
    "RequestOutput": "speckv.engine.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'speckv.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
