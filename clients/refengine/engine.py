"""The reference engine: one process per rank part, tp rank 0 leads.

How the rank parts of one engine cooperate (vLLM's scheduler/worker split):

* every rank part (`RankPart`) owns its slice of the KV cache (a `PagedKvCache`
  registered once with its own Mooncake transfer engine), its own kvrc session
  (registration, pin answers, releases, aborts) and its own transfer reports;
* tp rank 0 also runs the `Leader`: the one `BlockPool` of the engine (which
  cache block holds what, LRU, pins, retention, taint), the inventory stream
  (published per child engine), the kvrc calls made once per request (Lookup,
  RequestPrefixLoad, BeginHandoff, ExtendHandoff), and a control channel on
  127.0.0.1 that followers and drivers connect to;
* followers (`--leader HOST:PORT`) connect to that channel; the leader sends
  every rank part the same command with explicit block ids ("compute these
  positions into these blocks", "pull your slice of this grant into these
  blocks", "publish your part of this handoff"), so all parts hold the same
  blocks without sharing state. A PinRequest reaching a follower's session is
  answered with block ids the leader pins once per lease.

Handoff leases: a ReleaseRequest names only the lease id, which the prefill
does not learn from PublishHandoff; the driver passes it on from the decode's
grant (`bind_handoff`), and a release that arrives first is remembered.

Drain: on a DrainNotice (`kvrc drain`) the engine asks for no new prefix
load; loads and handoffs already running finish, and requests are still
served (computed locally). kvrc itself stops granting loads from it.

Every channel to kvrc is made from `EngineOptions.coordinator` (TLS, mutual
TLS, bearer token: kvrc/credentials.py).

Every process prints JSON lines on stdout (`listening`, `registered`, `ready`,
`granted`, `draining`, ...) for the orchestrator and tests; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from typing import Any

import torch

from clients.errors import KvrcClientError, first_refusal, outcome_unknown
from clients.hashing import hash_block_chain
from clients.holds import HoldDeadlines, pin_hold_s
from clients.inventory import (
    InventoryEvent,
    InventoryPublisher,
    LookupClient,
    LookupOutcome,
    RemovedBlocks,
    StoredBlocks,
)
from clients.kv_cache import IncompatibleLayoutError, KvCacheLayout, PagedKvCache
from clients.leases import (
    HANDOFF_ENDED_STATES,
    LeaseClient,
    LeaseSessionHandler,
    Miss,
    PinAnswer,
    PinRequestInfo,
    publish_rounds,
)
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from clients.refengine.blocks import BlockPool, PoolExhaustedError, StoredBlock
from clients.refengine.channel import Channel
from clients.refengine.compute import expected_blocks, write_positions
from clients.refengine.ledger import ReadLedger, ReleaseLedger
from clients.refengine.options import EngineOptions, options_from_args
from clients.refengine.pull_hook import NO_PULL_HOOK, PullContext, PullHook
from clients.refengine.tasks import BackgroundTasks
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    NullHandler,
    RankPartRegistration,
    RegisterAck,
    SessionChannels,
)
from clients.transfer import (
    InFlightReads,
    NativeRead,
    TransferOutcome,
    TransferResult,
    combine_outcomes,
    endpoint_to_session,
    plan_rank_part_pull,
    pull,
    pull_threads,
    rank_part_descriptor,
)
from kvrc.kv_params import encode_kv_transfer_params
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.vocabulary import Tier

log = logging.getLogger("kvrc.refengine")

RPC_TIMEOUT_S = 10.0
SWEEP_INTERVAL_S = 0.5
# A handoff the coordinator never releases is freed this long after its publish, so
# a lost release cannot leak blocks forever (pins: clients/holds.py).
HANDOFF_SAFETY_S = 300.0
QUIET_POLL_S = 0.05


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


# ---------------------------------------------------------------------------
# Rank part: cache, transfer engine, session, execution of the leader's commands
# ---------------------------------------------------------------------------


class RankPart:
    def __init__(self, options: EngineOptions, *, pull_hook: PullHook = NO_PULL_HOOK) -> None:
        self.options = options
        self.pull_hook = pull_hook  # runs between a grant and each read (tests: faults)
        self.layout = KvCacheLayout(
            num_layers=options.num_layers,
            num_blocks=options.num_blocks,
            block_size=options.block_size,
            num_kv_heads=options.heads_per_rank,
            head_size=options.head_size,
            dtype=options.kv_dtype,
            kv_layout=options.kv_layout,
        )
        self.transfer_engine = MooncakeTransferEngine(
            MooncakeConfig(
                local_hostname=options.mooncake_hostname,
                metadata_server=options.mooncake_metadata,
                protocol=options.mooncake_protocol,
                device_name=options.mooncake_device,
                rpc_port_min=options.mooncake_port_min,
                rpc_port_max=options.mooncake_port_max,
            )
        )
        self.cache = PagedKvCache(self.layout, device=options.device)
        self.endpoint = self.cache.register(self.transfer_engine)
        # A frozen peer holds a thread per read for up to a minute (PeerSlots).
        self.executor, self.peer_slots = pull_threads("pull")
        self.in_flight = InFlightReads()
        self._reads_by_lease: dict[str, list[NativeRead]] = {}
        self.read_ledger = ReadLedger()  # for checks from outside (the soak)
        # Pull calls still running per lease (an abort waits for them), and leases
        # aborted here (a pull not started yet must not start); bounded.
        self._pulls_running: dict[str, list[asyncio.Future[None]]] = {}
        self._aborted: dict[str, None] = {}
        self.leader: Leader | None = None  # set in tp rank 0
        self.leader_channel: Channel | None = None  # set in followers
        self.handler = LeaseSessionHandler(
            pin=self._pin,
            abort=self._abort,
            on_release=self._on_release,
            on_quarantine=self._on_quarantine,
            on_drain=self._on_drain,
            inner=_PartState(self),
        )
        self.session = EngineSession(
            options.coordinator,
            RankPartRegistration(
                engine_id=options.engine_id,
                tp_rank=options.tp_rank,
                tp_size=options.tp_size,
                profile=EngineProfile(
                    model=options.model,
                    block_size=options.block_size,
                    kv_dtype=options.kv_dtype,
                    num_layers=options.num_layers,
                    num_kv_heads=options.num_kv_heads,
                    head_size=options.head_size,
                    kv_layout=options.kv_layout,
                    attention_backend="REFERENCE",
                    gpu_kind="cpu" if options.device == "cpu" else options.device.split(":")[0],
                    reuse_opt_in=options.reuse_opt_in,
                    transfer_backends=("mooncake",),
                ),
                endpoint=endpoint_to_session(self.endpoint),
            ),
            handler=self.handler,
        )
        self.handler.attach(self.session)
        # To the replica this part is registered with, also after the session moved.
        self._channels = SessionChannels(self.session)
        # Prefix loads and their reports on this part's session stream (revision 3).
        self.leases = LeaseClient(
            self._channels, options.child_engine_id, timeout_s=RPC_TIMEOUT_S, session=self.session
        )
        self.handler.replay_reports_of(self.leases)  # a restarted kvrc may wait for them
        self.lookups = LookupClient(self._channels)

    @property
    def tier(self) -> Tier:
        return Tier.CPU if self.cache.device.type == "cpu" else Tier.GPU

    async def close(self) -> None:
        await self.handler.flush_release_acks()  # while the stream is up
        await self.session.close()
        await self.handler.aclose()
        # No read starts from here on (one waiting for its peer's slot would land after
        # the wait below); shutdown waits for native reads: never free memory a read
        # may still write.
        self.peer_slots.close()
        await self.in_flight.wait_all_quiet(timeout_s=5.0)
        await self._channels.close()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # --- commands (from the leader, or the leader's own direct calls) ------------

    async def handle(self, op: str, args: dict[str, Any]) -> Any:
        if op == "compute":
            await asyncio.to_thread(
                write_positions,
                self.cache,
                args["tokens"],
                args["block_ids"],
                args["first_position"],
                tp_rank=self.options.tp_rank,
            )
            return None
        if op == "pull":
            return await self.pull(**args)
        if op == "verify":
            return await asyncio.to_thread(
                self.mismatches, args["tokens"], args["block_ids"], args["first_index"]
            )
        if op == "report":
            await self.report(
                args["flow"], args["lease_id"], TransferOutcome[args["outcome"]], args["error"]
            )
            return None
        if op == "publish_handoff":
            return await self.publish_handoff(**args)
        if op == "wait_quiet":
            await self.wait_quiet(args["block_ids"])
            return None
        if op == "digest":
            return [self.block_digest(block_id) for block_id in args["block_ids"]]
        if op == "read_ledger":
            return self.read_ledger.document()
        if op == "untrack_held":
            for lease_id in args["lease_ids"]:
                self.handler.untrack_held(lease_id)
            return None
        raise ValueError(f"unknown command {op!r}")

    def block_digest(self, block_id: int) -> str:
        """sha256 of one block's bytes, layer after layer (for checks from outside)."""
        digest = hashlib.sha256()
        for layer in range(self.layout.num_layers):
            digest.update(bytes(self.cache.block_bytes_view(layer, block_id).tolist()))
        return digest.hexdigest()

    async def pull(self, **args: Any) -> dict[str, Any]:
        """`_pull`, tracked so that an AbortRequest waits for it (never acks mid-read)."""
        lease_id = str(args["lease_id"])
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pulls_running.setdefault(lease_id, []).append(done)
        try:
            return await self._pull(**args)
        finally:
            done.set_result(None)
            running = self._pulls_running[lease_id]
            running.remove(done)
            if not running:
                del self._pulls_running[lease_id]

    async def _pull(
        self,
        flow: str,
        request_id: str,
        lease_id: str,
        source_parts: Sequence[bytes],
        skip: int,
        local_block_ids: Sequence[int],
        tokens: Sequence[int],
        first_index: int,
        deadline_s: float,
    ) -> dict[str, Any]:
        """Pull this part's slice and report it to kvrc; never raises for a transfer.

        `skip` source blocks are left out (the requester already holds them);
        `first_index` is the request block index of `local_block_ids[0]`.
        The part's `pull_hook` sees the plan before it is read (clients/refengine/pull_hook.py).
        """
        parts = []
        for raw in source_parts:
            descriptor = pb.RankPartDescriptor.FromString(raw)
            del descriptor.block_ids[:skip]
            parts.append(descriptor)
        try:
            plan = plan_rank_part_pull(
                self.endpoint,
                local_block_ids,
                parts,
                tp_rank=self.options.tp_rank,
                tp_size=self.options.tp_size,
            )
        except (IncompatibleLayoutError, ValueError) as exc:
            # Refused before any byte moves: FAILED and already quiet.
            await self.report(flow, lease_id, TransferOutcome.FAILED, f"refused: {exc}")
            return _pull_reply("FAILED", error=f"refused: {exc}", refused=True)
        context = PullContext(flow, request_id, lease_id, self.options.tp_rank)
        plan = await self.pull_hook.before_pull(context, plan)
        if lease_id in self._aborted:
            # kvrc aborted the lease before our read started: it never starts.
            await self.report(flow, lease_id, TransferOutcome.FAILED, "aborted before the read")
            return _pull_reply("FAILED", error="aborted before the read started")

        def submitted(read: NativeRead) -> None:
            # Filed before the read is awaited: a pull cancelled mid-read (a follower's
            # leader channel closing) still leaves it where an abort waits (I6-quiescence).
            self._reads_by_lease.setdefault(lease_id, []).append(read)
            self.read_ledger.read(lease_id, read)

        result = await pull(
            self.transfer_engine,
            plan,
            deadline_s=deadline_s,
            executor=self.executor,
            in_flight=self.in_flight,
            on_submit=submitted,
            peer_slots=self.peer_slots,
        )
        report = result.to_report(
            lease_id=lease_id,
            reporter_child_engine_id=self.options.child_engine_id,
            tp_rank=self.options.tp_rank,
        )
        await self._send_report(flow, report)
        self._forget_quiet_reads()
        # Verified by a separate "verify" once every part's read returned (Leader._pull_all).
        return _pull_reply(
            result.outcome.value,
            nbytes=result.bytes_moved,
            seconds=result.duration_s,
            error=result.error,
            entries=plan.num_entries,
        )

    def mismatches(self, tokens: Sequence[int], block_ids: Sequence[int], first_index: int) -> int:
        """Blocks whose bytes differ from a recomputation (request blocks from `first_index`)."""
        if not block_ids:
            return 0
        indexes = list(range(first_index, first_index + len(block_ids)))
        expected = expected_blocks(self.layout, tokens, indexes, tp_rank=self.options.tp_rank)
        bad = 0
        for row, block_id in enumerate(block_ids):
            if any(
                not torch.equal(self.cache.block_bytes_view(layer, block_id), expected[row, layer])
                for layer in range(self.layout.num_layers)
            ):
                bad += 1
        return bad

    async def report(
        self, flow: str, lease_id: str, outcome: TransferOutcome, error: str = ""
    ) -> None:
        """A report for a transfer that never started (refused, nothing to load)."""
        report = TransferResult(outcome, 0, 0.0, error, ()).to_report(
            lease_id=lease_id,
            reporter_child_engine_id=self.options.child_engine_id,
            tp_rank=self.options.tp_rank,
        )
        await self._send_report(flow, report)

    async def _send_report(self, flow: str, report: pb.TransferReport) -> None:
        try:
            if flow == "prefix_load":
                await self.leases.complete_prefix_load(report)
            else:
                await self.leases.complete_handoff(report)
        except KvrcClientError as e:
            # The coordinator decides from the reports it has (or the lease deadline).
            log.warning("reporting %s %s failed: %s", flow, report.lease_id, e)

    def _forget_quiet_reads(self) -> None:
        for lease_id, reads in list(self._reads_by_lease.items()):
            left = [read for read in reads if not read.is_quiet()]
            if left:
                self._reads_by_lease[lease_id] = left
            else:
                del self._reads_by_lease[lease_id]

    async def publish_handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        decode_child_engine_id: str,
        kv_transfer_params: bytes,
    ) -> dict[str, Any]:
        published = await self.leases.publish_handoff(
            request_id,
            descriptor=rank_part_descriptor(self.endpoint, block_ids, tp_rank=self.options.tp_rank),
            kv_transfer_params=kv_transfer_params,
            num_blocks=len(block_ids),
            decode_child_engine_id=decode_child_engine_id,
        )
        # The lease id lets the leader match the prefill's ReleaseRequest to this request,
        # and this part re-announces the held blocks if kvrc restarts before the release.
        # An ended handoff gets no release: announced as held, a restarted kvrc would
        # rebuild it as a quarantined lease nobody ends (and a drain would never finish).
        if published.lease_id and not published.ended:
            self.handler.track_held(published.lease_id, decode_child_engine_id)
        return {"state": published.state, "lease_id": published.lease_id}

    async def wait_quiet(self, block_ids: Sequence[int]) -> None:
        wanted = set(block_ids)
        # InFlightReads offers no event; quiet is time-based (settle), so poll it.
        while self.in_flight.tainted_among(wanted):  # noqa: ASYNC110
            await asyncio.sleep(QUIET_POLL_S)

    # --- lease callbacks (LeaseSessionHandler) ------------------------------------

    async def _leader_call(self, op: str, **args: Any) -> Any:
        if self.leader is not None:
            return await self.leader.handle_part_request(op, args)
        assert self.leader_channel is not None
        return await self.leader_channel.call(op, timeout_s=RPC_TIMEOUT_S, **args)

    async def _pin(self, info: PinRequestInfo) -> PinAnswer:
        block_ids: list[int] = await self._leader_call(
            "pin",
            lease_id=info.lease_id,
            hashes=list(info.block_hashes),
            deadline_ms=info.deadline_unix_ms,
        )
        if not block_ids:
            return PinAnswer(0)
        descriptor = rank_part_descriptor(self.endpoint, block_ids, tp_rank=self.options.tp_rank)
        return PinAnswer(len(block_ids), descriptor)

    async def _abort(self, lease_id: str, reason: str) -> None:
        """Resolves (and the ack goes out) only once no read of the lease can still land."""
        self._aborted[lease_id] = None
        while len(self._aborted) > 4096:
            del self._aborted[next(iter(self._aborted))]
        # A pull in progress: its read may be submitted any moment; wait for the call.
        for running in list(self._pulls_running.get(lease_id, [])):
            await asyncio.shield(running)
        # Mooncake cannot cancel a read: wait until it returned and settled.
        for read in list(self._reads_by_lease.get(lease_id, [])):
            await read.wait_quiet()

    async def _on_release(self, lease_id: str, reason: str) -> None:
        try:
            await self._leader_call("release", lease_id=lease_id)
        except Exception:
            log.exception("release of %s failed", lease_id)

    def _on_drain(self, child_engine_id: str, deadline_unix_ms: int) -> None:
        # Every part gets the notice; the leader is the one that asks for loads.
        if self.leader is not None:
            self.leader.start_draining(deadline_unix_ms)
        else:
            log.info("drain notice for %s (the leader stops new loads)", child_engine_id)

    async def _on_quarantine(self, lease_id: str, reason: str) -> None:
        # Tainted blocks already stay out of use until quiet; the leader stops the
        # safety net of the lease's pins / handoff blocks (clients/holds.py).
        log.warning("lease %s quarantined: %s", lease_id, reason)
        emit("quarantined", lease_id=lease_id, reason=reason)
        try:
            await self._leader_call("quarantine", lease_id=lease_id)
        except Exception:
            log.exception("quarantine of %s not passed to the leader", lease_id)


def _pull_reply(
    outcome: str,
    *,
    nbytes: int = 0,
    seconds: float = 0.0,
    error: str = "",
    mismatches: int = 0,
    refused: bool = False,
    entries: int = 0,
) -> dict[str, Any]:
    """One rank part's pull: `seconds` is its native batch read (submit to return),
    `entries` the (local, remote, length) entries of that batch (0: no read ran)."""
    return {
        "outcome": outcome,
        "bytes": nbytes,
        "seconds": seconds,
        "error": error,
        "mismatches": mismatches,
        "refused": refused,
        "entries": entries,
    }


class _PartState(NullHandler):
    """Registration and readiness of a rank part; the leader's publisher follows them."""

    def __init__(self, part: RankPart) -> None:
        self.part = part

    async def on_registered(self, ack: RegisterAck) -> None:
        emit(
            "registered",
            tp_rank=self.part.options.tp_rank,
            session_id=ack.session_id,
            reuse=ack.reuse.reason,
            ready=ack.state.ready,
        )
        leader = self.part.leader
        if leader is not None:
            leader.reuse_enabled = ack.reuse.enabled
            await leader.publisher.on_registered(ack)

    async def on_state(self, state: ChildEngineState) -> None:
        if self.part.leader is not None:
            self.part.leader.reuse_enabled = state.reuse.enabled
            if state.draining:  # a pushed state says so too (a DrainNotice may be lost)
                self.part.leader.start_draining(0)

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        if self.part.leader is not None:
            await self.part.leader.publisher.on_resync_request(
                request.expected_sequence, request.reason
            )


# ---------------------------------------------------------------------------
# Leader: the engine's scheduler (tp rank 0)
# ---------------------------------------------------------------------------


class UnsentEventsLog:
    """Inventory batches not sent while kvrc is down: one WARNING when the outage starts,
    then one per `every_s` with a count while it lasts, and an INFO when events flow
    again; not a WARNING per request."""

    def __init__(self, every_s: float = 30.0) -> None:
        self.every_s = every_s
        self.unsent = 0  # in this outage
        self._unlogged = 0
        self._logged_at = 0.0

    def failed(self, error: Exception) -> None:
        self.unsent += 1
        self._unlogged += 1
        now = time.monotonic()
        if self.unsent == 1 or now - self._logged_at >= self.every_s:
            # Nothing is lost for good: the dump after re-registration replaces the stream.
            log.warning(
                "inventory events not sent (%d batches since the last warning; the dump "
                "after re-registration recovers them): %s",
                self._unlogged,
                error,
            )
            self._unlogged = 0
            self._logged_at = now

    def sent(self) -> None:
        if self.unsent:
            log.info("inventory events sent again; %d batches were not sent", self.unsent)
            self.unsent = self._unlogged = 0


@dataclasses.dataclass
class _HandoffHold:
    request_id: str
    block_ids: list[int]
    until: float  # time.monotonic(): the safety net frees it then, unless quarantined


class Leader:
    def __init__(self, part: RankPart) -> None:
        self.part = part
        self.options = part.options
        self.pool = BlockPool(part.layout.num_blocks)
        self.publisher = InventoryPublisher(part.session, dump=self._dump_events)
        self.unsent_events = UnsentEventsLog()
        self.followers: dict[int, Channel] = {}
        self.all_connected = asyncio.Event()
        if self.options.tp_size == 1:
            self.all_connected.set()
        self.reuse_enabled = False
        self.draining = False  # a DrainNotice came: no new prefix loads from here on
        # Pins' safety nets; also what kvrc quarantined (never freed here, I6-quiescence).
        self._pin_deadlines = HoldDeadlines()
        self._holds: dict[str, _HandoffHold] = {}  # lease id -> blocks held for a handoff
        self._hold_by_request: dict[str, _HandoffHold] = {}
        self._released_unbound: dict[str, None] = {}  # releases of handoffs not yet named
        self.release_ledger = ReleaseLedger()  # for checks from outside (the soak)
        self._server: asyncio.Server | None = None
        # The sweep and the untaints of failed transfers: they end with the leader.
        self._tasks = BackgroundTasks(log)
        self.control_port = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "requests",
                "blocks_local",
                "blocks_loaded",
                "blocks_recomputed",
                "load_failures",
                "handoffs",
                "handoff_failures",
                "pins",
                "loads_skipped_draining",
                "handoff_publish_outcome_unknown",
            ),
            0,
        )

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.options.control_host, 0)
        self.control_port = self._server.sockets[0].getsockname()[1]
        self._tasks.spawn(self._sweep(), name="sweep")

    async def close(self) -> None:
        # First the background work (an untaint still talks to the followers).
        await self._tasks.aclose()
        if self._server is not None:
            self._server.close()
        for channel in self.followers.values():
            await channel.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        follower_rank: list[int] = []

        async def serve(op: str, args: dict[str, Any]) -> Any:
            if op == "hello_follower":
                rank = int(args["tp_rank"])
                if rank in self.followers or not 0 < rank < self.options.tp_size:
                    raise ValueError(f"tp rank {rank} is already connected or out of range")
                self.followers[rank] = channel
                follower_rank.append(rank)
                if len(self.followers) == self.options.tp_size - 1:
                    self.all_connected.set()
                return {"engine_id": self.options.engine_id}
            if follower_rank:
                return await self.handle_part_request(op, args)
            return await self.handle_driver_request(op, args)

        channel = Channel(reader, writer, serve, name="control")
        channel.start()

    def start_draining(self, deadline_unix_ms: int) -> None:
        """No new prefix load from now on; running ones finish (they hold their leases)."""
        if self.draining:
            return
        self.draining = True
        log.warning(
            "draining (deadline %d): no new prefix loads; %d pinned lease(s), %d handoff(s) "
            "held finish",
            deadline_unix_ms,
            len(self._pin_deadlines),
            len(self._hold_by_request),
        )
        emit("draining", engine_id=self.options.engine_id, deadline_unix_ms=deadline_unix_ms)

    # --- inventory events (one stream per child engine) --------------------------

    def _stored(self, entry: StoredBlock) -> StoredBlocks:
        return StoredBlocks(
            block_hashes=(entry.block_hash,),
            parent_block_hash=entry.parent_hash,
            num_tokens=self.options.block_size,
            tier=self.part.tier,
            expiry_unix_ms=entry.expiry_ms,
        )

    def _dump_events(self) -> list[StoredBlocks]:
        return [self._stored(entry) for entry in self.pool.table()]

    async def publish(self, stored: Sequence[StoredBlock], removed: Sequence[bytes]) -> None:
        events: list[InventoryEvent] = []
        if removed:
            events.append(RemovedBlocks(tuple(removed), self.part.tier))
        events += [self._stored(entry) for entry in stored]
        if not events:
            return
        try:
            await self.publisher.publish(events)
        except (KvrcClientError, RuntimeError) as e:
            # The session is down (or broke on this write): no sequence gap is made, the
            # batch is simply not numbered; the dump after re-registration recovers it.
            self.unsent_events.failed(e)
        else:
            self.unsent_events.sent()

    # --- requests from rank parts (pins, releases) --------------------------------

    async def handle_part_request(self, op: str, args: dict[str, Any]) -> Any:
        if op == "pin":
            lease_id = str(args["lease_id"])
            block_ids = self.pool.pin(lease_id, [bytes(h) for h in args["hashes"]], now_ms())
            self._pin_deadlines.hold(lease_id, pin_hold_s(int(args.get("deadline_ms") or 0)))
            self.counters["pins"] += 1
            return list(block_ids)
        if op == "release":
            await self._release(str(args["lease_id"]))
            return None
        if op == "quarantine":
            self._pin_deadlines.quarantine(str(args["lease_id"]))
            return None
        raise ValueError(f"unknown part request {op!r}")

    async def _release(self, lease_id: str) -> None:
        """A ReleaseRequest reached one of our parts: unpin, or free a handoff's blocks."""
        removed: list[bytes] = []
        hold = self._holds.pop(lease_id, None)
        if self._pin_deadlines.discard(lease_id):
            self.release_ledger.released(lease_id)
            removed += self.pool.unpin(lease_id, now_ms())
        elif hold is not None:
            if self._hold_by_request.pop(hold.request_id, None) is not None:
                self.release_ledger.released(lease_id)
                removed += self.pool.release(hold.block_ids, now_ms())
        else:
            # Maybe a handoff we cannot name yet (bind_handoff names it); bounded.
            self._released_unbound[lease_id] = None
            while len(self._released_unbound) > 4096:
                del self._released_unbound[next(iter(self._released_unbound))]
        await self.publish((), removed)

    # --- the driver's requests ----------------------------------------------------

    async def handle_driver_request(self, op: str, args: dict[str, Any]) -> Any:
        if op == "ready":
            return await self.wait_ready(float(args.get("wait_s", 60.0)))
        if op == "prefill":
            timeout_ms = int(args.get("transfer_timeout_ms") or self.options.transfer_timeout_ms)
            if not 100 <= timeout_ms <= 600_000:
                raise ValueError(f"transfer_timeout_ms must be 100..600000, got {timeout_ms}")
            return await self.prefill(
                str(args["request_id"]),
                list(args["tokens"]),
                str(args.get("decode") or ""),
                transfer_timeout_ms=timeout_ms,
            )
        if op == "decode":
            return await self.decode(
                str(args["request_id"]),
                str(args["prefill"]),
                list(args["prompt"]),
                list(args.get("output") or []),
            )
        if op == "bind_handoff":
            await self.bind_handoff(str(args["request_id"]), str(args["lease_id"]))
            return None
        if op == "stats":
            return self.stats()
        if op == "digests":
            return await self.digests(list(args["tokens"]))
        if op == "ledger":
            return {
                "released_at": self.release_ledger.document(),
                "quiet_at": await self._on_all("read_ledger"),
            }
        raise ValueError(f"unknown driver request {op!r}")

    async def digests(self, tokens: list[int]) -> list[list[str]]:
        """Per rank part, the digests of the cached blocks of `tokens`' chain (longest prefix)."""
        block_ids = self.pool.match_prefix(self._hashes(tokens), now_ms())
        self.pool.acquire(block_ids)  # not evicted while read
        try:
            return await self._on_all("digest", block_ids=block_ids)
        finally:
            await self.publish((), self.pool.release(block_ids, now_ms()))

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        await asyncio.wait_for(self.all_connected.wait(), timeout_s)
        state = await self.part.session.wait_ready(timeout_s)
        return {
            "child_engine_id": state.child_engine_id,
            "reuse_enabled": state.reuse.enabled,
            "reuse_reason": state.reuse.reason,
            "tp_size": self.options.tp_size,
            "role": self.options.role,
        }

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            "free_blocks": self.pool.num_free,
            "cached_blocks": self.pool.num_cached,
            "tainted_blocks": len(self.pool.tainted),
            "pinned_leases": len(self.pool.pinned_leases),
            "handoffs_held": len(self._hold_by_request),
            "draining": self.draining,
        }

    def _call(self, rank: int, op: str, args: dict[str, Any]) -> Awaitable[Any]:
        """One command for rank part `rank` (0: this process)."""
        if rank == 0:
            return self.part.handle(op, args)
        return self.followers[rank].call(op, timeout_s=120.0, **args)

    def _calls(self, op: str, args: dict[str, Any]) -> list[Awaitable[Any]]:
        """One command for every rank part, in tp rank order."""
        return [self._call(rank, op, args) for rank in range(self.options.tp_size)]

    async def _on_all(self, op: str, **args: Any) -> list[Any]:
        """Run one command on every rank part (tp rank order); the first error raises."""
        return list(await asyncio.gather(*self._calls(op, args)))

    async def _on_all_settled(self, op: str, **args: Any) -> list[Any]:
        """`_on_all`, waiting for every part: each one's result or its exception."""
        return list(await asyncio.gather(*self._calls(op, args), return_exceptions=True))

    async def _pull_all(self, **args: Any) -> list[dict[str, Any]]:
        """Every part pulls its slice; then, if all succeeded, every part verifies it.

        Verifying only after every read returned keeps the check's CPU work (a
        recomputation) from starving a sibling part's read on a small host: in the
        demo on 2 cores, reads that overlapped a sibling's check took ~10 ms, not ~1.
        """
        results = await self._on_all("pull", **args)
        if all(r["outcome"] == TransferOutcome.SUCCEEDED.value for r in results):
            counts = await self._on_all(
                "verify",
                tokens=args["tokens"],
                block_ids=args["local_block_ids"],
                first_index=args["first_index"],
            )
            for result, count in zip(results, counts, strict=True):
                result["mismatches"] = int(count)
        return results

    def _hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return hash_block_chain(tokens, self.options.block_size, seed=self.options.hash_seed)

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.options.block_size)

    async def _allocate(self, count: int) -> list[int]:
        block_ids, removed = self.pool.allocate(count, now_ms())
        await self.publish((), removed)
        return block_ids

    async def prefill(
        self,
        request_id: str,
        tokens: list[int],
        decode: str,
        *,
        transfer_timeout_ms: int = 0,
    ) -> dict[str, Any]:
        """Prefix load (when kvrc grants one), compute the rest, hand off to `decode`."""
        if not tokens:
            raise ValueError("a request has at least one token")
        if decode and request_id in self._hold_by_request:
            raise ValueError(f"request {request_id!r} already holds a handoff")
        self.counters["requests"] += 1
        bs = self.options.block_size
        hashes = self._hashes(tokens)
        local = self.pool.match_prefix(hashes, now_ms())
        self.pool.acquire(local)
        held = list(local)
        result: dict[str, Any] = {"request_id": request_id, "blocks_local": len(local)}
        try:
            loaded, load = await self._prefix_load(
                request_id,
                tokens,
                hashes,
                len(local),
                transfer_timeout_ms or self.options.transfer_timeout_ms,
            )
            held += loaded
            result.update(load)
            computed_from = len(held)
            held += await self._allocate(self._num_blocks(len(tokens)) - len(held))
            await self._on_all(
                "compute", tokens=tokens, block_ids=held, first_position=computed_from * bs
            )
            result["blocks_recomputed"] = len(held) - computed_from
            await self.publish(self.pool.commit(held[: len(hashes)], hashes, b""), ())
            self.counters["blocks_local"] += len(local)
            self.counters["blocks_recomputed"] += len(held) - computed_from
            if decode:
                params = self._handoff_params(request_id)
                # The handoff's hold owns the blocks from here, whatever its publish does.
                blocks, held = held, []
                result["handoff"] = await self._publish_handoff(request_id, blocks, decode, params)
            else:
                await self.publish((), self.pool.release(held, now_ms()))
            held = []
        finally:
            if held:
                await self.publish((), self.pool.release(held, now_ms()))
        return result

    async def _prefix_load(
        self,
        request_id: str,
        tokens: list[int],
        hashes: list[bytes],
        local_n: int,
        transfer_timeout_ms: int,
    ) -> tuple[list[int], dict[str, Any]]:
        info: dict[str, Any] = {
            "blocks_loaded": 0,
            "bytes": 0,
            "transfer_s": 0.0,
            "reads": 0,
            "read_s": 0.0,
            "read_entries": 0,
            "mismatches": 0,
            "load": "none",
        }
        if not self.reuse_enabled or len(hashes) <= local_n:
            return [], info
        if self.draining:
            self.counters["loads_skipped_draining"] += 1
            info["load"] = "skipped (draining)"
            return [], info
        me = self.options.child_engine_id
        hint = await self.part.lookups.lookup(me, hashes, min_blocks=local_n + 1)
        if hint.outcome is not LookupOutcome.HIT:
            info["load"] = f"miss ({hint.outcome.value})"
            return [], info
        try:
            answer = await self.part.leases.request_prefix_load(
                f"{request_id}/load",
                hashes,
                min_blocks=local_n + 1,
                local_blocks=local_n,  # it pulls the rest (skip=local_n): priced as such
                pin_timeout_ms=self.options.pin_timeout_ms,
                transfer_timeout_ms=transfer_timeout_ms,
            )
        except KvrcClientError as e:  # refused (e.g. reuse off): recompute
            info["load"] = f"refused ({e.code.name.lower()})"
            return [], info
        if isinstance(answer, Miss):
            info["load"] = f"miss ({answer.reason})"
            return [], info
        matched = min(answer.matched_blocks, len(hashes))
        emit(
            "granted",
            lease_id=answer.lease_id,
            source=answer.source_child_engine_id,
            matched_blocks=matched,
            request_id=request_id,
        )
        info["lease_id"] = answer.lease_id
        info["source"] = answer.source_child_engine_id
        if matched <= local_n:
            await self._report_all("prefix_load", answer.lease_id, "SUCCEEDED", "nothing new")
            return [], info
        try:
            block_ids = await self._allocate(matched - local_n)
        except PoolExhaustedError as exc:
            await self._report_all("prefix_load", answer.lease_id, "FAILED", f"no room: {exc}")
            info["load"] = "failed: no room"
            return [], info
        deadline_s = (answer.deadline_unix_ms - now_ms()) / 1000
        try:
            results = await self._pull_all(
                flow="prefix_load",
                request_id=request_id,
                lease_id=answer.lease_id,
                source_parts=[part.SerializeToString() for part in answer.source_parts],
                skip=local_n,
                local_block_ids=block_ids,
                tokens=tokens[: matched * self.options.block_size],
                first_index=local_n,
                deadline_s=max(0.05, min(deadline_s, transfer_timeout_ms / 1000)),
            )
        except BaseException:
            # A rank part did not answer: what its read did is unknown; fail closed.
            self._quarantine_until_quiet(block_ids)
            raise
        if self._combine(results, info):
            info["load"] = "loaded"
            info["blocks_loaded"] = len(block_ids)
            self.counters["blocks_loaded"] += len(block_ids)
            return block_ids, info
        # One failed slice fails the whole load: recompute into other blocks.
        self.counters["load_failures"] += 1
        self._quarantine_until_quiet(block_ids)
        return [], info

    @staticmethod
    def _combine(results: Sequence[dict[str, Any]], info: dict[str, Any]) -> bool:
        """Fold the rank parts' pull replies into `info`; True when the whole transfer is good."""
        outcome = combine_outcomes([TransferOutcome[r["outcome"]] for r in results])
        info["bytes"] = sum(int(r["bytes"]) for r in results)
        # Wall time of the request's transfer (the parts read in parallel) ...
        info["transfer_s"] = max(float(r["seconds"]) for r in results)
        # ... and what the native reads themselves took, summed over the parts.
        reads = [r for r in results if int(r.get("entries", 0)) > 0]
        info["reads"] = len(reads)
        info["read_s"] = sum(float(r["seconds"]) for r in reads)
        info["read_entries"] = sum(int(r["entries"]) for r in reads)
        info["mismatches"] = sum(int(r["mismatches"]) for r in results)
        info["refused"] = any(r["refused"] for r in results)
        info["outcome"] = outcome.value
        good = outcome is TransferOutcome.SUCCEEDED and info["mismatches"] == 0
        if not good:
            errors = "; ".join(
                f"tp{rank}: {r['error']}" for rank, r in enumerate(results) if r["error"]
            )
            info["load"] = f"failed ({outcome.value}): {errors}"
        return good

    async def _report_all(self, flow: str, lease_id: str, outcome: str, error: str) -> None:
        await self._on_all("report", flow=flow, lease_id=lease_id, outcome=outcome, error=error)

    def _quarantine_until_quiet(self, block_ids: list[int]) -> None:
        """Keep a failed transfer's destination blocks out of use until every part is quiet."""
        self.pool.taint(block_ids)

        async def untaint() -> None:
            await self._on_all("wait_quiet", block_ids=block_ids)
            self.pool.untaint(block_ids)

        self._tasks.spawn(untaint(), name=f"untaint {len(block_ids)} block(s)")

    def _handoff_params(self, request_id: str) -> bytes:
        return encode_kv_transfer_params(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": request_id,
                "remote_bootstrap_addr": f"http://{self.options.control_host}:{self.control_port}",
                "remote_engine_id": self.options.engine_id,
            }
        )

    async def _publish_handoff(
        self, request_id: str, held: list[int], decode: str, params: bytes
    ) -> dict[str, Any]:
        self._hold_by_request[request_id] = _HandoffHold(
            request_id, held, time.monotonic() + HANDOFF_SAFETY_S
        )
        args: dict[str, Any] = {
            "request_id": request_id,
            "block_ids": held,
            "decode_child_engine_id": decode,
            "kv_transfer_params": params,
        }
        rounds = publish_rounds(
            lambda rank: self._call(rank, "publish_handoff", args),
            self.options.tp_size,
            asyncio.get_running_loop().time() + HANDOFF_SAFETY_S,
            lambda: request_id in self._hold_by_request,
        )
        try:
            _, answers = await anext(rounds)
        except asyncio.CancelledError:
            raise  # mid-publish: kvrc may have it; the hold's safety net frees the blocks
        except BaseException:
            self._drop_hold(request_id)
            raise
        states, failures = await self._settle_publish(request_id, answers, first=True)
        if not failures:
            return {"states": sorted(states)}
        if request_id in self._hold_by_request:
            # kvrc may have recorded every part, and a decode may read the blocks
            # (I6-quiescence): held until kvrc's release or the safety net, and the parts
            # without an answer go again.
            self.counters["handoff_publish_outcome_unknown"] += 1
            log.warning(
                "handoff %s: publish outcome unknown (%s); holding its blocks",
                request_id,
                next(e for e in failures if outcome_unknown(e)),
            )
            self._tasks.spawn(
                self._publish_again(request_id, rounds), name=f"publish {request_id} again"
            )
        else:
            await rounds.aclose()
        # A refusal says more than a lost answer: raise it first.
        raise first_refusal(failures) or failures[0]

    async def _settle_publish(
        self, request_id: str, answers: list[Any], *, first: bool = False
    ) -> tuple[set[str], list[BaseException]]:
        """Drops or binds the handoff's hold by its parts' answers to a publish: their
        states, and the failures (each part's exception).

        A part refused at its `first` publish was never recorded, so the handoff can
        never be READY (no decode reads) as long as that part is not published again:
        the hold goes, whatever the other parts answered. A refusal of a repeat proves
        nothing: the first may have been recorded and read, and a repeat is refused
        while the engine is not ready (a part reconnecting), so the hold stays
        (I6-quiescence)."""
        results = [a for a in answers if not isinstance(a, BaseException)]
        failures = [a for a in answers if isinstance(a, BaseException)]
        states = {r["state"] for r in results}
        refused = first and first_refusal(failures) is not None
        if states & HANDOFF_ENDED_STATES or refused:
            # Ended before we published, or kvrc refused a part: no release will come.
            self._drop_hold(request_id)
        elif lease_id := next((r["lease_id"] for r in results if r["lease_id"]), ""):
            await self.bind_handoff(request_id, lease_id)
        return states, failures

    async def _publish_again(
        self, request_id: str, rounds: AsyncGenerator[tuple[int, list[Any]], None]
    ) -> None:
        """The rest of a publish whose outcome stayed unknown: its parts without an answer
        go again (kvrc answers a repeat with the handoff's state and lease id) until each
        part answered, the hold goes, or its safety net's time is up. An answer that names
        the lease binds the hold, one that ends the handoff drops it."""
        async for _, answers in rounds:
            await self._settle_publish(request_id, answers)

    async def bind_handoff(self, request_id: str, lease_id: str) -> None:
        """Name the lease of a published handoff (the decode learned it from its grant).

        PublishHandoffResponse does not carry the lease id, and ReleaseRequest
        carries only the lease id: the driver passes it on from the decode.
        """
        hold = self._hold_by_request.get(request_id)
        if hold is None or lease_id in self._holds:
            return
        self._holds[lease_id] = hold
        if lease_id in self._released_unbound:  # the release came first
            del self._released_unbound[lease_id]
            await self._release(lease_id)

    def _lease_ids_of(self, hold: _HandoffHold) -> list[str]:
        return [lease_id for lease_id, held in self._holds.items() if held is hold]

    def _hold_quarantined(self, hold: _HandoffHold) -> bool:
        return any(self._pin_deadlines.is_quarantined(i) for i in self._lease_ids_of(hold))

    def _drop_hold(self, request_id: str) -> list[str]:
        """Frees a handoff's blocks; returns the lease ids that named them."""
        hold = self._hold_by_request.pop(request_id, None)
        if hold is None:
            return []
        lease_ids = self._lease_ids_of(hold)
        for lease_id in lease_ids:
            del self._holds[lease_id]
            self.release_ledger.released(lease_id)
        self.pool.release(hold.block_ids, now_ms())
        return lease_ids

    async def decode(
        self,
        request_id: str,
        prefill: str,
        prompt: list[int],
        output: list[int],
    ) -> dict[str, Any]:
        """Take the prefill's handoff, pull, verify; fall back to recompute; retain."""
        self.counters["requests"] += 1
        grant = await self.part.leases.begin_handoff(
            request_id, prefill, wait_timeout_ms=self.options.transfer_timeout_ms
        )
        result: dict[str, Any] = {"request_id": request_id, "lease_id": grant.lease_id}
        n_prompt = self._num_blocks(len(prompt))
        try:
            block_ids = await self._allocate(n_prompt)
        except PoolExhaustedError as exc:
            await self._report_all("handoff", grant.lease_id, "FAILED", f"no room: {exc}")
            raise
        try:
            async with self.part.leases.keep_alive(grant):
                if grant.num_blocks != n_prompt:
                    error = f"handoff has {grant.num_blocks} blocks, the prompt {n_prompt}"
                    await self._report_all("handoff", grant.lease_id, "FAILED", error)
                    results = [_pull_reply("FAILED", error=error, refused=True)]
                else:
                    results = await self._pull_all(
                        flow="handoff",
                        request_id=request_id,
                        lease_id=grant.lease_id,
                        source_parts=[part.SerializeToString() for part in grant.source_parts],
                        skip=0,
                        local_block_ids=block_ids,
                        tokens=prompt,
                        first_index=0,
                        deadline_s=self.options.transfer_timeout_ms / 1000,
                    )
        except BaseException:
            self._quarantine_until_quiet(block_ids)  # a part did not answer: fail closed
            raise
        if self._combine(results, result):
            result["handoff"] = "pulled"
            result["blocks_recomputed"] = 0
            self.counters["handoffs"] += 1
        else:
            result["handoff"] = result.pop("load")
            result["blocks_recomputed"] = n_prompt
            self.counters["handoff_failures"] += 1
            self.counters["blocks_recomputed"] += n_prompt
            self._quarantine_until_quiet(block_ids)
            block_ids = await self._allocate(n_prompt)
            await self._on_all("compute", tokens=prompt, block_ids=block_ids, first_position=0)
        # "Generate": the driver chose the output tokens; compute their KV, then retain.
        full = prompt + output
        try:
            block_ids += await self._allocate(self._num_blocks(len(full)) - n_prompt)
            await self._on_all(
                "compute", tokens=full, block_ids=block_ids, first_position=len(prompt)
            )
            hashes = self._hashes(full)
            expiry = now_ms() + self.options.retention_ms
            stored = self.pool.commit(block_ids[: len(hashes)], hashes, b"", expiry_ms=expiry)
        finally:
            removed = self.pool.release(block_ids, now_ms())
        await self.publish(stored, removed)
        result["retained_blocks"] = len(hashes)
        return result

    async def _sweep(self) -> None:
        """Retention expiry, and pins / handoffs never released (safety net)."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                await self._sweep_once()
            except Exception:
                log.exception("sweep failed")

    async def _sweep_once(self) -> None:
        now = now_ms()
        removed = self.pool.expire(now)
        dropped: list[str] = []
        for lease_id in self._pin_deadlines.overdue():
            log.warning("pin %s never released; dropping it", lease_id)
            self.release_ledger.released(lease_id)
            removed += self.pool.unpin(lease_id, now)
            dropped.append(lease_id)
        mono_now = time.monotonic()
        for request_id, hold in list(self._hold_by_request.items()):
            if hold.until <= mono_now and not self._hold_quarantined(hold):
                log.warning("handoff %s never released; freeing it", request_id)
                dropped.extend(self._drop_hold(request_id))
        await self.publish((), removed)
        if dropped:
            # No part holds them any more: not re-announced at its next registration (a
            # restarted kvrc would rebuild each one quarantined for blocks nobody pins),
            # and not kept for ever. In the background: a stalled follower must not hold
            # up the next sweep (one that is down keeps them until it starts over).
            self._tasks.spawn(
                self._on_all_settled("untrack_held", lease_ids=dropped),
                name=f"untrack {len(dropped)} held lease(s)",
            )


# ---------------------------------------------------------------------------
# Process entry point
# ---------------------------------------------------------------------------


async def run(options: EngineOptions, *, pull_hook: PullHook = NO_PULL_HOOK) -> int:
    part = RankPart(options, pull_hook=pull_hook)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    leader: Leader | None = None
    try:
        if options.tp_rank == 0:
            leader = Leader(part)
            part.leader = leader
            await leader.start()
            emit(
                "listening",
                control_port=leader.control_port,
                session_name=part.endpoint.session_name,
            )
        else:
            host, _, port = options.leader.rpartition(":")
            part.leader_channel = await Channel.connect(host, int(port), part.handle, name="leader")
            await part.leader_channel.call(
                "hello_follower", tp_rank=options.tp_rank, timeout_s=RPC_TIMEOUT_S
            )
            emit("following", leader=options.leader, session_name=part.endpoint.session_name)
        try:
            await part.session.start()
        except KvrcClientError as e:
            emit("refused", code=e.code.name, message=e.message)
            return 3
        waits: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
        if part.leader_channel is not None:
            waits.append(asyncio.create_task(part.leader_channel.wait_closed()))
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        return 0
    finally:
        if leader is not None:
            await leader.close()
        if part.leader_channel is not None:
            await part.leader_channel.close()
        await part.close()


def run_from_args(args: argparse.Namespace, *, pull_hook: PullHook = NO_PULL_HOOK) -> int:
    """`kvrc engine` (clients/cli.py): `args` from `add_engine_arguments`.

    `pull_hook` runs between each grant and its read (tests pass faults through it).
    """
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {args.engine_id}/tp{args.tp_rank} %(name)s: %(message)s",
    )
    options = options_from_args(args)
    return asyncio.run(run(options, pull_hook=pull_hook))
