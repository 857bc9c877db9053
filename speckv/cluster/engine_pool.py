"""Engines in separate processes, for the benches that share one KV store between engines.

Owns `EngineWorkers`: N child processes (spawned, so no thread or lock state is inherited),
each loading the same weights (`ModelSpec`) once and then running one `LLMEngine` at a time
from an `EngineConfig` the parent sends; the parent submits requests to a chosen engine and
collects each finished `RequestOutput`. `drive_round_robin` runs a workload with request i on
engine i mod N, under one concurrency cap over all engines, as a load balancer would.

A request's output is reported only after its engine has flushed its KV connector, so the
store holds the request's blocks before the parent sends the next request anywhere: a
sequential workload then sees exactly the hits a single engine would.

Messages over the pipe (plain tuples of ints, strings, dataclasses; never from the network):
    parent -> worker  ("open", EngineConfig, with_drafter, reset_store)  ("add", key, prompt,
                      max_tokens)  ("close",)  ("exit",)
    worker -> parent  ("opened", hash mode label, connector name)  ("done", key, RequestOutput)
                      ("closed", EngineSummary)  ("error", traceback text)
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

WORKER_START_TIMEOUT_S = 600.0  # loading the model in a busy machine's child can be slow
FLUSH_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ModelSpec:
    """How every worker builds the same model and drafter."""

    model: str = "builtin"  # 'builtin', an HF dir or a .gguf
    dtype: str = "float32"
    speculative_model: str | None = "builtin"  # drafter dir or 'builtin'; None: no drafter
    # "package.module:function" returning (model, drafter or None), instead of the above
    # (tests: a tiny seeded model)
    factory: str | None = None
    threads: int = 1  # torch CPU threads per worker

    def build(self) -> tuple[Any, Any]:
        if self.factory is not None:
            module, _, name = self.factory.partition(":")
            return getattr(importlib.import_module(module), name)()
        from speckv.engine.llm import load_model
        from speckv.engine.speculative import load_drafter_model

        model, _ = load_model(self.model, self.dtype, "cpu", progress=False)
        drafter = (load_drafter_model(self.speculative_model, model)
                   if self.speculative_model is not None else None)
        return model, drafter


@dataclass(frozen=True)
class EngineSummary:
    """An engine's state when it closed."""

    integrity_ok: bool  # KVCacheManager.check_integrity() held with no request left
    integrity_error: str | None
    num_steps: int
    connector_stats: dict[str, dict[str, Any]]  # per tier: ConnectorStats fields + extra


@dataclass(frozen=True)
class Finished:
    engine: int
    key: int  # the caller's id of the request
    output: Any  # RequestOutput


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its traceback."""


def _summary(engine: Any, num_steps: int) -> EngineSummary:
    from dataclasses import asdict

    error = None
    try:
        engine.manager.check_integrity()
    except AssertionError as failure:
        error = f"{type(failure).__name__}: {failure}"
    stats = {name: {**{k: v for k, v in asdict(tier).items() if k != "extra"}, **tier.extra}
             for name, tier in engine.kv_connector_stats().items()}
    return EngineSummary(error is None, error, num_steps, stats)


def _worker_main(conn: Connection, spec: ModelSpec) -> None:
    try:
        import torch

        torch.set_num_threads(spec.threads)
        model, drafter = spec.build()
        conn.send(("ready",))
        _serve(conn, model, drafter)
    except BaseException:  # report everything to the parent, then exit
        conn.send(("error", traceback.format_exc()))


def _serve(conn: Connection, model: Any, drafter: Any) -> None:
    from speckv.engine.llm_engine import LLMEngine
    from speckv.engine.sampling_params import SamplingParams

    engine: LLMEngine | None = None
    keys: dict[str, int] = {}
    num_steps = 0
    while True:
        busy = engine is not None and engine.has_unfinished_requests()
        while not busy or conn.poll(0):
            message = conn.recv()
            kind = message[0]
            if kind == "exit":
                if engine is not None:
                    engine.close()
                return
            if kind == "open":
                _, config, with_drafter, reset_store = message
                engine = LLMEngine(model, config, drafter=drafter if with_drafter else None,
                                   detokenize=False)
                if reset_store:  # a previous run's blocks in this namespace would be hits
                    engine.reset_prefix_cache(reset_connector=True)
                keys, num_steps = {}, 0
                connector = engine.connector.name if engine.connector is not None else "-"
                conn.send(("opened", engine.hash_mode.label, connector))
            elif kind == "add":
                _, key, prompt, max_tokens = message
                assert engine is not None
                request_id = engine.add_request(
                    prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                keys[request_id] = key
            elif kind == "close":
                assert engine is not None
                engine.flush_kv_connector(FLUSH_TIMEOUT_S)
                summary = _summary(engine, num_steps)
                engine.close()
                engine = None
                conn.send(("closed", summary))
            busy = engine is not None and engine.has_unfinished_requests()
        assert engine is not None
        finished = [output for output in engine.step() if output.finished]
        num_steps += 1
        if finished:
            # the finished requests' blocks reach the store before anyone hears of them
            engine.flush_kv_connector(FLUSH_TIMEOUT_S)
            for output in finished:
                conn.send(("done", keys.pop(output.request_id), output))


class EngineWorkers:
    """`num_engines` worker processes; use as a context manager."""

    def __init__(self, spec: ModelSpec, num_engines: int) -> None:
        if num_engines < 1:
            raise ValueError(f"--engines must be >= 1, got {num_engines}")
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes = []
        for _ in range(num_engines):
            parent, child = context.Pipe()
            process = context.Process(target=_worker_main, args=(child, spec), daemon=True)
            process.start()
            child.close()
            self._conns.append(parent)
            self._processes.append(process)
        try:
            for index in range(num_engines):
                self._expect(index, "ready", WORKER_START_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    @property
    def num_engines(self) -> int:
        return len(self._conns)

    def _expect(self, index: int, kind: str, timeout_s: float | None = None) -> tuple:
        conn = self._conns[index]
        if not conn.poll(timeout_s):
            raise WorkerError(f"engine worker {index} did not answer {kind!r} in {timeout_s} s")
        message = self._recv(index)
        if message[0] != kind:
            raise WorkerError(f"engine worker {index}: expected {kind!r}, got {message[0]!r}")
        return message

    def _recv(self, index: int) -> tuple:
        try:
            message = self._conns[index].recv()
        except EOFError:
            raise WorkerError(f"engine worker {index} exited "
                              f"(exit code {self._processes[index].exitcode})") from None
        if message[0] == "error":
            raise WorkerError(f"engine worker {index} failed:\n{message[1]}")
        return message

    def open(self, configs: Sequence[Any], with_drafter: bool, reset_store: bool = False
             ) -> list[tuple[str, str]]:
        """An engine per worker (`configs[i]` on worker i); (hash mode, connector) of each.
        `reset_store`: worker 0 deletes its namespace from the KV tiers first (a fresh run)."""
        if len(configs) != self.num_engines:
            raise ValueError(f"{len(configs)} engine configs for {self.num_engines} workers")
        opened = []
        for index, config in enumerate(configs):
            self._conns[index].send(("open", config, with_drafter, reset_store and index == 0))
            if index == 0:  # the reset ends before any other engine can read the namespace
                opened.append(self._expect(0, "opened", WORKER_START_TIMEOUT_S))
        opened += [self._expect(index, "opened", WORKER_START_TIMEOUT_S)
                   for index in range(1, len(configs))]
        return [(message[1], message[2]) for message in opened]

    def submit(self, engine: int, key: int, prompt: list[int], max_tokens: int) -> None:
        self._conns[engine].send(("add", key, list(prompt), max_tokens))

    def wait_finished(self, timeout_s: float | None = None) -> list[Finished]:
        """Outputs of requests that finished (empty after `timeout_s`)."""
        ready = wait(self._conns, timeout_s)
        done = []
        for conn in ready:
            index = self._conns.index(conn)
            while conn.poll(0):
                _, key, output = self._expect(index, "done")
                done.append(Finished(index, key, output))
        return done

    def close_engines(self) -> list[EngineSummary]:
        for conn in self._conns:
            conn.send(("close",))
        return [self._expect(index, "closed", 600.0)[1] for index in range(self.num_engines)]

    def shutdown(self) -> None:
        for conn, process in zip(self._conns, self._processes):
            if process.is_alive():
                with contextlib.suppress(BrokenPipeError, OSError):
                    conn.send(("exit",))
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> EngineWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


@dataclass
class DriveResult:
    outputs: list[Any]  # RequestOutput per workload index
    engine_of: list[int]  # which engine served each request
    latency_s: list[float]  # per request: submitted -> its output received (flush included)
    duration_s: float

    def tpots_ms(self) -> list[float]:
        """Time per output token after the first, per request with more than one."""
        return [1000 * (latency - (output.ttft_s or 0.0)) / (len(output.token_ids) - 1)
                for output, latency in zip(self.outputs, self.latency_s)
                if len(output.token_ids) > 1]


def drive_round_robin(workers: EngineWorkers, prompts: Sequence[Sequence[int]],
                      max_tokens: Sequence[int], arrivals: Sequence[float],
                      max_concurrency: int,
                      on_finished: Callable[[int], None] | None = None) -> DriveResult:
    """Request i goes to engine i mod N at `arrivals[i]` seconds (in order), at most
    `max_concurrency` in flight over all engines. `on_finished(count)` runs after each
    completion (the soak restarts the store from it)."""
    num_engines = workers.num_engines
    pending = deque(range(len(prompts)))
    outputs: list[Any] = [None] * len(prompts)
    submitted = [0.0] * len(prompts)
    latency = [0.0] * len(prompts)
    in_flight = 0
    completed = 0
    start = time.perf_counter()
    while pending or in_flight:
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now and in_flight < max_concurrency:
            index = pending.popleft()
            workers.submit(index % num_engines, index, prompts[index], max_tokens[index])
            submitted[index] = time.perf_counter()
            in_flight += 1
        if not in_flight:
            time.sleep(max(0.0, min(0.05, arrivals[pending[0]] - now)))
            continue
        wait_s = 0.05 if pending else None
        for item in workers.wait_finished(wait_s):
            outputs[item.key] = item.output
            latency[item.key] = time.perf_counter() - submitted[item.key]
            in_flight -= 1
            completed += 1
            if on_finished is not None:
                on_finished(completed)
    duration = time.perf_counter() - start
    return DriveResult(outputs, [index % num_engines for index in range(len(prompts))],
                       latency, duration)
