"""Real `speckv serve` engine processes and a real `speckv router` process on loopback, over
the tiny chat model saved as an HF directory (with random EAGLE and 2-module MTP drafters
beside it), for the router's end-to-end tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from speckv.drafters.loaders import random_drafter, save_drafter
from speckv.events.endpoints import LOOPBACK, free_port, loopback_endpoint
from speckv.models import save_hf_dir
from tests import patience
from tests.patience import WATCHDOG_S, wait_until
from tests.server.server_test_utils import TINY_CONFIG, TOKENIZER

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
MODEL_NAME = "tiny"
BLOCK = 4


def save_fleet_models(path: Path, target) -> dict[str, Path]:
    """The target dir and its drafters: {"model", "eagle", "mtp2"}."""
    model = path / "model"
    save_hf_dir(model, TINY_CONFIG, target.state_dict().items(), TOKENIZER)
    eagle = save_drafter(random_drafter("eagle", target, init_std=0.2, seed=1),
                         path / "eagle")
    mtp2 = save_drafter(random_drafter("mtp", target, init_std=0.2, seed=2, num_modules=2,
                                       layout="deepseek"), path / "mtp2", "deepseek")
    return {"model": model, "eagle": eagle, "mtp2": mtp2}


def wait_http(url: str, process: subprocess.Popen, cpu_budget_s: float = 120.0,
              path: str = "/health") -> None:
    """Until `url + path` answers 200 (bounded by `process`'s CPU time: `tests.patience`)."""
    def answers() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[:5]} exited {process.returncode}: "
                               f"{process.stderr.read() if process.stderr else ''}")
        try:
            return httpx.get(f"{url}{path}", timeout=WATCHDOG_S).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answers, f"{url} becomes healthy", cpu_budget_s, (process.pid,), poll_s=0.1)


@dataclass
class Engine:
    """One `speckv serve` process; `restart()` keeps its ports (a new epoch)."""

    model: Path
    flags: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    pub: str = field(default_factory=loopback_endpoint)
    replay: str = field(default_factory=loopback_endpoint)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "speckv.cli", "serve", str(self.model),
                "--port", str(self.port), "--served-model-name", MODEL_NAME,
                "--block-size", str(BLOCK), "--threads", "1", "--max-num-seqs", "8",
                "--kv-events-endpoint", self.pub, "--kv-events-replay-endpoint", self.replay,
                *self.flags]

    def start(self) -> Engine:
        self.process = subprocess.Popen(self.command(), env=ENV, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        return self

    def wait(self) -> Engine:
        assert self.process is not None
        wait_http(self.url, self.process)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(WATCHDOG_S)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            patience.stop_process(self.process)


@dataclass
class RouterProcess:
    engines: dict[str, Engine]
    flags: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def api_key(self) -> str | None:
        return self.flags[self.flags.index("--api-key") + 1] if "--api-key" in self.flags \
            else None

    def run(self, cpu_budget_s: float = 60) -> subprocess.CompletedProcess:
        """Run to completion (a router expected to refuse its engines)."""
        return patience.run(self.command(), cpu_budget_s, env=ENV)

    def command(self) -> list[str]:
        engines = [f"--engine={n}={e.url}" for n, e in self.engines.items()]
        return [sys.executable, "-m", "speckv.cli", "router", *engines, "--port",
                str(self.port), "--health-interval", "0.2", *self.flags]

    def start(self) -> RouterProcess:
        self.process = subprocess.Popen(self.command(), env=ENV, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
        assert self.process is not None
        wait_http(self.url, self.process)
        return self

    def state(self) -> dict:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.get(f"{self.url}/router/state", headers=headers,
                         timeout=WATCHDOG_S).json()["engines"]

    def wait_state(self, predicate, cpu_budget_s: float = 60.0) -> dict:
        """The router's state once `predicate` holds (bounded by the CPU time of this process,
        the router and its engines)."""
        pids = [self.process.pid] + [e.process.pid for e in self.engines.values() if e.process]

        def matched() -> dict | None:
            state = self.state()
            return state if predicate(state) else None

        return wait_until(matched, "the router state matches", cpu_budget_s, pids, poll_s=0.05)

    def stop(self) -> tuple[str, str]:
        if self.process is None:
            return "", ""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            out, err = self.process.communicate(timeout=WATCHDOG_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate(timeout=WATCHDOG_S)
        return out, err


def settled(engine: str, num_events: int):
    """A `wait_state` predicate: the router applied at least `num_events` of `engine`'s
    events and holds no pending blocks for it."""
    def check(state: dict) -> bool:
        s = state[engine]
        return s["events_applied"] >= num_events and s["index"]["pending_blocks"] == 0
    return check
