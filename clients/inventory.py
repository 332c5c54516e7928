"""Engine side of the advisory inventory: publish what this engine retains, look up peers.

    publisher = InventoryPublisher(session, dump=lambda: cache.retained_blocks())
    session = EngineSession(target, registration, handler=PublishingHandler(publisher, mine))
    await session.start()
    await publisher.stored([h0, h1, h2], tier=Tier.GPU)
    await publisher.removed([h2])

    lookups = LookupClient(target)
    result = await lookups.lookup("prefill-0", chain, min_blocks=4)
    if result.candidates: ...

`InventoryPublisher` numbers batches per incarnation (0, 1, 2, ...; back to 0
after each re-registration), splits events into bounded batches, and answers a
ResyncRequest, or a re-registration, with a full dump from the engine's `dump()`
callback, chunked into bounded batches between `dump_begin` and `dump_end`.
Publishes wait while a dump runs, so the coordinator sees them after it.
Engines never touch protobuf; failures raise `clients.errors` exceptions.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import grpc

from clients.errors import InvalidArgumentError, UnavailableError, from_rpc_error
from clients.session import (
    ChildEngineState,
    EngineSession,
    EngineStub,
    NullHandler,
    RegisterAck,
    ReuseInfo,
    SessionChannels,
    SessionHandler,
)
from kvrc.credentials import ChannelOptions, connect
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import (
    MAX_BLOCK_HASH_BYTES,
    MAX_BLOCKS_PER_BATCH,
    MAX_CHAIN_BLOCKS,
    MAX_EVENTS_PER_BATCH,
    MAX_GROUP_IDX,
    Tier,
)

log = logging.getLogger("kvrc.client.inventory")

# The coordinator's limits (kvrc/vocabulary.py); batches are cut below them.
MAX_QUERIES_PER_LOOKUP = 64


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    block_hashes: tuple[bytes, ...]  # a chain segment, parent first
    parent_block_hash: bytes = b""  # empty: the segment starts a chain
    num_tokens: int = 0
    tier: Tier = Tier.GPU
    group_idx: int = 0
    expiry_unix_ms: int = 0  # 0 = no expiry


@dataclass(frozen=True, slots=True)
class RemovedBlocks:
    block_hashes: tuple[bytes, ...]
    tier: Tier = Tier.GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllCleared:
    pass


InventoryEvent = StoredBlocks | RemovedBlocks | AllCleared
DumpFn = Callable[[], Iterable[StoredBlocks]]


def _blocks(event: InventoryEvent) -> int:
    return 0 if isinstance(event, AllCleared) else len(event.block_hashes)


def _checked(event: InventoryEvent) -> InventoryEvent | None:
    """The event as kvrc will take it; None: nothing to say (no blocks). What kvrc would
    refuse raises here, before anything is sent: refused there, it ends the rank part's
    session, and the dump after re-registration would end the next one (I8-bad-input)."""
    if isinstance(event, AllCleared):
        return event
    if not event.block_hashes:
        return None
    kind = "stored" if isinstance(event, StoredBlocks) else "removed"
    lengths = {*map(len, event.block_hashes)}  # C-level; usually one length
    if min(lengths) < 1 or max(lengths) > MAX_BLOCK_HASH_BYTES:
        bad = next(h for h in event.block_hashes if not 0 < len(h) <= MAX_BLOCK_HASH_BYTES)
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{kind} block hash of {len(bad)} bytes; block hashes are 1..{MAX_BLOCK_HASH_BYTES}",
        )
    if isinstance(event, StoredBlocks) and len(event.parent_block_hash) > MAX_BLOCK_HASH_BYTES:
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"parent block hash of {len(event.parent_block_hash)} bytes; the limit is "
            f"{MAX_BLOCK_HASH_BYTES}",
        )
    if not 0 <= event.group_idx <= MAX_GROUP_IDX:
        raise InvalidArgumentError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"{kind} group_idx {event.group_idx} is outside 0..{MAX_GROUP_IDX}",
        )
    return event


def _split(event: InventoryEvent, limit: int) -> Iterator[InventoryEvent]:
    """Cuts an event into pieces of at most `limit` hashes (a stored chain stays chained)."""
    if isinstance(event, AllCleared) or len(event.block_hashes) <= limit:
        yield event
        return
    hashes = event.block_hashes
    for start in range(0, len(hashes), limit):
        part = hashes[start : start + limit]
        if isinstance(event, StoredBlocks):
            tokens_per_block = event.num_tokens // len(hashes) if hashes else 0
            yield StoredBlocks(
                block_hashes=part,
                parent_block_hash=hashes[start - 1] if start else event.parent_block_hash,
                num_tokens=tokens_per_block * len(part),
                tier=event.tier,
                group_idx=event.group_idx,
                expiry_unix_ms=event.expiry_unix_ms,
            )
        else:
            yield RemovedBlocks(part, event.tier, event.group_idx)


def chunk_events(
    events: Iterable[InventoryEvent],
    max_events: int = MAX_EVENTS_PER_BATCH,
    max_blocks: int = MAX_BLOCKS_PER_BATCH,
) -> Iterator[list[InventoryEvent]]:
    """Groups events, in order, into batches within both limits (lazily)."""
    if max_events < 1 or max_blocks < 1:
        raise ValueError("batch limits must be >= 1")
    batch: list[InventoryEvent] = []
    blocks = 0
    for given in events:
        event = _checked(given)
        if event is None:
            continue
        for piece in _split(event, min(max_blocks, MAX_CHAIN_BLOCKS)):
            n = _blocks(piece)
            if batch and (len(batch) >= max_events or blocks + n > max_blocks):
                yield batch
                batch, blocks = [], 0
            batch.append(piece)
            blocks += n
    if batch:
        yield batch


def _event_to_proto(event: InventoryEvent) -> pb.InventoryEvent:
    if isinstance(event, StoredBlocks):
        return pb.InventoryEvent(
            stored=pb.BlockStored(
                block_hashes=list(event.block_hashes),
                parent_block_hash=event.parent_block_hash,
                num_tokens=event.num_tokens,
                tier=pb.Tier.ValueType(event.tier),
                group_idx=event.group_idx,
                expiry_unix_ms=event.expiry_unix_ms,
            )
        )
    if isinstance(event, RemovedBlocks):
        return pb.InventoryEvent(
            removed=pb.BlockRemoved(
                block_hashes=list(event.block_hashes),
                tier=pb.Tier.ValueType(event.tier),
                group_idx=event.group_idx,
            )
        )
    return pb.InventoryEvent(cleared=pb.AllBlocksCleared())


class InventoryPublisher:
    """Publishes one stream's inventory events over an `EngineSession`.

    Per child engine (vLLM's way) one rank part publishes for the engine; per
    rank part each part publishes its own. Not for use from several tasks at
    once without awaiting (calls are serialized by a lock anyway).
    """

    def __init__(
        self,
        session: EngineSession,
        dump: DumpFn | None = None,
        *,
        max_events_per_batch: int = 256,
        max_blocks_per_batch: int = 4096,
    ) -> None:
        if not 1 <= max_events_per_batch <= MAX_EVENTS_PER_BATCH:
            raise ValueError(f"max_events_per_batch must be in 1..{MAX_EVENTS_PER_BATCH}")
        if not 1 <= max_blocks_per_batch <= MAX_BLOCKS_PER_BATCH:
            raise ValueError(f"max_blocks_per_batch must be in 1..{MAX_BLOCKS_PER_BATCH}")
        self.session = session
        self._dump = dump
        self._max_events = max_events_per_batch
        self._max_blocks = max_blocks_per_batch
        self._lock = asyncio.Lock()
        self._incarnation: int | None = None
        self._next_sequence = 0
        self.dumps_sent = 0
        self._dump_task: asyncio.Task[int] | None = None

    @property
    def incarnation(self) -> int | None:
        return self._incarnation

    @property
    def next_sequence(self) -> int:
        return self._next_sequence

    # --- publishing ------------------------------------------------------------------

    async def publish(self, events: Sequence[InventoryEvent]) -> int:
        """Sends the events in order, in as many batches as the limits need; returns batches.

        Raises UnavailableError at once while the session is not connected, and when a
        write breaks it (each write is bounded by the session's write timeout): callers
        do not queue up behind a frozen coordinator. Nothing is lost for good: after the
        re-registration the dump replaces the stream's state."""
        self._require_connected()
        # Every event checked before any is sent (`_checked`).
        batches = list(chunk_events(events, self._max_events, self._max_blocks))
        async with self._lock:
            self._require_connected()  # the stream broke while this waited for the lock
            for batch in batches:
                await self._send(batch)
            return len(batches)

    async def stored(
        self,
        block_hashes: Sequence[bytes],
        *,
        parent_block_hash: bytes = b"",
        num_tokens: int = 0,
        tier: Tier = Tier.GPU,
        group_idx: int = 0,
        expiry_unix_ms: int = 0,
    ) -> None:
        event = StoredBlocks(
            tuple(block_hashes), parent_block_hash, num_tokens, tier, group_idx, expiry_unix_ms
        )
        await self.publish([event])

    async def removed(
        self, block_hashes: Sequence[bytes], *, tier: Tier = Tier.GPU, group_idx: int = 0
    ) -> None:
        await self.publish([RemovedBlocks(tuple(block_hashes), tier, group_idx)])

    async def cleared(self) -> None:
        await self.publish([AllCleared()])

    async def send_dump(self) -> int:
        """Replaces this stream's state at the coordinator with `dump()`; returns batches."""
        if self._dump is None:
            raise RuntimeError("InventoryPublisher has no dump callback")
        async with self._lock:
            batches = list(chunk_events(self._dump(), self._max_events, self._max_blocks))
            if not batches:
                batches = [[]]  # an empty dump still replaces the state
            for i, batch in enumerate(batches):
                await self._send(batch, dump_begin=i == 0, dump_end=i == len(batches) - 1)
            self.dumps_sent += 1
            return len(batches)

    # --- what the session handler forwards ----------------------------------------------

    async def on_registered(self, ack: RegisterAck) -> None:
        """A new incarnation starts at sequence 0; after a re-registration, resend a dump."""
        first = self.session.registrations <= 1
        self._sync_incarnation(ack.incarnation)
        if not first and self._dump is not None:
            self._spawn_dump("re-registered")

    async def on_resync_request(self, expected_sequence: int, reason: str) -> None:
        log.info("coordinator asks for a full dump (%s)", reason)
        if self._dump is None:
            log.warning("resync requested but no dump callback: the stream stays stale")
            return
        self._spawn_dump("resync")

    # --- internals ------------------------------------------------------------------------

    def _require_connected(self) -> None:
        # Before start() `_send` says so (RuntimeError): a bug, not an outage.
        if self.session.ack is not None and not self.session.connected:
            raise UnavailableError(
                grpc.StatusCode.UNAVAILABLE,
                "the session is not connected (the dump after re-registration catches up)",
            )

    def _sync_incarnation(self, incarnation: int) -> None:
        if incarnation != self._incarnation:
            self._incarnation = incarnation
            self._next_sequence = 0

    def _spawn_dump(self, why: str) -> None:
        # Off the session's reader: a long dump must not hold up heartbeat acks.
        task = asyncio.get_running_loop().create_task(self.send_dump(), name=f"kvrc-dump-{why}")
        task.add_done_callback(_log_dump_failure)
        self._dump_task = task

    async def wait_dump(self) -> None:
        """Waits for a dump started by a resync or re-registration (tests, shutdown)."""
        if self._dump_task is not None:
            await asyncio.shield(self._dump_task)

    async def _send(
        self, events: Sequence[InventoryEvent], *, dump_begin: bool = False, dump_end: bool = False
    ) -> None:
        ack = self.session.ack
        if ack is None:
            raise RuntimeError("the session is not registered yet (await session.start())")
        self._sync_incarnation(ack.incarnation)
        batch = pb.EventBatch(
            incarnation=ack.incarnation,
            sequence=self._next_sequence,
            events=[_event_to_proto(e) for e in events],
            dump_begin=dump_begin,
            dump_end=dump_end,
        )
        await self.session.send_event_batch(batch)
        self._next_sequence += 1


def _log_dump_failure(task: asyncio.Task[int]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("inventory dump failed: %s", task.exception())


class PublishingHandler(NullHandler):
    """A `SessionHandler` that feeds the publisher and forwards everything to `inner`."""

    def __init__(self, publisher: InventoryPublisher, inner: SessionHandler | None = None) -> None:
        self.publisher = publisher
        self.inner: SessionHandler = inner if inner is not None else NullHandler()

    async def on_registered(self, ack: RegisterAck) -> None:
        await self.publisher.on_registered(ack)
        await self.inner.on_registered(ack)

    async def on_state(self, state: ChildEngineState) -> None:
        await self.inner.on_state(state)

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        await self.publisher.on_resync_request(request.expected_sequence, request.reason)
        await self.inner.on_resync_request(request)

    async def on_pin_request(self, request: pb.PinRequest) -> None:
        await self.inner.on_pin_request(request)

    async def on_release_request(self, request: pb.ReleaseRequest) -> None:
        await self.inner.on_release_request(request)

    async def on_abort_request(self, request: pb.AbortRequest) -> None:
        await self.inner.on_abort_request(request)

    async def on_quarantine_notice(self, notice: pb.QuarantineNotice) -> None:
        await self.inner.on_quarantine_notice(notice)

    async def on_drain_notice(self, notice: pb.DrainNotice) -> None:
        await self.inner.on_drain_notice(notice)

    def held_leases(self) -> Mapping[str, str]:
        return self.inner.held_leases()  # restart recovery: the inner lease handler's


# --- lookup -------------------------------------------------------------------------------


class LookupOutcome(enum.Enum):
    HIT = "hit"
    MISS = "miss"  # nobody holds the first block
    BELOW_MIN_BLOCKS = "below_min_blocks"
    REUSE_UNAVAILABLE = "reuse_unavailable"  # see LookupResult.reuse.reason


_OUTCOMES = {
    pb.LOOKUP_OUTCOME_HIT: LookupOutcome.HIT,
    pb.LOOKUP_OUTCOME_MISS: LookupOutcome.MISS,
    pb.LOOKUP_OUTCOME_BELOW_MIN_BLOCKS: LookupOutcome.BELOW_MIN_BLOCKS,
    pb.LOOKUP_OUTCOME_REUSE_UNAVAILABLE: LookupOutcome.REUSE_UNAVAILABLE,
}


@dataclass(frozen=True, slots=True)
class LookupQuery:
    block_hashes: tuple[bytes, ...]
    compatibility_hash: str = ""  # "" = the requester's own
    min_blocks: int = 0
    include_self: bool = False
    max_candidates: int = 0  # 0 = the coordinator's default (4)
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class Candidate:
    child_engine_id: str
    matched_blocks: int  # contiguous from the start of the chain
    tier: Tier  # slowest tier among the matched blocks
    expiry_unix_ms: int  # earliest expiry among them; 0 = none
    leases_in_flight: int


@dataclass(frozen=True, slots=True)
class LookupResult:
    outcome: LookupOutcome
    candidates: tuple[Candidate, ...]  # best first
    reuse: ReuseInfo


class LookupClient:
    """`EngineService.Lookup` without protobuf. Owns its channel unless given one; given
    `SessionChannels`, asks the replica the session is on at that moment."""

    def __init__(
        self,
        target: str | ChannelOptions | SessionChannels,
        *,
        channel: grpc.aio.Channel | None = None,
    ) -> None:
        if isinstance(target, SessionChannels):
            self._own = False
            self._channel: grpc.aio.Channel | None = None
            self._stubs = EngineStub(target)
        else:
            self._own = channel is None
            self._channel = channel if channel is not None else connect(target)
            self._stubs = EngineStub(self._channel)

    @property
    def _stub(self) -> pb_grpc.EngineServiceAsyncStub:
        return self._stubs.current()

    async def close(self) -> None:
        if self._own and self._channel is not None:
            await self._channel.close(None)

    async def __aenter__(self) -> LookupClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def lookup(
        self,
        requester_child_engine_id: str,
        block_hashes: Sequence[bytes],
        *,
        compatibility_hash: str = "",
        min_blocks: int = 0,
        include_self: bool = False,
        max_candidates: int = 0,
        group_idx: int = 0,
        timeout_s: float | None = 5.0,
    ) -> LookupResult:
        query = LookupQuery(
            tuple(block_hashes),
            compatibility_hash,
            min_blocks,
            include_self,
            max_candidates,
            group_idx,
        )
        return (await self.lookup_many(requester_child_engine_id, [query], timeout_s=timeout_s))[0]

    async def lookup_many(
        self,
        requester_child_engine_id: str,
        queries: Sequence[LookupQuery],
        *,
        timeout_s: float | None = 5.0,
    ) -> tuple[LookupResult, ...]:
        """One RPC for several queries (at most 64); results in query order."""
        if len(queries) > MAX_QUERIES_PER_LOOKUP:
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(queries)} queries; at most {MAX_QUERIES_PER_LOOKUP} per call",
            )
        request = pb.LookupRequest(
            requester_child_engine_id=requester_child_engine_id,
            queries=[
                pb.LookupQuery(
                    block_hashes=list(q.block_hashes),
                    compatibility_hash=q.compatibility_hash,
                    min_blocks=q.min_blocks,
                    include_self=q.include_self,
                    max_candidates=q.max_candidates,
                    group_idx=q.group_idx,
                )
                for q in queries
            ],
        )
        try:
            response = await self._stub.Lookup(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e) from None
        return tuple(
            LookupResult(
                outcome=_OUTCOMES.get(r.outcome, LookupOutcome.MISS),
                candidates=tuple(
                    Candidate(
                        c.child_engine_id,
                        c.matched_blocks,
                        Tier(c.tier) if c.tier in _TIER_VALUES else Tier.EXTERNAL,
                        c.expiry_unix_ms,
                        c.leases_in_flight,
                    )
                    for c in r.candidates
                ),
                reuse=ReuseInfo.from_proto(r.reuse),
            )
            for r in response.results
        )


_TIER_VALUES = frozenset(int(t) for t in Tier)
