"""`NixlConnector`: prefill/decode disaggregation, a request's target KV, draft KV and (hybrid
models) every other KV cache group's blocks moved from a prefill engine to a decode engine
over NIXL. Owns both roles (an engine may play both, `kv_both`); the per-group rules are in
`nixl/groups.py`.

prefill side (`kv_producer`), `do_remote_decode`: at its finish, the request's blocks stay
allocated (`delay_free`) under a lease, its output names per group the held, provable blocks
with their hashes (`KVTransferParams`); they are freed (`finished_sending`) on the decode
side's READ notification or release, or when the lease expires.

decode side (`kv_consumer`), `do_remote_prefill`: after the local hit `h`, the hit is the
longest prefix every group serves with the local blocks and the peer's blocks whose manifest
hash equals this engine's own; it READs (every tensor of the groups: target and drafter KV,
GDN conv and recurrent state) only what that hit reads beyond `h`, in the worker phase after
the step's saves are snapshotted. Params naming a peer the engine does not trust
(`trust.PeerPolicy`) are refused when the request is added. The handshake and the READ's
admission run on a thread per transfer (`pulls.admit`), the READ is polled: no step waits on
a peer. A failed or timed-out transfer, a dead prefill engine or an expired lease fails the
whole range: the engine recomputes from the local hit, caching nothing of it. Every way out
releases the prefill side's lease.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from speckv.connectors.base import (
    ExternalHit,
    FinishDecision,
    GroupBlockIds,
    KVConnector,
    RequestBlocks,
)
from speckv.connectors.capability import KVGroupSupport
from speckv.connectors.layout import DeviceKV, GroupedDeviceKV
from speckv.connectors.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    LoadFailure,
    RequestLoad,
    StepMetadata,
)
from speckv.connectors.nixl.config import NixlConfig
from speckv.connectors.nixl.groups import Groups, group_rules
from speckv.connectors.nixl.layout_desc import KVLayoutDesc, describe_layout
from speckv.connectors.nixl.params import (
    HashContract,
    KVTransferParams,
    ParamsError,
    parse_transfer_params,
    wants_remote_decode,
    wants_remote_prefill,
)
from speckv.connectors.nixl.pulls import (
    Caller,
    ControlSender,
    PeerLink,
    Pull,
    ReadInFlight,
    admit,
    close_unused,
    peer_key,
    run_async,
)
from speckv.connectors.nixl.side_channel import (
    LeaseService,
    SideChannelServer,
    Welcome,
)
from speckv.connectors.nixl.transport import NixlTransport
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    describe_block,
)

logger = logging.getLogger("speckv.connectors.nixl")

MEDIUM_NIXL = "NIXL"
_DONE_PREFIX = b"done:"


class NixlConnector(KVConnector):
    name = "nixl"

    def __init__(self, config: NixlConfig, hash_algo: str, hash_seed: str | None,
                 load_failure_policy: str = "recompute") -> None:
        self.config = config
        self.load_failure_policy = load_failure_policy  # the engine's one policy
        self.hash_algo, self.hash_seed = hash_algo, hash_seed
        self.epoch = ""
        self._kv: DeviceKV | GroupedDeviceKV | None = None
        self._mode: ConnectorMode | None = None
        self._transport: NixlTransport | None = None
        self._layout: KVLayoutDesc | None = None
        self._groups: Groups | None = None
        # prefill side
        self._leases: LeaseService | None = None
        self._server: SideChannelServer | None = None
        # decode side
        self._peers: dict[tuple[str, int, str], PeerLink] = {}
        self._pulls: dict[str, Pull] = {}  # request id -> its pull (until released)
        self._planned: list[str] = []  # request ids whose load the next metadata carries
        self._failures: list[LoadFailure] = []
        self._recved: set[str] = set()  # asynchronous loads settled since the last report
        self._inflight: dict[str, ReadInFlight] = {}  # admissions and READs, by request id
        self._finished_pulls: dict[str, Pull] = {}  # finished while their READ runs
        self._control: ControlSender | None = None
        self._caller: Caller | None = None
        self._heartbeat_at = 0.0
        self._step = 0
        self._stats: dict[str, Any] = {"lookups": 0, "hit_blocks": 0, "loaded_blocks": 0,
                                       "loaded_bytes": 0, "load_failed_blocks": 0,
                                       "sent_leases": 0, "refused": 0, "transfer_s": 0.0}

    @property
    def kv_group_support(self) -> KVGroupSupport:
        # every group's own blocks move (paged KV, drafter KV, GDN conv + recurrent state),
        # the hit is the longest prefix every group serves (the manager's rule)
        return KVGroupSupport(frozenset({"full_attention", "sliding_window", "mamba"}), True)

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        # a transfer moves a request's own blocks, checked against hashes the decode engine
        # computes itself: it stays exact under any hash mode both engines share
        return True

    # ---- start-up ----------------------------------------------------------------------------
    def initialize(self, kv: DeviceKV | GroupedDeviceKV, mode: ConnectorMode) -> None:
        self._kv, self._mode = kv, mode
        self._groups = Groups(tuple(group_rules(mode)))
        self.epoch = uuid.uuid4().hex
        contract = HashContract(self.hash_algo, self.hash_seed, mode.block_size,
                                mode.lookahead_tokens, mode.drops_last_block)
        agent_name = f"{self.config.engine_id}-{self.epoch[:8]}"
        self._layout = describe_layout(kv, self.config.engine_id, self.epoch, agent_name,
                                       contract, self._groups.rules)
        self._transport = NixlTransport(kv, agent_name, self._layout)
        if self.config.is_producer:
            self._leases = LeaseService(self.config.lease_s)
            self._server = SideChannelServer(
                self.config.host, self.config.port, self.epoch,
                Welcome(self._layout, self._transport.metadata()), self._leases,
                max_pin_s=2 * self.config.transfer_timeout_s)
            logger.info("nixl: prefill side channel on %s:%d (engine %s)", self.config.host,
                        self._server.port, self.config.engine_id)
        self._control = ControlSender()
        self._caller = Caller(self.config.engine_id, self.epoch, self._layout,
                              self.config.transfer_timeout_s)

    def startup_lines(self) -> tuple[str, ...]:
        config, port = self.config, self.side_channel_port
        return (f"KV transfer over NIXL, {config.role}, engine {config.engine_id}"
                + (f", side channel {config.host}:{port}" if port is not None else "")
                + (f"; {config.policy.describe()}" if config.is_consumer else ""),)

    @property
    def side_channel_port(self) -> int | None:
        return self._server.port if self._server is not None else None

    # ---- decode side: scheduler --------------------------------------------------------------
    def _pull_of(self, request: ConnectorRequest) -> Pull | None:
        pull = self._pulls.get(request.request_id)
        if pull is not None or not self.config.is_consumer:
            return pull
        raw = request.kv_transfer_params
        if not wants_remote_prefill(raw):
            return None
        try:
            params = parse_transfer_params(raw)
        except ParamsError as error:
            logger.warning("request %s: %s; prefilling locally", request.request_id, error)
            return None
        assert self._groups is not None
        mismatch = self._groups.mismatch(params)
        if mismatch is not None:
            logger.warning("request %s: %s; prefilling locally", request.request_id, mismatch)
            return None
        pull = self._pulls[request.request_id] = Pull(params)  # its peer: add_request checked
        return pull

    def check_transfer_params(self, params: Any) -> None:
        """A decode engine's params must parse and name a peer `config.policy` trusts."""
        if self.config.is_consumer and wants_remote_prefill(params):
            try:
                self.config.policy.check(params)  # first: unsigned input is parsed no further
                parse_transfer_params(params)
            except ParamsError:
                self._stats["refused"] += 1
                raise

    def transfer_abandoned(self, params: Any) -> None:
        """Release the lease named by a refused request's params, if its peer is trusted."""
        if not (self.config.is_consumer and wants_remote_prefill(params)):
            return
        try:
            self.config.policy.check(params)
            parsed = parse_transfer_params(params)
        except ParamsError:
            return  # never contact an address the engine would not pull from
        self._release(Pull(parsed))

    @property
    def _fails(self) -> bool:
        return self.load_failure_policy == "fail"

    def _servable(self, request: ConnectorRequest, pull: Pull, num_local_hit_tokens: int
                  ) -> int:
        """Tokens after the local hit the peer's blocks serve (`Groups.servable`)."""
        assert self._mode is not None and self._groups is not None
        if pull.released:
            return 0  # pulled (or given up) already: a preempted request recomputes locally
        # under policy "fail" a refused transfer still claims its range: the load fails it
        tokens, stale = self._groups.servable(request, pull.params, num_local_hit_tokens,
                                              self._mode.drops_last_block)
        if stale is not None:
            logger.warning("request %s: kv_transfer_params.manifest[%d][%d] differs from "
                           "this engine's block hash; that block is computed here",
                           request.request_id, *stale)
        return tokens

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        pull = self._pull_of(request)
        if pull is None:
            return ExternalHit(0)
        self._stats["lookups"] += 1
        tokens = self._servable(request, pull, num_local_hit_tokens)
        assert self._mode is not None
        self._stats["hit_blocks"] += tokens // self._mode.block_size
        return ExternalHit(tokens, MEDIUM_NIXL if tokens else None, load_async=bool(tokens))

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        pull = self._pull_of(request)
        if pull is None:
            return ExternalHit(0)
        tokens = self._servable(request, pull, num_local_hit_tokens)
        return ExternalHit(tokens, MEDIUM_NIXL if tokens else None, load_async=bool(tokens))

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        self.update_state_after_alloc_groups(request, (block_ids,), num_local_hit_tokens,
                                             num_external_tokens)

    def update_state_after_alloc_groups(self, request: ConnectorRequest,
                                        group_block_ids: GroupBlockIds,
                                        num_local_hit_tokens: int,
                                        num_external_tokens: int) -> None:
        pull = self._pulls.get(request.request_id)
        if pull is None:
            return
        if not num_external_tokens:
            self._release(pull)  # nothing to pull (a local hit covers it, or refused)
            return
        assert self._mode is not None
        assert self._groups is not None
        end = num_local_hit_tokens + num_external_tokens
        local_ids, remote_ids = self._groups.reads(group_block_ids, pull.params,
                                                   num_local_hit_tokens, end)
        pull.local_block_ids = local_ids
        pull.remote_block_ids = remote_ids
        pull.first_token = num_local_hit_tokens
        # the load as the engine sees it: group 0's blocks (the other groups ride along)
        size = self._mode.block_size
        hashes = request.get_block_hashes(self._mode.lookahead_tokens)
        first0 = num_local_hit_tokens // size
        pull.load = RequestLoad(
            request.request_id, num_local_hit_tokens, size,
            tuple(describe_block(request, hashes, first0 + offset, self._mode)
                  for offset in range(len(local_ids[0]))), local_ids[0])
        pull.num_blocks = sum(len(ids) for ids in local_ids)
        self._planned.append(request.request_id)

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> StepMetadata:
        self._step += 1
        loads = [pull.load for pull in (self._pulls.get(request_id)
                                        for request_id in self._planned)
                 if pull is not None and pull.load is not None]
        self._planned = []
        return ConnectorMetadata(self._step, tuple(loads))

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        request = blocks.request
        pull = self._pulls.pop(request.request_id, None)
        if pull is not None and request.request_id in self._inflight:
            # its READ runs: the READ's end settles the lease (and finished_recving)
            self._finished_pulls[request.request_id] = pull
        elif pull is not None:
            if request.request_id in self._planned:  # accepted, never started
                self._planned.remove(request.request_id)
                self._recved.add(request.request_id)
            self._release(pull)
        if self.config.is_producer and wants_remote_decode(request.kv_transfer_params):
            return self._lease(blocks)
        return FinishDecision()

    def request_preempted(self, blocks: RequestBlocks) -> None:
        return None

    # ---- prefill side ------------------------------------------------------------------------
    def _lease(self, blocks: RequestBlocks) -> FinishDecision:
        """Keep the finished request's blocks for the decode engine: every group's blocks
        this engine still holds (a sliding window's and a GDN group's older ones may be
        released already) whose KV (target and draft) or state is complete and provable, up
        to the longest prefix every group serves with them (at most N - 1 prompt tokens)."""
        assert self._mode is not None and self._leases is not None and self._server is not None
        request = blocks.request
        assert self._groups is not None
        num_prompt = getattr(request, "num_prompt_tokens", request.num_tokens)
        num_tokens, block_ids, manifest = self._groups.offer(
            request, blocks.group_block_ids or (blocks.block_ids,), blocks.num_written_tokens,
            num_prompt)
        tokens = request.all_token_ids
        first_token = int(tokens[num_prompt]) if len(tokens) > num_prompt else 0
        leased = [[block_id for block_id in ids if block_id] for ids in block_ids]
        lease_id = self._leases.issue(request.request_id, leased) if num_tokens else ""
        if num_tokens:
            self._stats["sent_leases"] += 1
        params = KVTransferParams(
            engine_id=self.config.engine_id, epoch=self.epoch, host=self.config.host,
            port=self._server.port, lease_id=lease_id or "none", block_ids=block_ids,
            num_tokens=num_tokens, first_token_id=first_token,
            hash_contract=self._layout.hash_contract, manifest=manifest,
            group_block_sizes=[rule.block_size for rule in self._groups.rules])
        return FinishDecision(delay_free=bool(num_tokens),
                              kv_transfer_params=self.config.policy.signed(params.to_json_obj()))

    def _finished_sending(self) -> frozenset[str]:
        if self._leases is None or self._transport is None:
            return frozenset()
        for _peer, messages in self._transport.take_notifs().items():
            for message in messages:
                if message.startswith(_DONE_PREFIX):
                    self._leases.release(message[len(_DONE_PREFIX):].decode(errors="replace"))
        return frozenset(self._leases.take_ended())

    # ---- decode side: worker -----------------------------------------------------------------
    def snapshot_saves(self, meta: StepMetadata) -> None:
        return None

    def load_blocks(self, meta: StepMetadata) -> None:
        """Start this step's transfers: each one's handshake and admission on a thread of its
        own (`pulls.admit`), its READ from the step that sees it admitted; `get_finished`
        reports them done. Nothing here waits on a peer."""
        assert isinstance(meta, ConnectorMetadata) and self._caller is not None
        for load in meta.loads:
            pull = self._pulls.get(load.request_id)
            if pull is None:
                self._fail(load, "no transfer")
                continue
            started = time.monotonic()
            link = self._peers.get(peer_key(pull.params))
            self._inflight[load.request_id] = ReadInFlight(
                load, pull, started, started + self.config.transfer_timeout_s,
                run_async(admit, self._caller, pull.params, pull.remote_block_ids, link))

    def _start_read(self, flight: ReadInFlight) -> None:
        """The prefill engine admitted the READ: link a new peer, start the READ (both local,
        non-blocking); ValueError, IndexError or RuntimeError if it cannot start."""
        assert self._transport is not None
        admission = flight.admission.result()
        key = peer_key(flight.pull.params)
        if admission.welcome is not None and key not in self._peers:
            layout = admission.welcome.layout
            agent_name = layout.agent_name
            if not self._transport.has_peer(agent_name):
                agent_name = self._transport.add_peer(admission.welcome.agent_metadata, layout)
            self._peers[key] = PeerLink(admission.client, agent_name, layout)
        elif admission.welcome is not None:
            admission.client.close()  # another transfer linked this peer meanwhile
        pull = flight.pull
        pull.peer = self._peers[key]
        flight.started = time.monotonic()
        flight.deadline = flight.started + self.config.transfer_timeout_s
        flight.read = self._transport.start_read(
            pull.peer.agent_name, pull.remote_block_ids, pull.local_block_ids,
            _DONE_PREFIX + pull.params.lease_id.encode())

    def _fail(self, load: RequestLoad, reason: str) -> None:
        logger.warning("request %s: KV transfer failed (%s); %s", load.request_id, reason,
                       "failing it (kv_load_failure_policy fail)" if self._fails
                       else "recomputing its prompt")
        pull_of = self._pulls.get(load.request_id) or self._finished_pulls.get(load.request_id)
        self._stats["load_failed_blocks"] += (pull_of.num_blocks if pull_of is not None
                                              else len(load.device_block_ids))
        self._failures.append(LoadFailure(load.request_id, load.first_token,
                                          load.device_block_ids, reason))
        self._recved.add(load.request_id)
        pull = self._pulls.get(load.request_id) or self._finished_pulls.pop(load.request_id,
                                                                             None)
        if pull is not None:
            self._release(pull)

    def _admitted(self, request_id: str, flight: ReadInFlight, now: float) -> bool:
        """Whether the flight's READ runs; a failed, refused or overdue admission fails the
        load (the thread still waiting on a hung peer is left to its own timeout)."""
        if flight.admission.done():
            failed = flight.admission.exception()  # any error of the peer's thread
            if failed is not None:
                reason = str(failed) or type(failed).__name__
            else:
                try:
                    self._start_read(flight)
                    return True
                except (ValueError, IndexError, RuntimeError) as error:
                    reason = str(error)
        elif now < flight.deadline:
            return False
        else:
            params = flight.pull.params
            reason = (f"no answer from the prefill engine at {params.host}:{params.port} "
                      f"within {self.config.transfer_timeout_s:g} s")
            flight.admission.add_done_callback(close_unused)
        del self._inflight[request_id]
        self._fail(flight.load, reason)
        return False

    def _poll_reads(self) -> None:
        assert self._transport is not None
        now = time.monotonic()
        for request_id, flight in list(self._inflight.items()):
            if flight.read is None and not self._admitted(request_id, flight, now):
                continue
            assert flight.read is not None
            state = self._transport.poll(flight.read)
            if state == "PROC" and now < flight.deadline:
                continue
            del self._inflight[request_id]
            self._stats["transfer_s"] += now - flight.started
            if state == "DONE":
                flight.pull.released = True  # the READ's notification ends the lease
                self._finished_pulls.pop(request_id, None)
                self._stats["loaded_blocks"] += flight.pull.num_blocks
                self._stats["loaded_bytes"] += flight.read.num_bytes
                self._recved.add(request_id)
                continue
            if state == "PROC":
                self._transport.abandon(flight.read)
            self._fail(flight.load, "the READ timed out" if state == "PROC"
                       else "the READ failed")

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset()  # asynchronous failures travel in get_finished()

    def get_finished(self) -> ConnectorOutput:
        self._heartbeats()
        if self._inflight:
            self._poll_reads()
        recved, self._recved = frozenset(self._recved), set()
        failures, self._failures = tuple(self._failures), []
        return ConnectorOutput(finished_loads=recved, load_failures=failures,
                               finished_recving=recved,
                               finished_sending=self._finished_sending())

    # ---- control messages (a thread: never block a step on a dead peer) ---------------------
    def _release(self, pull: Pull) -> None:
        if not pull.released and self._control is not None:
            self._control.release(pull, self.config.transfer_timeout_s)
        pull.released = True

    def _heartbeats(self) -> None:
        now = time.monotonic()
        if now < self._heartbeat_at or not self._pulls or self._control is None:
            return
        self._heartbeat_at = now + self.config.lease_s / 3
        self._control.heartbeats(self._pulls.values())

    # ---- both --------------------------------------------------------------------------------
    def stats(self) -> dict[str, ConnectorStats]:
        s = self._stats
        held = len(self._leases) if self._leases is not None else 0
        return {self.name: ConnectorStats(
            self.name, MEDIUM_NIXL, lookups=s["lookups"], hit_blocks=s["hit_blocks"],
            loaded_blocks=s["loaded_blocks"], loaded_bytes=s["loaded_bytes"],
            load_failed_blocks=s["load_failed_blocks"],
            extra={"leases_held": held, "leases_issued": s["sent_leases"],
                   "transfers_refused": s["refused"], "transfer_s": s["transfer_s"],
                   "pulls_open": len(self._pulls)})}

    def shutdown(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for peer in self._peers.values():
            peer.client.close()
        self._peers.clear()
        if self._transport is not None:
            self._transport.shutdown()
            self._transport = None

