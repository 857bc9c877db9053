"""vLLM CPU engines behind `speckv router`, for the fleet benchmark (`speckv bench route
--vllm-venv DIR`) and the router's vLLM tests: the `vllm serve` command line of the built-in
model (speckv's EAGLE3 head optional) with KV events on loopback and a fixed hash seed, and the
`speckv router --vllm-*` flags that describe such an engine.

vLLM is never imported here: it runs from its own venv (`DIR/bin/vllm`), as a process group of
its own so that stopping it stops its engine-core child too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speckv.bench.health import wait_healthy
from speckv.events.endpoints import LOOPBACK, free_port
from speckv.integrations.vllm.entry_point import write_entry_point_dir

CHECKOUT = Path(__file__).resolve().parents[2]
EAGLE3_HEAD = CHECKOUT / "speckv" / "assets" / "smollm2-eagle3"


def _entry_point_dir() -> Path:
    """A folder holding only speckv's `vllm.general_plugins` entry point, for a vLLM venv
    without speckv installed."""
    import tempfile

    return write_entry_point_dir(Path(tempfile.gettempdir()) / "speckv-vllm-entry-point")


def builtin_model_dir() -> Path:
    """The built-in model's converted HF directory (vLLM loads it as it is), converted on
    first use."""
    from speckv.models.llama.builtin import convert_builtin

    return convert_builtin(progress=False)


def eagle3_config(num_spec_tokens: int = 3) -> dict[str, Any]:
    """vLLM's --speculative-config for speckv's shipped EAGLE3 head."""
    return {"method": "eagle3", "model": str(EAGLE3_HEAD),
            "num_speculative_tokens": num_spec_tokens}


def check_venv(venv: str | Path) -> Path:
    """The venv's `vllm` executable; ValueError naming --vllm-venv when it has none."""
    executable = Path(venv) / "bin" / "vllm"
    if not executable.is_file():
        raise ValueError(f"--vllm-venv {venv}: no bin/vllm there (a venv with vLLM installed)")
    return executable


@dataclass
class VLLMEngine:
    """One `vllm serve` of the built-in model on loopback, its KV events published."""

    venv: Path
    model: Path
    served_model_name: str = "builtin"
    speculative_config: dict[str, Any] | None = None
    block_size: int = 32  # vLLM's CPU attention wants multiples of 32
    num_blocks: int | None = None  # --num-gpu-blocks-override
    max_model_len: int = 1024
    hash_seed: str = "0"
    # speckv's vLLM plugin (speckv.integrations.vllm) loaded into the engine: lookahead hashes
    # (L = 1 under EAGLE3), no last-block drop
    plugin: bool = False
    port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port)
    replay_port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log: Path | None = None  # where its output goes

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def kv_events_config(self) -> dict[str, Any]:
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": f"tcp://{LOOPBACK}:{self.events_port}",
                "replay_endpoint": f"tcp://{LOOPBACK}:{self.replay_port}"}

    def command(self) -> list[str]:
        command = [str(check_venv(self.venv)), "serve", str(self.model), "--host", LOOPBACK,
                   "--port", str(self.port), "--dtype", "float32", "--enforce-eager",
                   "--max-model-len", str(self.max_model_len), "--served-model-name",
                   self.served_model_name, "--block-size", str(self.block_size),
                   "--enable-prompt-tokens-details",
                   "--kv-events-config", json.dumps(self.kv_events_config())]
        if self.num_blocks is not None:
            command += ["--num-gpu-blocks-override", str(self.num_blocks)]
        if self.speculative_config is not None:
            command += ["--speculative-config", json.dumps(self.speculative_config)]
        return command

    def env(self) -> dict[str, str]:
        env = {**os.environ, "PYTHONHASHSEED": self.hash_seed, "VLLM_TARGET_DEVICE": "cpu",
               "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
               "OMP_NUM_THREADS": "1", "VLLM_PLUGINS": ""}
        if self.plugin:  # this checkout's speckv and its entry point, visible to vLLM's venv
            del env["VLLM_PLUGINS"]
            env["PYTHONPATH"] = os.pathsep.join([str(_entry_point_dir()), str(CHECKOUT)])
        return env

    @property
    def lookahead_tokens(self) -> int:
        """L of the plugin's lookahead hashes: 1 under an EAGLE / EAGLE3 drafter."""
        method = (self.speculative_config or {}).get("method")
        return 1 if self.plugin and method in ("eagle", "eagle3") else 0

    def router_flags(self, name: str) -> list[str]:
        """The `speckv router` flags that describe this engine as `--engine NAME=URL`."""
        flags = [f"--engine={name}={self.url}",
                 f"--vllm-kv-events-config={name}={json.dumps(self.kv_events_config())}",
                 f"--vllm-hash-seed={name}={self.hash_seed}"]
        if self.speculative_config is not None:
            flags.append(f"--vllm-speculative-config={name}="
                         f"{json.dumps(self.speculative_config)}")
        if self.lookahead_tokens:
            flags.append(f"--vllm-lookahead-tokens={name}={self.lookahead_tokens}")
        return flags

    def _log_tail(self) -> str:
        if self.log is None or not self.log.is_file():
            return ""
        return f"; its log {self.log} ends:\n{self.log.read_text()[-2000:]}"

    def start(self, log: Path | None = None) -> VLLMEngine:
        self.log = log
        out = open(log, "w") if log is not None else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(self.command(), env=self.env(), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 900.0) -> None:
        """Until its /health answers 200; RuntimeError if it exits or takes too long."""
        wait_healthy(self.url, self.process, timeout_s, f"vllm serve on port {self.port}",
                     exit_detail=self._log_tail)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the engine's process group (its engine core too), SIGKILL after."""
        process = self.process
        if process is None or process.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                return
            try:
                process.wait(timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue
