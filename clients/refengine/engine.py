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

Every process prints JSON lines on stdout (`listening`, `registered`, `ready`,
`granted`, ...) for the orchestrator and tests; logs go to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import grpc

from clients.errors import KvrcClientError, from_rpc_error
from clients.hashing import hash_block_chain
from clients.kv_cache import IncompatibleLayoutError, KvCacheLayout, PagedKvCache
from clients.kv_params import encode_kv_transfer_params
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from clients.refengine.blocks import BlockPool, PoolExhaustedError, StoredBlock
from clients.refengine.channel import Channel
from clients.refengine.compute import expected_blocks, write_positions
from clients.refengine.options import EngineOptions, add_engine_arguments, options_from_args
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    RankPartRegistration,
    RegisterAck,
    SessionHandler,
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
    rank_part_descriptor,
)
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc

log = logging.getLogger("kvrc.refengine")

RPC_TIMEOUT_S = 10.0
SWEEP_INTERVAL_S = 0.5
# A pin the coordinator never releases is dropped this long after its deadline,
# so a lost release cannot leak blocks forever (the coordinator releases first).
PIN_SAFETY_GRACE_MS = 60_000
HANDOFF_SAFETY_MS = 300_000
EVENTS_PER_BATCH = 512
QUIET_POLL_S = 0.05


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def _outcome(name: str) -> TransferOutcome:
    return TransferOutcome[name]


# ---------------------------------------------------------------------------
# Rank part: cache, transfer engine, session, execution of the leader's commands
# ---------------------------------------------------------------------------


class RankPart(SessionHandler):
    def __init__(self, options: EngineOptions) -> None:
        self.options = options
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
        # A frozen peer holds a thread for up to a minute: room for several.
        self.executor = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="pull")
        self.in_flight = InFlightReads()
        self._reads_by_lease: dict[str, NativeRead] = {}
        self.leader: Leader | None = None  # set in tp rank 0
        self.leader_channel: Channel | None = None  # set in followers
        self.session = EngineSession(
            options.target,
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
            handler=self,
        )
        self._channel = grpc.aio.insecure_channel(options.target)
        self.stub = pb_grpc.EngineServiceStub(self._channel)

    @property
    def tier(self) -> int:
        return pb.TIER_CPU if self.cache.device.type == "cpu" else pb.TIER_GPU

    async def close(self) -> None:
        await self.session.close()
        # Shutdown waits for native reads: never free memory a read may still write.
        await self.in_flight.wait_all_quiet(timeout_s=5.0)
        await self._channel.close(None)
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
        if op == "report":
            await self.report(
                args["flow"], args["lease_id"], _outcome(args["outcome"]), args["error"]
            )
            return None
        if op == "publish_handoff":
            return await self.publish_handoff(**args)
        if op == "wait_quiet":
            await self.wait_quiet(args["block_ids"])
            return None
        if op == "verify":
            return self.mismatches(args["tokens"], args["block_ids"], args["first_index"])
        raise ValueError(f"unknown command {op!r}")

    async def pull(
        self,
        flow: str,
        lease_id: str,
        source_parts: Sequence[bytes],
        skip: int,
        local_block_ids: Sequence[int],
        tokens: Sequence[int],
        first_index: int,
        deadline_s: float,
    ) -> dict[str, Any]:
        """Pull this part's slice, report it to kvrc, verify it; never raises for a transfer."""
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
            return {
                "outcome": "FAILED",
                "refused": True,
                "bytes": 0,
                "seconds": 0.0,
                "error": str(exc),
                "mismatches": 0,
            }
        if self.options.fault_value("bad-remote-address") is not None:
            # Test fault: addresses past the peer's registered memory; the peer refuses.
            far = 1 << 46
            plan = dataclasses.replace(
                plan, remote_addresses=tuple(a + far for a in plan.remote_addresses)
            )
        delay = self.options.fault_value("delay-before-pull")
        if delay:
            await asyncio.sleep(float(delay))
        result = await pull(
            self.transfer_engine,
            plan,
            deadline_s=deadline_s,
            executor=self.executor,
            in_flight=self.in_flight,
        )
        if result.native_read is not None:
            self._reads_by_lease[lease_id] = result.native_read
        await self._report_result(flow, lease_id, result)
        mismatches = 0
        if result.outcome is TransferOutcome.SUCCEEDED:
            mismatches = self.mismatches(tokens, local_block_ids, first_index)
        return {
            "outcome": result.outcome.value,
            "refused": False,
            "bytes": result.bytes_moved,
            "seconds": result.duration_s,
            "error": result.error,
            "mismatches": mismatches,
        }

    def mismatches(self, tokens: Sequence[int], block_ids: Sequence[int], first_index: int) -> int:
        """Blocks whose bytes differ from a recomputation (request blocks from `first_index`)."""
        if not block_ids:
            return 0
        indexes = list(range(first_index, first_index + len(block_ids)))
        expected = expected_blocks(self.layout, tokens, indexes, tp_rank=self.options.tp_rank)
        bad = 0
        for row, block_id in enumerate(block_ids):
            for layer in range(self.layout.num_layers):
                if not bool(
                    (self.cache.block_bytes_view(layer, block_id) == expected[row, layer]).all()
                ):
                    bad += 1
                    break
        return bad

    async def _report_result(self, flow: str, lease_id: str, result: TransferResult) -> None:
        report = result.to_report(
            lease_id=lease_id,
            reporter_child_engine_id=self.options.child_engine_id,
            tp_rank=self.options.tp_rank,
        )
        await self._send_report(flow, report)

    async def report(
        self, flow: str, lease_id: str, outcome: TransferOutcome, error: str = ""
    ) -> None:
        report = TransferResult(outcome, 0, 0.0, error, ()).to_report(
            lease_id=lease_id,
            reporter_child_engine_id=self.options.child_engine_id,
            tp_rank=self.options.tp_rank,
        )
        await self._send_report(flow, report)

    async def _send_report(self, flow: str, report: pb.TransferReport) -> None:
        call = self.stub.CompletePrefixLoad if flow == "prefix_load" else self.stub.CompleteHandoff
        try:
            await call(report, timeout=RPC_TIMEOUT_S)
        except grpc.aio.AioRpcError as e:
            # The coordinator decides from the reports it has (or the lease deadline).
            log.warning("reporting %s %s failed: %s", flow, report.lease_id, from_rpc_error(e))

    async def publish_handoff(
        self,
        request_id: str,
        block_ids: Sequence[int],
        decode_child_engine_id: str,
        kv_transfer_params: bytes,
    ) -> dict[str, Any]:
        request = pb.PublishHandoffRequest(
            request_id=request_id,
            prefill_child_engine_id=self.options.child_engine_id,
            rank=pb.RankCoordinates(tp_rank=self.options.tp_rank),
            descriptor=rank_part_descriptor(self.endpoint, block_ids, tp_rank=self.options.tp_rank),
            kv_transfer_params=kv_transfer_params,
            decode_child_engine_id=decode_child_engine_id,
            num_blocks=len(block_ids),
        )
        response = await self.stub.PublishHandoff(request, timeout=RPC_TIMEOUT_S)
        return {
            "state": int(response.state),
            # Present once the protocol returns the handoff's lease id (see report).
            "lease_id": str(getattr(response, "lease_id", "")),
        }

    async def wait_quiet(self, block_ids: Sequence[int]) -> None:
        wanted = set(block_ids)
        # InFlightReads offers no event; quiet is time-based (settle), so poll it.
        while wanted & self.in_flight.tainted_block_ids():  # noqa: ASYNC110
            await asyncio.sleep(QUIET_POLL_S)

    # --- the session (SessionHandler) ----------------------------------------------

    async def _leader_call(self, op: str, **args: Any) -> Any:
        if self.leader is not None:
            return await self.leader.handle_part_request(op, args)
        assert self.leader_channel is not None
        return await self.leader_channel.call(op, timeout_s=RPC_TIMEOUT_S, **args)

    async def on_registered(self, ack: RegisterAck) -> None:
        emit(
            "registered",
            tp_rank=self.options.tp_rank,
            session_id=ack.session_id,
            reuse=ack.reuse.reason,
            ready=ack.state.ready,
        )
        if self.leader is not None:
            self.leader.on_registered(ack)

    async def on_state(self, state: ChildEngineState) -> None:
        if self.leader is not None:
            self.leader.reuse_enabled = state.reuse.enabled

    async def on_pin_request(self, request: pb.PinRequest) -> None:
        try:
            block_ids: list[int] = await self._leader_call(
                "pin",
                lease_id=request.lease_id,
                hashes=list(request.block_hashes),
                deadline_ms=request.deadline_unix_ms,
            )
            result = pb.PinResult(
                lease_id=request.lease_id,
                pinned_blocks=len(block_ids),
                descriptor=rank_part_descriptor(
                    self.endpoint, block_ids, tp_rank=self.options.tp_rank
                ),
            )
        except Exception as exc:  # a miss, never a crash
            log.warning("pin %s failed: %s", request.lease_id, exc)
            result = pb.PinResult(
                lease_id=request.lease_id, pinned_blocks=0, error_message=str(exc)[:512]
            )
        await self.session.send_pin_result(result)

    async def on_release_request(self, request: pb.ReleaseRequest) -> None:
        with contextlib.suppress(Exception):
            await self._leader_call("release", lease_id=request.lease_id)
        await self.session.send_release_ack(request.lease_id)

    async def on_abort_request(self, request: pb.AbortRequest) -> None:
        read = self._reads_by_lease.get(request.lease_id)

        async def ack_when_quiet() -> None:
            if read is not None:
                await read.wait_quiet()  # Mooncake cannot cancel: wait for its return
            with contextlib.suppress(KvrcClientError):
                await self.session.send_abort_ack(request.lease_id)

        task = asyncio.create_task(ack_when_quiet())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        if self.leader is not None:
            self.leader.schedule_dump()

    async def on_quarantine_notice(self, notice: pb.QuarantineNotice) -> None:
        # Pins and tainted blocks already stay out of use until a release / quiet.
        log.warning("lease %s quarantined: %s", notice.lease_id, notice.reason)
        emit("quarantined", lease_id=notice.lease_id, reason=notice.reason)


_background: set[asyncio.Task[Any]] = set()


# ---------------------------------------------------------------------------
# Leader: the engine's scheduler (tp rank 0)
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _HandoffHold:
    request_id: str
    block_ids: list[int]
    until_ms: int


class Leader:
    def __init__(self, part: RankPart) -> None:
        self.part = part
        self.options = part.options
        self.pool = BlockPool(part.layout.num_blocks)
        self.followers: dict[int, Channel] = {}
        self.all_connected = asyncio.Event()
        if self.options.tp_size == 1:
            self.all_connected.set()
        self.reuse_enabled = False
        self._incarnation = 0
        self._sequence = 0
        self._events_lock = asyncio.Lock()
        self._pin_deadlines: dict[str, int] = {}
        self._holds: dict[str, _HandoffHold] = {}  # lease id -> blocks held for a handoff
        self._hold_by_request: dict[str, _HandoffHold] = {}
        self._released_unbound: set[str] = set()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.control_port = 0
        self.counters: dict[str, int] = {
            "requests": 0,
            "blocks_local": 0,
            "blocks_loaded": 0,
            "blocks_recomputed": 0,
            "load_failures": 0,
            "handoffs": 0,
            "handoff_failures": 0,
            "pins": 0,
        }

    # --- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, self.options.control_host, 0)
        self.control_port = self._server.sockets[0].getsockname()[1]
        self._sweeper = asyncio.create_task(self._sweep())

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for channel in self.followers.values():
            await channel.close()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        channel = Channel(reader, writer, name="control")

        async def first_handler(op: str, args: dict[str, Any]) -> Any:
            if op == "hello_follower":
                rank = int(args["tp_rank"])
                if rank in self.followers or not 0 < rank < self.options.tp_size:
                    raise ValueError(f"tp rank {rank} is already connected or out of range")
                self.followers[rank] = channel
                channel.name = f"follower-{rank}"
                if len(self.followers) == self.options.tp_size - 1:
                    self.all_connected.set()
                return {"engine_id": self.options.engine_id}
            if channel.name.startswith("follower-"):
                return await self.handle_part_request(op, args)
            return await self.handle_driver_request(op, args)

        channel._handler = first_handler
        channel.start()

    # --- inventory events (one stream per child engine) --------------------------

    def on_registered(self, ack: RegisterAck) -> None:
        self._incarnation, self._sequence = ack.incarnation, 0
        self.reuse_enabled = ack.reuse.enabled
        if self.pool.table():
            self.schedule_dump()  # a new incarnation: the coordinator's view starts empty

    def schedule_dump(self) -> None:
        task = asyncio.create_task(self._dump())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _dump(self) -> None:
        events = [self._stored_event(entry) for entry in self.pool.table()]
        async with self._events_lock:
            chunks = [
                events[i : i + EVENTS_PER_BATCH] for i in range(0, len(events), EVENTS_PER_BATCH)
            ]
            chunks = chunks or [[]]
            for index, chunk in enumerate(chunks):
                await self._send_batch(
                    chunk, dump_begin=index == 0, dump_end=index == len(chunks) - 1
                )

    def _stored_event(self, entry: StoredBlock) -> pb.InventoryEvent:
        return pb.InventoryEvent(
            stored=pb.BlockStored(
                block_hashes=[entry.block_hash],
                parent_block_hash=entry.parent_hash,
                num_tokens=self.options.block_size,
                tier=self.part.tier,  # type: ignore[arg-type]
                expiry_unix_ms=entry.expiry_ms,
            )
        )

    async def publish(self, stored: Sequence[StoredBlock], removed: Sequence[bytes]) -> None:
        events = (
            [
                pb.InventoryEvent(
                    removed=pb.BlockRemoved(block_hashes=list(removed), tier=self.part.tier)  # type: ignore[arg-type]
                )
            ]
            if removed
            else []
        )
        events += [self._stored_event(entry) for entry in stored]
        if not events:
            return
        async with self._events_lock:
            for i in range(0, len(events), EVENTS_PER_BATCH):
                await self._send_batch(events[i : i + EVENTS_PER_BATCH])

    async def _send_batch(
        self, events: list[pb.InventoryEvent], dump_begin: bool = False, dump_end: bool = False
    ) -> None:
        batch = pb.EventBatch(
            incarnation=self._incarnation,
            sequence=self._sequence,
            events=events,
            dump_begin=dump_begin,
            dump_end=dump_end,
        )
        self._sequence += 1
        try:
            await self.part.session.send_event_batch(batch)
        except KvrcClientError as e:
            # A lost batch shows as a gap: the coordinator asks for a resync.
            log.warning("event batch %d not sent: %s", batch.sequence, e)

    # --- requests from rank parts (pins, releases) --------------------------------

    async def handle_part_request(self, op: str, args: dict[str, Any]) -> Any:
        if op == "pin":
            lease_id = str(args["lease_id"])
            block_ids = self.pool.pin(lease_id, [bytes(h) for h in args["hashes"]], now_ms())
            deadline = int(args.get("deadline_ms") or 0) or now_ms() + 60_000
            self._pin_deadlines[lease_id] = deadline + PIN_SAFETY_GRACE_MS
            self.counters["pins"] += 1
            return list(block_ids)
        if op == "release":
            await self._release(str(args["lease_id"]))
            return None
        raise ValueError(f"unknown part request {op!r}")

    async def _release(self, lease_id: str) -> None:
        """A ReleaseRequest reached one of our parts: unpin, or free a handoff's blocks."""
        self._pin_deadlines.pop(lease_id, None)
        removed = self.pool.unpin(lease_id, now_ms())
        hold = self._holds.pop(lease_id, None)
        if hold is not None:
            self._hold_by_request.pop(hold.request_id, None)
            removed += self.pool.release(hold.block_ids, now_ms())
        elif lease_id not in self.pool.pinned_leases:
            self._released_unbound.add(lease_id)  # maybe a handoff we cannot name yet
            if len(self._released_unbound) > 4096:
                self._released_unbound.pop()
        await self.publish((), removed)

    # --- the driver's requests ----------------------------------------------------

    async def handle_driver_request(self, op: str, args: dict[str, Any]) -> Any:
        if op == "ready":
            return await self.wait_ready(float(args.get("wait_s", 60.0)))
        if op == "prefill":
            return await self.prefill(
                str(args["request_id"]), list(args["tokens"]), str(args.get("decode") or "")
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
        raise ValueError(f"unknown driver request {op!r}")

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
            "handoffs_held": len(self._holds) + len(self._hold_by_request),
        }

    async def _on_all(self, op: str, **args: Any) -> list[Any]:
        """Run one command on every rank part (tp rank order); the first error raises."""
        calls: list[Awaitable[Any]] = [self.part.handle(op, args)]
        for rank in range(1, self.options.tp_size):
            calls.append(self.followers[rank].call(op, timeout_s=120.0, **args))
        return list(await asyncio.gather(*calls))

    def _hashes(self, tokens: Sequence[int]) -> list[bytes]:
        return hash_block_chain(tokens, self.options.block_size, seed=self.options.hash_seed)

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.options.block_size)

    async def _allocate(self, count: int) -> list[int]:
        block_ids, removed = self.pool.allocate(count, now_ms())
        await self.publish((), removed)
        return block_ids

    async def prefill(self, request_id: str, tokens: list[int], decode: str) -> dict[str, Any]:
        """Prefix load (when kvrc grants one), compute the rest, hand off to `decode`."""
        if not tokens:
            raise ValueError("a request has at least one token")
        self.counters["requests"] += 1
        bs = self.options.block_size
        hashes = self._hashes(tokens)
        local = self.pool.match_prefix(hashes, now_ms())
        self.pool.acquire(local)
        held = list(local)
        result: dict[str, Any] = {"request_id": request_id, "blocks_local": len(local)}
        try:
            loaded, load = await self._prefix_load(request_id, tokens, hashes, len(local))
            held += loaded
            result.update(load)
            computed_from = len(held)
            held += await self._allocate(self._num_blocks(len(tokens)) - len(held))
            await self._on_all(
                "compute", tokens=tokens, block_ids=held, first_position=computed_from * bs
            )
            result["blocks_recomputed"] = len(held) - computed_from
            stored = self.pool.commit(held[: len(hashes)], hashes, b"")
            await self.publish(stored, ())
            self.counters["blocks_local"] += len(local)
            self.counters["blocks_recomputed"] += len(held) - computed_from
            if decode:
                result["handoff"] = await self._publish_handoff(request_id, held, decode)
            else:
                await self.publish((), self.pool.release(held, now_ms()))
            held = []
        finally:
            if held:
                await self.publish((), self.pool.release(held, now_ms()))
        return result

    async def _prefix_load(
        self, request_id: str, tokens: list[int], hashes: list[bytes], local_n: int
    ) -> tuple[list[int], dict[str, Any]]:
        info: dict[str, Any] = {
            "blocks_loaded": 0,
            "bytes": 0,
            "transfer_s": 0.0,
            "mismatches": 0,
            "load": "none",
        }
        if not self.reuse_enabled or len(hashes) <= local_n:
            return [], info
        me = self.options.child_engine_id
        stub = self.part.stub
        lookup = await stub.Lookup(
            pb.LookupRequest(
                requester_child_engine_id=me,
                queries=[pb.LookupQuery(block_hashes=hashes, min_blocks=local_n + 1)],
            ),
            timeout=RPC_TIMEOUT_S,
        )
        if not lookup.results or lookup.results[0].outcome != pb.LOOKUP_OUTCOME_HIT:
            info["load"] = "miss"
            return [], info
        grant = await stub.RequestPrefixLoad(
            pb.PrefixLoadRequest(
                request_id=f"{request_id}/load",
                requester_child_engine_id=me,
                block_hashes=hashes,
                min_blocks=local_n + 1,
                pin_timeout_ms=self.options.pin_timeout_ms,
                transfer_timeout_ms=self.options.transfer_timeout_ms,
            ),
            timeout=RPC_TIMEOUT_S,
        )
        if grant.outcome != pb.GRANT_OUTCOME_GRANTED:
            info["load"] = f"miss: {grant.miss_reason}"
            return [], info
        matched = min(grant.matched_blocks, len(hashes))
        emit(
            "granted",
            lease_id=grant.lease_id,
            source=grant.source_child_engine_id,
            matched_blocks=matched,
            request_id=request_id,
        )
        info["lease_id"] = grant.lease_id
        info["source"] = grant.source_child_engine_id
        if matched <= local_n:
            await self._on_all(
                "report",
                flow="prefix_load",
                lease_id=grant.lease_id,
                outcome="SUCCEEDED",
                error="nothing beyond the local prefix",
            )
            return [], info
        try:
            block_ids = await self._allocate(matched - local_n)
        except PoolExhaustedError as exc:
            await self._on_all(
                "report",
                flow="prefix_load",
                lease_id=grant.lease_id,
                outcome="FAILED",
                error=f"no room: {exc}",
            )
            info["load"] = "no room"
            return [], info
        deadline_s = max(0.05, (grant.deadline_unix_ms - now_ms()) / 1000)
        results = await self._on_all(
            "pull",
            flow="prefix_load",
            lease_id=grant.lease_id,
            source_parts=[part.SerializeToString() for part in grant.source_parts],
            skip=local_n,
            local_block_ids=block_ids,
            tokens=tokens[: matched * self.options.block_size],
            first_index=local_n,
            deadline_s=min(deadline_s, self.options.transfer_timeout_ms / 1000),
        )
        outcome = combine_outcomes([_outcome(r["outcome"]) for r in results])
        info["bytes"] = sum(int(r["bytes"]) for r in results)
        info["transfer_s"] = max(float(r["seconds"]) for r in results)
        info["mismatches"] = sum(int(r["mismatches"]) for r in results)
        info["refused"] = any(r["refused"] for r in results)
        if outcome is TransferOutcome.SUCCEEDED and info["mismatches"] == 0:
            info["load"] = "loaded"
            info["blocks_loaded"] = len(block_ids)
            self.counters["blocks_loaded"] += len(block_ids)
            return block_ids, info
        # One failed slice fails the whole load: recompute into other blocks.
        info["load"] = f"failed ({outcome.value}): " + "; ".join(
            r["error"] for r in results if r["error"]
        )
        self.counters["load_failures"] += 1
        self._quarantine_until_quiet(block_ids)
        return [], info

    def _quarantine_until_quiet(self, block_ids: list[int]) -> None:
        """Keep a failed transfer's destination blocks out of use until every part is quiet."""
        self.pool.taint(block_ids)

        async def untaint() -> None:
            await self._on_all("wait_quiet", block_ids=block_ids)
            self.pool.untaint(block_ids)

        task = asyncio.create_task(untaint())
        _background.add(task)
        task.add_done_callback(_background.discard)

    async def _publish_handoff(
        self, request_id: str, held: list[int], decode: str
    ) -> dict[str, Any]:
        params = encode_kv_transfer_params(
            {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "transfer_id": request_id,
                "remote_bootstrap_addr": f"http://{self.options.control_host}:{self.control_port}",
                "remote_engine_id": self.options.engine_id,
            }
        )
        hold = _HandoffHold(request_id, held, now_ms() + HANDOFF_SAFETY_MS)
        self._hold_by_request[request_id] = hold
        results = await self._on_all(
            "publish_handoff",
            request_id=request_id,
            block_ids=held,
            decode_child_engine_id=decode,
            kv_transfer_params=params,
        )
        lease_id = next((r["lease_id"] for r in results if r["lease_id"]), "")
        if lease_id:
            await self.bind_handoff(request_id, lease_id)
        terminal = {pb.LEASE_STATE_COMPLETED, pb.LEASE_STATE_FAILED, pb.LEASE_STATE_RESOLVED}
        if any(r["state"] in terminal for r in results):
            # Ended before we published: no release will come; free now.
            self._drop_hold(request_id)
        return {"lease_id": lease_id, "state": max(r["state"] for r in results)}

    async def bind_handoff(self, request_id: str, lease_id: str) -> None:
        """Name the lease of a published handoff (the decode learned it from its grant)."""
        hold = self._hold_by_request.get(request_id)
        if hold is None or lease_id in self._holds:
            return
        self._holds[lease_id] = hold
        if lease_id in self._released_unbound:  # the release came first
            self._released_unbound.discard(lease_id)
            await self._release(lease_id)

    def _drop_hold(self, request_id: str) -> None:
        hold = self._hold_by_request.pop(request_id, None)
        if hold is None:
            return
        for lease_id in [k for k, v in self._holds.items() if v is hold]:
            del self._holds[lease_id]
        self.pool.release(hold.block_ids, now_ms())

    async def decode(
        self, request_id: str, prefill: str, prompt: list[int], output: list[int]
    ) -> dict[str, Any]:
        """Take the prefill's handoff, pull, verify; fall back to recompute; retain."""
        self.counters["requests"] += 1
        me = self.options.child_engine_id
        stub = self.part.stub
        grant = await stub.BeginHandoff(
            pb.BeginHandoffRequest(
                request_id=request_id,
                prefill_child_engine_id=prefill,
                decode_child_engine_id=me,
                wait_timeout_ms=self.options.transfer_timeout_ms,
            ),
            timeout=RPC_TIMEOUT_S + self.options.transfer_timeout_ms / 1000,
        )
        result: dict[str, Any] = {
            "request_id": request_id,
            "lease_id": grant.lease_id,
            "bytes": 0,
            "transfer_s": 0.0,
            "mismatches": 0,
        }
        n_prompt = self._num_blocks(len(prompt))
        block_ids = await self._allocate(n_prompt)
        keepalive = asyncio.create_task(self._keep_alive(grant))
        results: list[dict[str, Any]]
        try:
            if grant.num_blocks != n_prompt:
                await self._on_all(
                    "report",
                    flow="handoff",
                    lease_id=grant.lease_id,
                    outcome="FAILED",
                    error=f"handoff has {grant.num_blocks} blocks, prompt {n_prompt}",
                )
                results = [
                    {
                        "outcome": "FAILED",
                        "bytes": 0,
                        "seconds": 0.0,
                        "mismatches": 0,
                        "refused": True,
                        "error": "block count differs",
                    }
                ]
            else:
                results = await self._on_all(
                    "pull",
                    flow="handoff",
                    lease_id=grant.lease_id,
                    source_parts=[part.SerializeToString() for part in grant.source_parts],
                    skip=0,
                    local_block_ids=block_ids,
                    tokens=prompt,
                    first_index=0,
                    deadline_s=self.options.transfer_timeout_ms / 1000,
                )
        finally:
            keepalive.cancel()
        outcome = combine_outcomes([_outcome(r["outcome"]) for r in results])
        result["bytes"] = sum(int(r["bytes"]) for r in results)
        result["transfer_s"] = max(float(r["seconds"]) for r in results)
        result["mismatches"] = sum(int(r["mismatches"]) for r in results)
        result["refused"] = any(r["refused"] for r in results)
        if outcome is TransferOutcome.SUCCEEDED and result["mismatches"] == 0:
            result["handoff"] = "pulled"
            self.counters["handoffs"] += 1
        else:
            result["handoff"] = f"failed ({outcome.value}): " + "; ".join(
                r["error"] for r in results if r["error"]
            )
            self.counters["handoff_failures"] += 1
            self._quarantine_until_quiet(block_ids)
            block_ids = await self._allocate(n_prompt)
            await self._on_all("compute", tokens=prompt, block_ids=block_ids, first_position=0)
            self.counters["blocks_recomputed"] += n_prompt
        result["blocks_recomputed"] = 0 if result["handoff"] == "pulled" else n_prompt
        # "Generate": the driver chose the output tokens; compute their KV.
        full = prompt + output
        try:
            block_ids += await self._allocate(self._num_blocks(len(full)) - n_prompt)
        except PoolExhaustedError:
            await self.publish((), self.pool.release(block_ids, now_ms()))
            raise
        await self._on_all("compute", tokens=full, block_ids=block_ids, first_position=len(prompt))
        hashes = self._hashes(full)
        expiry = now_ms() + self.options.retention_ms
        stored = self.pool.commit(block_ids[: len(hashes)], hashes, b"", expiry_ms=expiry)
        removed = self.pool.release(block_ids, now_ms())
        await self.publish(stored, removed)
        result["retained_blocks"] = len(hashes)
        return result

    async def _keep_alive(self, grant: pb.HandoffGrant) -> None:
        interval_s = max(grant.heartbeat_interval_ms, 100) / 1000
        request = pb.ExtendHandoffRequest(
            lease_id=grant.lease_id, decode_child_engine_id=self.options.child_engine_id
        )
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.part.stub.ExtendHandoff(request, timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.info("extending handoff %s failed: %s", grant.lease_id, from_rpc_error(e))
                return

    async def _sweep(self) -> None:
        """Retention expiry and pins the coordinator never released (safety net)."""
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            try:
                now = now_ms()
                removed = self.pool.expire(now)
                for lease_id, until in list(self._pin_deadlines.items()):
                    if until <= now:
                        log.warning("pin %s never released; dropping it", lease_id)
                        del self._pin_deadlines[lease_id]
                        removed += self.pool.unpin(lease_id, now)
                for request_id, hold in list(self._hold_by_request.items()):
                    if hold.until_ms <= now:
                        log.warning("handoff %s never released; freeing it", request_id)
                        self._drop_hold(request_id)
                await self.publish((), removed)
            except Exception:
                log.exception("sweep failed")


# ---------------------------------------------------------------------------
# Process entry point
# ---------------------------------------------------------------------------


async def run(options: EngineOptions) -> int:
    part = RankPart(options)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvrc engine", description="reference engine rank part")
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s {args.engine_id}/tp{args.tp_rank} %(name)s: %(message)s",
    )
    options = options_from_args(args)
    return asyncio.run(run(options))


if __name__ == "__main__":
    sys.exit(main())
