"""The inventory half of the service: one inventory core fed by two edges.

`InventoryFlow` is owned by `Coordinator` (service.py). It owns the pure
inventory core (`inventory.Inventory`), the ordering of the gRPC publishing
streams (`event_streams.EventStreams`), the expiry sweeper, the ZMQ subscribers
of engines that publish vLLM KV events natively, and the inventory metrics.
No protobuf here: `wire.py` converts, `servicer.py` calls.

Decisions (each has a test in tests/edges/test_service_inventory.py):

- A malformed `EventBatch` (bad sizes, hashes, tiers, group) ends the session
  with INVALID_ARGUMENT naming the field; nothing of it is applied. A batch
  whose incarnation is newer than its session's is malformed too; an older one
  is fenced (counted, dropped), so is a batch of a per-child-engine stream that
  another part of the same child engine took over with a newer incarnation.
- Streams: per rank part, each part's own stream, opened at registration with
  the session's incarnation. Per child engine, any part may publish; the stream
  follows the newest incarnation that published (an older one is fenced).
- A gap marks the engine stale (hidden from lookups) and sends a
  ResyncRequest on the session that published; a full dump makes it fresh.
  Until a dump begins the request is sent again (the engine may have lost it),
  after `resync_retry_initial_ms` doubling to `resync_retry_max_ms`, each one
  counted in `kvrc_resync_requests_total`. Every stale <-> fresh change of a
  child engine goes to `on_stale_changed` (the service pushes its state).
- Events of a child engine that is not READY are held: applied to the core and
  bounded, never returned by a lookup until the engine is READY.
- A holder is visible only while READY, fresh, and its own reuse gate is open
  (a holder that does not opt in is never a source).
- Departure: when a rank part is removed (session closed or heartbeat timeout)
  its stream's inventory goes at once (per child engine: if it was the
  publishing part); when the last part leaves, the child engine leaves the
  inventory. The engine is not READY anyway; a part that comes back has a new
  incarnation and resends a full dump (clients/inventory.py does so).
- Caps: stores past `inventory_max_entries_total` / `_per_engine` are dropped
  and counted in `kvrc_inventory_bound_hits_total` (the core's choice: a
  forgotten block is a miss, never a wrong hint).
- Lookup scope: the query's compatibility hash must be empty or the
  requester's own (INVALID_ARGUMENT otherwise): engines of different
  compatibility never exchange KV.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from coordinator.core.cost_model import CostModel
from coordinator.core.errors import KvrcError, invalid
from coordinator.core.event_streams import EventStreams, StreamAction, StreamKey, StreamPhase
from coordinator.core.events import EventBatch, RankKey, Tier
from coordinator.core.grants import check_own_compatibility
from coordinator.core.inventory import (
    DEFAULT_MAX_CANDIDATES,
    ApplyResult,
    Candidate,
    Inventory,
    LookupOutcome,
    Scope,
)
from coordinator.core.profiles import ReuseReason, ReuseStatus
from coordinator.core.registry import ChildEngineView, RankPartRegistration, Registry, grid_ranks
from coordinator.core.score import (
    MayLend,
    SavingPredictor,
    ScoreAnswer,
    ScoreEngine,
    ScoreQuery,
    TokenHasher,
    score,
    vllm_block_keys,
)
from coordinator.runtime.clock import Clock, Timer
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.log_limit import LogBudget, RateLimitedLog
from coordinator.runtime.metrics import Metrics
from kvrc.vocabulary import PublishMode


class EventStream(Protocol):
    """A subscription to one child engine's own KV-event publisher (vLLM's ZMQ one)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class EventStreamSink(Protocol):
    """What an event stream feeds: the inventory, in order (InventoryFlow's ZMQ side)."""

    def apply(self, child_engine_id: str, batch: EventBatch) -> None: ...

    def drop_engine_inventory(self, child_engine_id: str) -> None: ...

    def mark_stale(self, child_engine_id: str, reason: str) -> None: ...

    def mark_degraded(self, child_engine_id: str, reason: str) -> None: ...

    def mark_live(self, child_engine_id: str) -> None: ...


# Builds the stream a registration names (ValueError / KvrcError when its endpoint is
# refused). The edge that speaks the publisher's wire provides it (edges/zmq_ingest.py).
EventStreamFactory = Callable[[RankPartRegistration, EventStreamSink], EventStream]

log = logging.getLogger("kvrc.inventory")

SOURCE_GRPC = "grpc"
SOURCE_ZMQ = "zmq"
SWEEP_INTERVAL_MS = 1_000
SWEEP_BUDGET = 4096
# The rank part (tp, pp, pcp) that runs with vLLM's EngineCore (its KV-event publisher).
HEAD: RankKey = (0, 0, 0)
_NO_LEASES: Mapping[str, int] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ResyncOrder:
    """Outbound session message: the stream lost events, resend a full dump."""

    reason: str
    expected_sequence: int


class LookupVerdict(enum.Enum):
    """Outcome of one lookup query; values are the `kvrc_lookups_total` outcomes."""

    HIT = "hit"
    MISS = "miss"
    BELOW_MIN_BLOCKS = "below_min_blocks"
    REUSE_UNAVAILABLE = "reuse_unavailable"


class ScoreOutcome(enum.Enum):
    """Outcome of one Score call; values are the `kvrc_score_requests_total` outcomes."""

    HIT = "hit"  # some engine scored a local or loadable block
    MISS = "miss"  # engines scored, none holds the prompt's first block
    NO_ENGINES = "no_engines"  # no engine could be scored (none of the model, or none READY)
    REFUSED = "refused"  # bad input or a hash configuration kvrc does not know


_VERDICT = {
    LookupOutcome.HIT: LookupVerdict.HIT,
    LookupOutcome.MISS: LookupVerdict.MISS,
    LookupOutcome.BELOW_MIN_BLOCKS: LookupVerdict.BELOW_MIN_BLOCKS,
}


@dataclass(frozen=True, slots=True)
class LookupQuery:
    block_hashes: Sequence[bytes]  # the prompt's chain, first block first
    compatibility_hash: str = ""  # "" = the requester's own
    min_blocks: int = 0
    include_self: bool = False
    max_candidates: int = DEFAULT_MAX_CANDIDATES
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class LookupResult:
    outcome: LookupVerdict
    candidates: tuple[Candidate, ...]  # best first
    reuse: ReuseStatus
    best_matched_blocks: int = 0


@dataclass(frozen=True, slots=True)
class EngineInventoryStatus:
    entries: int
    stale: bool


class _Meta:
    """What the facade keeps per child engine for the lookup gate (no view building)."""

    __slots__ = (
        "compatibility_hash",
        "mode",
        "publisher_rank",
        "ready",
        "reuse",
        "stale",
        "zmq",
        "zmq_sink",
        "zmq_source",
    )

    def __init__(self, compatibility_hash: str, mode: PublishMode) -> None:
        self.compatibility_hash = compatibility_hash
        self.mode = mode
        self.ready = False
        self.stale = False  # as last told to on_stale_changed
        self.reuse = ReuseStatus(False, ReuseReason.REQUESTER_NOT_READY, "not READY")
        self.publisher_rank: RankKey | None = None  # per child engine: the part that publishes
        self.zmq: EventStream | None = None
        self.zmq_sink: _ZmqSink | None = None  # retired with its stream
        self.zmq_source: tuple[str, str, str] = ("", "", "")  # what `zmq` subscribed to


_DISABLED = ReuseStatus(
    False,
    ReuseReason.DISABLED_BY_COORDINATOR,
    "reuse is off on this coordinator (start it with --reuse on)",
)
_REUSE_ON = ReuseStatus(True, ReuseReason.ENABLED, "reuse is on on this coordinator")
_UNKNOWN = ReuseStatus(
    False, ReuseReason.REQUESTER_UNKNOWN, "the requester is not a registered child engine"
)
_NOT_READY = ReuseStatus(
    False,
    ReuseReason.REQUESTER_NOT_READY,
    "the requester is not READY (some rank part of its grid is missing)",
)

SendFn = Callable[[str, ResyncOrder], None]  # (session_id, message)


class _ResyncRetry:
    """A stale stream's pending ResyncRequest: resent until a dump begins."""

    __slots__ = ("delay_ms", "expected_sequence", "handle", "incarnation", "session_id")

    def __init__(
        self, session_id: str, incarnation: int, expected_sequence: int, delay_ms: int
    ) -> None:
        self.session_id = session_id
        self.incarnation = incarnation
        self.expected_sequence = expected_sequence
        self.delay_ms = delay_ms
        self.handle: Timer | None = None


class InventoryFlow:
    """Inventory ingest, lookup and status for one coordinator. One event loop."""

    def __init__(
        self,
        config: CoordinatorConfig,
        metrics: Metrics,
        registry: Registry,
        reuse_for: Callable[[ChildEngineView], ReuseStatus],
        clock: Clock,
        send: SendFn,
        inventory: Inventory | None = None,
        *,
        lifecycle_log: LogBudget | None = None,
    ) -> None:
        self._config = config
        self._metrics = metrics
        self._registry = registry
        self._reuse_for = reuse_for
        self._clock = clock
        self._clock_ms = clock.monotonic_ms
        # Sequence gaps an engine can cause at will: one line per 10 s (I8-bad-input).
        self._gap_log = RateLimitedLog(log, self._clock_ms)
        # Engines leaving: the coordinator's lifecycle budget (I8-bad-input).
        self._lifecycle_log = lifecycle_log or LogBudget(self._clock_ms)
        self._send = send
        # A shared store passes its replicated subclass (coordinator/runtime/replication.py).
        self.inventory = (
            inventory
            if inventory is not None
            else Inventory(
                max_entries_total=config.inventory_max_entries_total,
                max_entries_per_engine=config.inventory_max_entries_per_engine,
            )
        )
        self.streams = EventStreams()
        self._meta: dict[str, _Meta] = {}
        self._sweeper: Timer | None = None
        # Engines' own KV-event publishers (None: ingest over the session stream only).
        self.event_streams: EventStreamFactory | None = None
        self._stopping: set[asyncio.Task[None]] = set()  # ZMQ subscribers being closed
        # Per child engine, its last retired subscription still closing: the next one
        # starts after it (it may bind the same endpoint), across a removal of the
        # engine too, and each close waits for the one before.
        self._zmq_closing: dict[str, asyncio.Task[None]] = {}
        # The lease side (set_lease_side): open leases per engine (lookups rank by
        # them), the grants' holder check and the drain set (Score asks both).
        self._leases_in_flight: Callable[[], Mapping[str, int]] = lambda: _NO_LEASES
        self._may_lend: MayLend = lambda holder, compatibility_hash: True
        self._is_draining: Callable[[str], bool] = lambda child_engine_id: False
        # Restart recovery (coordinator/core/recovery.py): a status while warming, else None.
        self.warming: Callable[[], ReuseStatus | None] = lambda: None
        # The service pushes a child engine's state when its staleness changes.
        self.on_stale_changed: Callable[[str], None] = lambda child_engine_id: None
        # One pending retry per stale gRPC stream (bounded by the streams).
        self._resyncs: dict[StreamKey, _ResyncRetry] = {}
        # Score's seams (coordinator/core/score.py): vLLM's hashing of token ids and the
        # predicted saving. The coordinator plugs in the cost model its grants use
        # (set_saving_predictor); alone, a cold one of the same configuration.
        self.token_hasher: TokenHasher = vllm_block_keys
        self.saving_predictor: SavingPredictor = CostModel(config.cost)
        self.prediction_basis = _cost_basis(config)
        self._m_scores = {o: metrics.score_requests.labels(outcome=o.value) for o in ScoreOutcome}
        m = metrics
        # Label children bound once: the lookup path is hot.
        self._m_lookups = {v: m.lookups.labels(outcome=v.value) for v in LookupVerdict}
        self._m_batches = {
            (src, a.value): m.event_batches.labels(source=src, result=a.value)
            for src in (SOURCE_GRPC, SOURCE_ZMQ)
            for a in StreamAction
        }
        self._m_malformed = m.event_batches.labels(source=SOURCE_GRPC, result="malformed")
        self._m_events = {
            (src, kind): m.block_events.labels(source=src, type=kind)
            for src in (SOURCE_GRPC, SOURCE_ZMQ)
            for kind in ("stored", "removed", "cleared")
        }
        self._m_resync = m.resync_requests.labels(source=SOURCE_GRPC)
        self._m_cap_total = m.inventory_bound_hits.labels(bound="total")
        self._m_cap_engine = m.inventory_bound_hits.labels(bound="per_engine")
        self._m_entries = {t: m.inventory_entries.labels(tier=t.name.lower()) for t in Tier}
        self._m_stale = m.child_engines.labels(state="stale")
        self._update_gauges()

    # --- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._sweeper = self._clock.call_later(SWEEP_INTERVAL_MS, self._sweep)

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for key in list(self._resyncs):
            self._cancel_resync(key)
        for cid, meta in self._meta.items():
            self._retire_zmq(cid, meta)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)

    def set_saving_predictor(self, predictor: SavingPredictor) -> None:
        """Score prices matches with the cost model that prefix-load grants use."""
        self.saving_predictor = predictor

    def set_lease_side(
        self,
        leases_in_flight: Callable[[], Mapping[str, int]],
        may_lend: MayLend,
        is_draining: Callable[[str], bool],
    ) -> None:
        """The lease side: how many leases each holder has in flight (lookups rank by
        it), which holders a grant may ask and which engines drain (Score)."""
        self._leases_in_flight = leases_in_flight
        self._may_lend = may_lend
        self._is_draining = is_draining

    # --- registration and departure (called by Coordinator) -------------------------

    def part_registered(
        self,
        registration: RankPartRegistration,
        incarnation: int,
        view: ChildEngineView,
        reuse: ReuseStatus,
    ) -> None:
        cid = registration.child_engine_id
        meta = self._meta.get(cid)
        if meta is None:
            per_part = registration.publish_mode is PublishMode.PER_RANK_PART
            mode = PublishMode.PER_RANK_PART if per_part else PublishMode.PER_CHILD_ENGINE
            ranks = list(grid_ranks(view.profile)) if per_part else []
            self.inventory.add_engine(
                cid, view.compatibility_hash, publish_mode=mode, rank_keys=ranks
            )
            meta = self._meta[cid] = _Meta(view.compatibility_hash, mode)
        if meta.mode is PublishMode.PER_RANK_PART:
            key = StreamKey(cid, registration.rank)
            if self.streams.open_stream(key, incarnation):
                self.inventory.clear_stream(cid, registration.rank)
                self._cancel_resync(key)
        if (
            registration.rank == HEAD
            and meta.zmq is not None
            and _zmq_source(registration) != meta.zmq_source
        ):
            # A new EngineCore publishes elsewhere (or not at all): the old subscription
            # goes, and with it what the old publisher said.
            log.info("child engine %s: its KV-event publisher moved; subscribing anew", cid)
            self._retire_zmq(cid, meta)
            self.inventory.clear_stream(cid, None)
        self._refresh(cid, meta, view, reuse)
        # No push here: the RegisterAck is not sent yet; readiness pushes carry it.
        self._note_stale(cid, meta, push=False)
        if meta.zmq is None:
            # vLLM's KV-event publisher runs in the EngineCore, on the node of rank 0:
            # its registration names the host to subscribe to (with multi-node TP the
            # first part to register may be on another node). Any part's registration
            # starts it, or tries again after a failed start, once rank 0 is here.
            head = next((p.registration for p in view.parts if p.registration.rank == HEAD), None)
            if head is not None and head.kv_events_endpoint:
                self._start_zmq(head, meta)

    def on_part_removed(self, child_engine_id: str, rank: RankKey, reason: str) -> None:
        """PartListener: the part's stream inventory goes now; the last part takes the engine."""
        meta = self._meta.get(child_engine_id)
        if meta is None:
            return
        view = self._registry.get(child_engine_id)
        if view is None:
            self._remove_engine(child_engine_id, meta)
            return
        if meta.mode is PublishMode.PER_RANK_PART:
            self._drop_stream(StreamKey(child_engine_id, rank))
        elif meta.publisher_rank == rank:
            self._drop_stream(StreamKey(child_engine_id, None))
            meta.publisher_rank = None
        self._refresh(child_engine_id, meta, view, self._reuse_for(view))
        self._note_stale(child_engine_id, meta)

    def on_part_gone(self, child_engine_id: str, rank: RankKey, session_id: str) -> None:
        """PartListener: nothing left to do; the inventory went at removal."""

    def _drop_stream(self, key: StreamKey) -> None:
        """The stream's publishing part left: its inventory, ordering and resync retry go."""
        self.inventory.clear_stream(key.child_engine_id, key.rank_key)
        self.streams.close_stream(key)
        self._cancel_resync(key)

    # --- ingest (gRPC edge) -------------------------------------------------------

    def count_malformed(self) -> None:
        self._m_malformed.inc()

    def ingest(
        self,
        child_engine_id: str,
        rank: RankKey,
        session_id: str,
        session_incarnation: int,
        batch: EventBatch,
    ) -> StreamAction:
        """One validated batch from a session. Raises INVALID_ARGUMENT (nothing changes)."""
        if batch.incarnation == 0:
            # Unset (every incarnation kvrc hands out is far above it): an older one is
            # a batch of a past session, dropped; this is a client that never set it.
            self._m_malformed.inc()
            raise invalid(
                "event batch incarnation is 0 (unset): use the incarnation of RegisterAck"
            )
        if batch.incarnation > session_incarnation:
            self._m_malformed.inc()
            raise invalid(
                f"event batch incarnation {batch.incarnation} is newer than this session's "
                f"{session_incarnation} (use the incarnation of RegisterAck)"
            )
        meta = self._meta.get(child_engine_id)
        if meta is None or batch.incarnation < session_incarnation:
            self._m_batches[SOURCE_GRPC, StreamAction.FENCED.value].inc()
            return StreamAction.FENCED
        per_part = meta.mode is PublishMode.PER_RANK_PART
        rank_key = rank if per_part else None
        key = StreamKey(child_engine_id, rank_key)
        try:
            d = self.streams.accept(
                key,
                batch.incarnation,
                batch.sequence,
                dump_begin=batch.dump_begin,
                dump_end=batch.dump_end,
            )
        except KvrcError:  # a number out of range (INVALID_ARGUMENT): nothing changed
            self._m_malformed.inc()
            raise
        action = d.action
        self._m_batches[SOURCE_GRPC, action.value].inc()
        if action is StreamAction.FENCED:
            return action
        if not per_part:
            meta.publisher_rank = rank
        if action is StreamAction.APPLY:
            if d.dump_begins:
                self.inventory.begin_dump(child_engine_id, rank_key)
                self._cancel_resync(key)
            elif d.reset_stream:
                self.inventory.clear_stream(child_engine_id, rank_key)
                self._cancel_resync(key)
            result = self.inventory.apply(
                child_engine_id, batch.events, rank_key=rank_key, now_ms=self._clock_ms()
            )
            if d.dump_ends:
                self.inventory.end_dump(child_engine_id, rank_key)
            self._count_applied(SOURCE_GRPC, result)
            if d.dump_begins or d.dump_ends or d.reset_stream:
                self._note_stale(child_engine_id, meta)
        elif action is StreamAction.GAP:
            if d.reset_stream:
                self.inventory.clear_stream(child_engine_id, rank_key)
            self.inventory.mark_stale(child_engine_id, rank_key)
            self._gap_log.info(
                "stream gap",
                "inventory stream of %s%s lost events (expected sequence %d, got %d): "
                "stale until a full dump",
                child_engine_id,
                f" rank {rank_key}" if rank_key is not None else "",
                d.expected_sequence,
                batch.sequence,
            )
            self._ask_resync(
                key,
                _ResyncRetry(
                    session_id,
                    batch.incarnation,
                    d.expected_sequence,
                    self._config.resync_retry_initial_ms,
                ),
                f"expected sequence {d.expected_sequence}, got {batch.sequence}",
            )
            self._note_stale(child_engine_id, meta)
        self._update_gauges()
        return action

    def request_full_dumps(self, reason: str) -> int:
        """Asks every publishing part here for a full dump; returns the requests sent.

        A shared store that came back empty lost what this replica's engines had
        published; their dumps re-announce it to the other replicas (the local view
        hides each engine only while its dump runs). vLLM's ZMQ publishers have no
        dump: their next events rebuild the others' view.
        """
        sent = 0
        for cid, meta in self._meta.items():
            for ref in self._registry.parts_of(cid):
                if meta.mode is PublishMode.PER_CHILD_ENGINE and meta.publisher_rank != ref.rank:
                    continue
                self._m_resync.inc()
                self._send(ref.session_id, ResyncOrder(reason=reason, expected_sequence=0))
                sent += 1
        return sent

    # --- resync retries ------------------------------------------------------------

    def _ask_resync(self, key: StreamKey, retry: _ResyncRetry, reason: str) -> None:
        """Sends a ResyncRequest now and schedules its resend (replaces a pending one)."""
        self._cancel_resync(key)
        self._m_resync.inc()
        self._send(
            retry.session_id,
            ResyncOrder(reason=reason, expected_sequence=retry.expected_sequence),
        )
        self._resyncs[key] = retry
        retry.handle = self._clock.call_later(
            retry.delay_ms, lambda: self._resend_resync(key, retry)
        )

    def _resend_resync(self, key: StreamKey, retry: _ResyncRetry) -> None:
        if self._resyncs.get(key) is not retry:
            return
        del self._resyncs[key]
        # Only the same incarnation, still stale (a dump that began cancels the retry).
        if (
            self.streams.phase(key) is not StreamPhase.STALE
            or self.streams.incarnation(key) != retry.incarnation
        ):
            return
        waited = retry.delay_ms
        log.info(
            "inventory stream of %s%s still stale %d ms after its ResyncRequest: asking again",
            key.child_engine_id,
            f" rank {key.rank_key}" if key.rank_key is not None else "",
            waited,
        )
        self._ask_resync(
            key,
            _ResyncRetry(
                retry.session_id,
                retry.incarnation,
                retry.expected_sequence,
                min(waited * 2, self._config.resync_retry_max_ms),
            ),
            f"no full dump began within {waited} ms of the previous ResyncRequest "
            f"(expected sequence {retry.expected_sequence})",
        )

    def _cancel_resync(self, key: StreamKey) -> None:
        retry = self._resyncs.pop(key, None)
        if retry is not None and retry.handle is not None:
            retry.handle.cancel()

    def _note_stale(self, child_engine_id: str, meta: _Meta, *, push: bool = True) -> None:
        """Tells the service when the child engine turned stale or fresh."""
        stale = self.is_stale(child_engine_id)
        if stale != meta.stale:
            meta.stale = stale
            if not push:
                return
            try:
                self.on_stale_changed(child_engine_id)
            except Exception:  # a push failure must not undo the ingest
                log.exception("stale change of %s not pushed", child_engine_id)

    # --- lookup ----------------------------------------------------------------

    def reuse_gate(
        self, requester_child_engine_id: str, view: ChildEngineView | None = None
    ) -> ReuseStatus:
        """I1-reuse-off, then the requester's readiness: why reuse is (not) open to it.
        `view`: its registry view, for an engine registered on another replica (its
        parts are in the registry, not in `_meta`): every replica gates it alike."""
        if not self._config.reuse:
            return _DISABLED
        warming = self.warming()
        if warming is not None:
            return warming
        meta = self._meta.get(requester_child_engine_id)
        if meta is not None:
            return meta.reuse if meta.ready else _NOT_READY
        if view is None:
            return _UNKNOWN
        return self._reuse_for(view) if view.ready else _NOT_READY

    def lookup_many(
        self,
        requester_child_engine_id: str,
        queries: Sequence[LookupQuery],
        *,
        leases_in_flight: Mapping[str, int] | None = None,
    ) -> tuple[LookupResult, ...]:
        """Answers each query (same order). INVALID_ARGUMENT for a foreign scope.

        A requester registered on another replica (known from the shared store) is
        answered from its registry view, as its own replica would answer it: every
        replica holds the whole inventory, and grants already take such requesters."""
        meta = self._meta.get(requester_child_engine_id)
        view = None if meta is not None else self._registry.get(requester_child_engine_id)
        reuse = self.reuse_gate(requester_child_engine_id, view)
        if not reuse.enabled:
            counter = self._m_lookups[LookupVerdict.REUSE_UNAVAILABLE]
            counter.inc(len(queries))
            unavailable = LookupResult(LookupVerdict.REUSE_UNAVAILABLE, (), reuse)
            return tuple(unavailable for _ in queries)
        known = meta if meta is not None else view
        assert known is not None  # the gate opens only for a known engine
        own = known.compatibility_hash
        for q in queries:
            check_own_compatibility(q.compatibility_hash, own)
        leases = self._leases_in_flight() if leases_in_flight is None else leases_in_flight
        now = self._clock_ms()
        observe_duration = self._metrics.lookup_duration.observe
        observe_matched = self._metrics.lookup_matched_blocks.observe
        results = []
        for q in queries:
            started = time.perf_counter()
            answer = self.inventory.lookup(
                Scope(own, q.group_idx),
                q.block_hashes,
                now_ms=now,
                min_blocks=q.min_blocks,
                exclude_child_engine_id=None if q.include_self else requester_child_engine_id,
                max_candidates=q.max_candidates,
                leases_in_flight=leases,
            )
            observe_duration(time.perf_counter() - started)
            verdict = _VERDICT[answer.outcome]
            self._m_lookups[verdict].inc()
            observe_matched(answer.best_matched_blocks)
            results.append(
                LookupResult(verdict, answer.candidates, reuse, answer.best_matched_blocks)
            )
        return tuple(results)

    def lookup(
        self,
        requester_child_engine_id: str,
        query: LookupQuery,
        *,
        leases_in_flight: Mapping[str, int] | None = None,
    ) -> LookupResult:
        return self.lookup_many(
            requester_child_engine_id, (query,), leases_in_flight=leases_in_flight
        )[0]

    def best_holder(
        self,
        requester_child_engine_id: str,
        block_hashes: Sequence[bytes],
        *,
        group_idx: int = 0,
        min_blocks: int = 1,
        leases_in_flight: Mapping[str, int] | None = None,
    ) -> tuple[Candidate | None, LookupResult]:
        """The top candidate for a prefix load (None on a miss or a closed gate)."""
        result = self.lookup(
            requester_child_engine_id,
            LookupQuery(tuple(block_hashes), min_blocks=min_blocks, group_idx=group_idx),
            leases_in_flight=leases_in_flight,
        )
        return (result.candidates[0] if result.candidates else None), result

    # --- score (routers) ------------------------------------------------------------

    def score(self, query: ScoreQuery) -> ScoreAnswer:
        """One Score request: the engines to score from the registry, then one core call.

        Read only: nothing here changes state (expired entries met are purged, as a
        lookup does). Raises INVALID_ARGUMENT / FAILED_PRECONDITION, counted refused.
        """
        started = time.perf_counter()
        if query.candidates:
            views = [(cid, self._registry.get(cid)) for cid in query.candidates]
        else:
            views = [
                (v.child_engine_id, v)
                for v in self._registry.views()
                if v.profile.model == query.model
            ]
        engines = [
            ScoreEngine(cid, None)
            if view is None
            else ScoreEngine(
                cid,
                view.profile,
                view.compatibility_hash,
                view.ready,
                self.reuse_gate(cid, view),
                self._is_draining(cid),
                view.kv_bytes_per_block(),
            )
            for cid, view in views
        ]
        # The coordinator's gate (I1-reuse-off): off or warming, local matches only.
        reuse = (self.warming() or _REUSE_ON) if self._config.reuse else _DISABLED
        try:
            answer = score(
                self.inventory,
                query,
                engines,
                now_ms=self._clock_ms(),
                reuse=reuse,
                predictor=self.saving_predictor,
                prediction_basis=self.prediction_basis,
                hasher=self.token_hasher,
                leases_in_flight=self._leases_in_flight(),
                may_lend=self._may_lend,
            )
        except KvrcError:
            self.count_score_refused()
            raise
        self._metrics.score_duration.observe(time.perf_counter() - started)
        scored = [e for e in answer.engines if e.scored]
        if not scored:
            outcome = ScoreOutcome.NO_ENGINES
        elif any(e.local_matched_blocks or e.loadable_blocks for e in scored):
            outcome = ScoreOutcome.HIT
        else:
            outcome = ScoreOutcome.MISS
        self._m_scores[outcome].inc()
        return answer

    def count_score_refused(self) -> None:
        self._m_scores[ScoreOutcome.REFUSED].inc()

    # --- status ------------------------------------------------------------------

    def is_stale(self, child_engine_id: str) -> bool:
        """Its inventory lost events and awaits a full dump (pushed in state updates)."""
        return self.inventory.has_engine(child_engine_id) and self.inventory.is_stale(
            child_engine_id
        )

    def engine_status(self, child_engine_id: str) -> EngineInventoryStatus:
        if not self.inventory.has_engine(child_engine_id):
            return EngineInventoryStatus(0, False)
        return EngineInventoryStatus(
            self.inventory.engine_entries(child_engine_id),
            self.inventory.is_stale(child_engine_id),
        )

    def entries_total(self) -> int:
        return self.inventory.stats().entries_total

    def remote_engine_count(self) -> int:
        """Child engines in the index whose sessions are on other replicas."""
        stats = self.inventory.stats()
        engines = (
            stats.engines_ready
            + stats.engines_not_ready
            + stats.engines_stale
            + stats.engines_resyncing
        )
        return max(engines - len(self._meta), 0)

    # --- ZMQ edge -------------------------------------------------------------------

    def _start_zmq(self, registration: RankPartRegistration, meta: _Meta) -> None:
        cid = registration.child_engine_id
        if self.event_streams is None:
            self._lifecycle_log.warning(
                log,
                "child engine %s names a KV-event endpoint, but this coordinator ingests "
                "no engine event streams: endpoint ignored",
                cid,
            )
            return
        if meta.mode is not PublishMode.PER_CHILD_ENGINE:
            self._lifecycle_log.warning(
                log,
                "child engine %s names a KV-event endpoint but publishes per rank part; "
                "vLLM publishes per child engine: endpoint ignored",
                cid,
            )
            return
        sink = _ZmqSink(self)
        try:
            stream = self.event_streams(registration, sink)
        except (ValueError, KvrcError) as e:
            # The registration stands (handoffs need no inventory); only the edge is off.
            self._endpoint_refused(cid, e)
            return
        meta.zmq, meta.zmq_sink, meta.zmq_source = stream, sink, _zmq_source(registration)
        closing = self._zmq_closing.get(cid)
        task = asyncio.get_running_loop().create_task(_after(closing, stream.start))
        task.add_done_callback(lambda t: self._zmq_start_ended(cid, meta, stream, t))

    def _zmq_start_ended(
        self, cid: str, meta: _Meta, stream: EventStream, task: asyncio.Task[None]
    ) -> None:
        if not task.cancelled() and task.exception() is not None and meta.zmq is stream:
            # The next registration of one of its parts tries again (the endpoint's port
            # may be free by then); kept, it was never retried while a part stayed.
            meta.zmq = None
        error = None if task.cancelled() else task.exception()
        if isinstance(error, KvrcError):
            self._endpoint_refused(cid, error)  # an endpoint kvrc cannot bind or reach
            return
        _log_failure(task)

    def _endpoint_refused(self, child_engine_id: str, error: Exception) -> None:
        """The engine's configuration: one line, from the lifecycle budget (a
        register/close loop repeats it)."""
        self._lifecycle_log.warning(
            log,
            "child engine %s: KV-event endpoint refused, not subscribing: %s",
            child_engine_id,
            error,
        )

    def _retire_zmq(self, child_engine_id: str, meta: _Meta) -> None:
        """Stops the engine's subscription in the background; whatever it still delivers
        is dropped from now on (else a closing stream could write into a new one's
        inventory, or into the engine's next registration)."""
        stream, sink = meta.zmq, meta.zmq_sink
        meta.zmq = meta.zmq_sink = None
        if sink is not None:
            sink.retired = True
        if stream is None:
            return
        before = self._zmq_closing.get(child_engine_id)
        task = asyncio.get_running_loop().create_task(_after(before, stream.close))
        task.add_done_callback(_log_failure)
        task.add_done_callback(self._stopping.discard)
        self._stopping.add(task)
        self._zmq_closing[child_engine_id] = task

        def closed(done: asyncio.Task[None]) -> None:
            if self._zmq_closing.get(child_engine_id) is done:
                del self._zmq_closing[child_engine_id]

        task.add_done_callback(closed)

    def zmq_apply(self, child_engine_id: str, batch: EventBatch) -> None:
        if not self.inventory.has_engine(child_engine_id):
            return
        result = self.inventory.apply(child_engine_id, batch.events, now_ms=self._clock_ms())
        self._count_applied(SOURCE_ZMQ, result)
        self._update_gauges()

    def zmq_drop(self, child_engine_id: str) -> None:
        if self.inventory.has_engine(child_engine_id):
            self.inventory.clear_stream(child_engine_id, None)
            self._zmq_note_stale(child_engine_id)
            self._update_gauges()

    def zmq_stale(self, child_engine_id: str) -> None:
        if self.inventory.has_engine(child_engine_id):
            self.inventory.mark_stale(child_engine_id, None)
            self._zmq_note_stale(child_engine_id)
            self._update_gauges()

    def _zmq_note_stale(self, child_engine_id: str) -> None:
        meta = self._meta.get(child_engine_id)
        if meta is not None:
            self._note_stale(child_engine_id, meta)

    # --- internals -------------------------------------------------------------------

    def _refresh(
        self, child_engine_id: str, meta: _Meta, view: ChildEngineView, reuse: ReuseStatus
    ) -> None:
        meta.ready = view.ready
        meta.reuse = reuse
        self.inventory.set_ready(child_engine_id, view.ready and reuse.enabled)
        # Score counts an engine's own cache whatever its reuse gate (docs/score.md).
        self.inventory.set_serving(child_engine_id, view.ready)
        self._update_gauges()

    def _remove_engine(self, child_engine_id: str, meta: _Meta) -> None:
        dropped = self.inventory.remove_engine(child_engine_id)
        for key in [k for k in self._resyncs if k.child_engine_id == child_engine_id]:
            self._cancel_resync(key)
        self.streams.remove_engine(child_engine_id)
        del self._meta[child_engine_id]
        self._retire_zmq(child_engine_id, meta)
        self._lifecycle_log.info(
            log, "child engine %s left: %d inventory entries dropped", child_engine_id, dropped
        )
        self._update_gauges()

    def _count_applied(self, source: str, result: ApplyResult) -> None:
        if source == SOURCE_GRPC:  # the ZMQ edge counts its own block events
            self._count_events(source, result)
        if result.dropped_total_cap:
            self._m_cap_total.inc(result.dropped_total_cap)
        if result.dropped_engine_cap:
            self._m_cap_engine.inc(result.dropped_engine_cap)

    def _count_events(self, source: str, result: ApplyResult) -> None:
        if result.blocks_stored:
            self._m_events[source, "stored"].inc(result.blocks_stored)
        if result.blocks_removed:
            self._m_events[source, "removed"].inc(result.blocks_removed)
        if result.clears:
            self._m_events[source, "cleared"].inc(result.clears)

    def refresh_gauges(self) -> None:
        """Another replica's ops changed the index (coordinator/runtime/redis_store.py)."""
        self._update_gauges()

    def _update_gauges(self) -> None:
        stats = self.inventory.stats()
        for tier, gauge in self._m_entries.items():
            gauge.set(stats.index_entries_by_tier.get(tier, 0))
        self._m_stale.set(stats.engines_stale + stats.engines_resyncing)

    def _sweep(self) -> None:
        try:
            if self.inventory.sweep_expired(self._clock_ms(), SWEEP_BUDGET):
                self._update_gauges()
        except Exception:  # the sweeper must outlive one bad pass
            log.exception("inventory expiry sweep failed")
        if self._sweeper is not None:  # not closed
            self._sweeper = self._clock.call_later(SWEEP_INTERVAL_MS, self._sweep)


def _cost_basis(config: CoordinatorConfig) -> str:
    c = config.cost
    reverse = "a link's measured reverse, else " if c.reverse_prior else ""
    return (
        "cost model (docs/cost_model.md): local matches at the engine's prefill rate; "
        f"a load counts when load x {c.safety_margin:g} < recompute; measured links and "
        f"rates, else declared, else {reverse}{c.default_prefill_tokens_per_s:g} tokens/s and "
        f"{c.default_bandwidth_bytes_per_s / 1e9:g} GB/s + {c.default_latency_ms:g} ms"
    )


class _ZmqSink:
    """`zmq_ingest.EventSink` over the facade: the ZMQ edge orders, the core applies."""

    def __init__(self, facade: InventoryFlow) -> None:
        self._facade = facade
        self.retired = False  # its stream was stopped: what it still delivers is dropped

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        if not self.retired:
            self._facade.zmq_apply(child_engine_id, batch)

    def drop_engine_inventory(self, child_engine_id: str) -> None:
        if not self.retired:
            self._facade.zmq_drop(child_engine_id)

    def mark_stale(self, child_engine_id: str, reason: str) -> None:
        if not self.retired:
            self._facade.zmq_stale(child_engine_id)

    def mark_degraded(self, child_engine_id: str, reason: str) -> None:
        """Entries stay hints (bounded age is the ZMQ edge's job)."""

    def mark_live(self, child_engine_id: str) -> None:
        """Nothing to undo: staleness ends with the new incarnation's drop."""


def _zmq_source(registration: RankPartRegistration) -> tuple[str, str, str]:
    """What a child engine's ZMQ subscription follows: the head part's KV-event endpoints
    and its session (a new EngineCore registers a new one)."""
    return (
        registration.kv_events_endpoint,
        registration.kv_events_replay_endpoint,
        registration.endpoint.session_name,
    )


async def _after(previous: asyncio.Task[None] | None, step: Callable[[], Awaitable[None]]) -> None:
    """`step`, once `previous` (an engine's subscription closing) has ended, however."""
    if previous is not None:
        await asyncio.gather(previous, return_exceptions=True)
    await step()


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("inventory background task failed", exc_info=task.exception())


__all__ = [
    "EngineInventoryStatus",
    "InventoryFlow",
    "LookupQuery",
    "LookupResult",
    "LookupVerdict",
    "ResyncOrder",
    "ScoreOutcome",
]
