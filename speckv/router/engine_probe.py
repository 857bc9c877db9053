"""Reading an engine's cache contract over HTTP, a `speckv serve` or a vLLM engine alike.

Owns the probe the router runs at start (`fetch_contracts`) and at every health poll
(`read_contract`): `GET /kv_cache_contract` for speckv engines; for vLLM engines (named by a
`--vllm-*` flag, or found by a 404 there and `vllm:cache_config_info` in `/metrics`) the
contract `speckv.router.vllm_engine` builds from `/metrics`, `/v1/models` and the flags. At
start a vLLM engine is made to run one step first (`flush_events`): vLLM publishes what its
cache did at the end of a step, so an engine reset (`/reset_prefix_cache`) while idle shows
its `AllBlocksCleared` only at its next step, and a router replaying its events before that
would count the blocks of before the reset as cached. Then its replayed KV events are checked
against the flags (`check_events`).
`EngineDown` is an engine that does not answer (no connection, a 5xx): not an error at start,
the router adds it when its health passes; every other failure is a `ValueError` naming the
engine (and the contract field or flag).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx

from speckv.api.contract import CONTRACT_PATH
from speckv.events.schema import KVEventBatch
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.router.contract import ContractError, EngineContract, parse_contract
from speckv.router.vllm_engine import VLLMFlags, check_events, is_vllm_metrics, vllm_contract

logger = logging.getLogger("speckv.router")


class EngineDown(Exception):
    """The engine did not answer (no connection, a 5xx): it may be starting."""


@dataclass(frozen=True)
class Probe:
    contract: EngineContract
    metrics_text: str  # its /metrics, for the load
    vllm: VLLMFlags | None  # set for a vLLM engine


async def _get(client: httpx.AsyncClient, spec: Any, path: str, timeout_s: float,
               auth: bool = True) -> httpx.Response:
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key and auth else {}
    try:
        response = await client.get(f"{spec.url}{path}", headers=headers, timeout=timeout_s)
    except httpx.HTTPError as error:
        raise EngineDown(f"{path}: {type(error).__name__}: {error}") from None
    if response.status_code >= 500:
        raise EngineDown(f"{path} answered {response.status_code}")
    if response.status_code == 401:
        raise ValueError(f"engine {spec.name!r} at {spec.url} wants an API key: pass "
                         f"--engine-api-key {spec.name}=KEY")
    return response


def _json(spec: Any, response: httpx.Response, what: str) -> Any:
    try:
        return response.json()
    except ValueError:
        raise ContractError(spec.name, what, "not JSON") from None


async def read_contract(client: httpx.AsyncClient, spec: Any, timeout_s: float) -> Probe:
    """The engine's contract as it serves it now, and its /metrics."""
    vllm = spec.vllm
    if vllm is None:
        response = await _get(client, spec, CONTRACT_PATH, timeout_s)
        if response.status_code == 200:
            metrics = await _get(client, spec, "/metrics", timeout_s, auth=False)
            contract = parse_contract(spec.name, spec.url, _json(spec, response, "contract"))
            return Probe(contract, metrics.text if metrics.status_code == 200 else "", None)
        if response.status_code != 404:
            raise ValueError(f"engine {spec.name!r} at {spec.url}: {CONTRACT_PATH} answered "
                             f"{response.status_code} (not a speckv serve of this version?)")
    metrics = await _get(client, spec, "/metrics", timeout_s, auth=False)
    if metrics.status_code != 200 or not is_vllm_metrics(metrics.text):
        raise ValueError(f"engine {spec.name!r} at {spec.url}: neither a {CONTRACT_PATH} (a "
                         "speckv serve) nor vllm:cache_config_info in /metrics (a vLLM engine)")
    models = await _get(client, spec, "/v1/models", timeout_s)
    flags = vllm or spec.vllm_default or VLLMFlags()
    contract = vllm_contract(spec.name, spec.url, metrics.text,
                             _json(spec, models, "/v1/models"), flags)
    return Probe(contract, metrics.text, flags)


async def flush_events(client: httpx.AsyncClient, spec: Any, contract: EngineContract,
                       timeout_s: float) -> None:
    """Make a vLLM engine run one step (a one-token prompt, one output token: no full block,
    nothing cached), so that events it queued while idle are published before the router
    replays them. An engine that does not answer is left to the health poll."""
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    body = {"model": contract.served_model_name, "prompt": [0], "max_tokens": 1}
    try:
        await client.post(f"{spec.url}/v1/completions", json=body, headers=headers,
                          timeout=timeout_s)
    except httpx.HTTPError as error:
        logger.warning("engine %s: its one-step flush failed (%s)", spec.name, error)


def replayed_batches(contract: EngineContract, wait_s: float = 5.0) -> list[KVEventBatch]:
    """The engine's KV events from seq 0, as its replay buffer holds them now (an idle engine
    answers at once; a busy one's publisher thread gets `wait_s`)."""
    subscriber = EventSubscriber(SubscriberConfig(
        endpoint=contract.events_endpoint, replay_endpoint=contract.replay_endpoint,
        start_seq=0, replay_timeout_s=wait_s))
    batches: list[KVEventBatch] = []
    deadline = time.monotonic() + wait_s
    try:
        while time.monotonic() < deadline:
            delivered = subscriber.poll(0.05)
            batches.extend(batch for _, batch in delivered)
            if delivered and any(b.events for b in batches):
                break
    finally:
        subscriber.close()
    return batches


def fetch_contracts(specs: list[Any], timeout_s: float = 10.0) -> list[Any]:
    """Each engine's link at start: its contract, or none for an engine that does not answer
    (it joins when its health passes). A ValueError naming the engine for one that answers
    with a contract the router cannot reproduce, wants a key, or contradicts a flag."""
    from speckv.router.fleet import EngineLink

    async def probe_all() -> list[Probe | EngineDown]:
        async with httpx.AsyncClient() as client:
            async def one(spec: Any) -> Probe | EngineDown:
                try:
                    probe = await read_contract(client, spec, timeout_s)
                except EngineDown as down:
                    return down
                if probe.vllm is not None:
                    await flush_events(client, spec, probe.contract, max(timeout_s, 60.0))
                return probe
            return list(await asyncio.gather(*(one(spec) for spec in specs)))

    links = []
    for spec, probe in zip(specs, asyncio.run(probe_all())):
        if isinstance(probe, EngineDown):
            logger.warning("engine %s at %s does not answer (%s): starting without it; it "
                           "joins when its health passes", spec.name, spec.url, probe)
            links.append(EngineLink(spec, None))
            continue
        if probe.vllm is not None:
            check_events(probe.contract, probe.vllm, replayed_batches(probe.contract))
        links.append(EngineLink(spec, probe.contract))
    return links
