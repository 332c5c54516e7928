"""The async facade of the coordinator: owns the core and the engine sessions.

The servicer translates protobuf and calls this; this calls the pure core
(`registry.py`; the inventory and leases through their facades) and executes
what follows: queueing messages to sessions, removing parts whose heartbeats
stopped, publishing readiness changes, and telling listeners that a part left.

Each session has one bounded outbound queue. A session whose engine stops
reading fills it and is closed with RESOURCE_EXHAUSTED instead of buffering
without bound (I8-bad-input).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from coordinator.core.cost_model import (
    CostConfig,
    CostModel,
    LinkEstimate,
    LinkKey,
    Prediction,
    PrefillEstimate,
)
from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import RankKey
from coordinator.core.grants import BeginHandoffRequest, PublishHandoffRequest, TransferReport
from coordinator.core.inventory import Inventory
from coordinator.core.lease_ids import KEY_BYTES, derived_key
from coordinator.core.leases import (
    Flow,
    HandoffGrant,
    LeaseState,
    LeaseTable,
    LeaseView,
    SendQuarantine,
    SendRelease,
    flow_of_lease_id,
    owner_of_lease_id,
)
from coordinator.core.profiles import (
    ReuseReason,
    ReuseStatus,
    declared_prefill_rate,
    reuse_status,
)
from coordinator.core.recovery import (
    MAX_KNOWN_ENGINES,
    MAX_STATE_FILE_BYTES,
    KnownEngine,
    StateFileError,
    Warmup,
    decode_state_file,
    encode_state,
)
from coordinator.core.registry import (
    ChildEngineView,
    HeldLease,
    PartRef,
    RankPartRegistration,
    Registry,
)
from coordinator.runtime.clock import Clock, SystemClock, Timer
from coordinator.runtime.config import CoordinatorConfig
from coordinator.runtime.inventory_flow import InventoryFlow, ResyncOrder
from coordinator.runtime.lease_flow import MAX_RELEASE_RETURNS, LeaseFlow, LeaseOutbound
from coordinator.runtime.log_limit import LogBudget, RateLimitedLog
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.peers import (
    CALL_BEGIN_HANDOFF,
    CALL_COMPLETE_HANDOFF,
    CALL_COMPLETE_PREFIX_LOAD,
    CALL_EXTEND_HANDOFF,
    CALL_PUBLISH_HANDOFF,
    DEFAULT_CALL_TIMEOUT_S,
    Other,
    PeerLink,
    decode_begin,
    decode_grant,
    decode_publish,
    decode_report,
    encode_begin,
    encode_grant,
    encode_publish,
    encode_report,
)
from kvrc import __version__
from kvrc.ids import format_rank
from kvrc.vocabulary import COORDINATOR_SHUTTING_DOWN

log = logging.getLogger("kvrc.coordinator")

# Warm-up deadline after a restart when a state file is used and --warmup-ms is not given.
DEFAULT_WARMUP_MS = 10_000
# State file writes are coalesced: registrations come in bursts after a restart.
_STATE_WRITE_DELAY_MS = 200
# The grace a holder's safety net adds to a pin's deadline (clients/holds.py,
# PIN_SAFETY_GRACE_S). A pin whose release never came is kept at most its deadline (the
# longest pin timeout + TTL + the abort timeout) plus this, unless quarantined; a lease
# left to its owner longer ago is not rebuilt when the owner falls silent: the holder
# has freed it (`owner_silent`).
HOLDER_GRACE_MS = 60_000


# --- outbound session messages (encoded by wire.py) ----------------------------


@dataclass(frozen=True, slots=True)
class RegisterReply:
    session_id: str
    incarnation: int
    view: ChildEngineView
    reuse: ReuseStatus
    heartbeat_interval_ms: int
    heartbeat_timeout_ms: int


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    server_time_ms: int


@dataclass(frozen=True, slots=True)
class StateUpdate:
    view: ChildEngineView
    reuse: ReuseStatus
    stale: bool = False  # its inventory lost events; awaiting a full dump
    draining: bool = False


@dataclass(frozen=True, slots=True)
class EncodedReply:
    """A message the edge has already encoded: the answer to a call made on the stream."""

    message: object


# Every message the coordinator queues on a session (the lease edge's are LeaseOutbound).
Outbound = RegisterReply | HeartbeatReply | StateUpdate | ResyncOrder | LeaseOutbound | EncodedReply


@dataclass(frozen=True, slots=True)
class SessionEnd:
    """Why the coordinator ends a session; `code` None ends it with OK."""

    code: ErrorCode | None
    message: str


# Releases a session was given and its holder has not acknowledged yet (revision 4),
# at most: a client acks within tens of ms, so only one that never acks fills this;
# the oldest are then forgotten (their pins wait for the holder's own safety net).
MAX_UNACKED_RELEASES = 4_096

# Removal reasons, also the `reason` label of kvrc_sessions_closed_total.
REASON_CLOSED = "closed"
REASON_HEARTBEAT_TIMEOUT = "heartbeat_timeout"
REASON_SHUTDOWN = "shutdown"
REASON_ERROR = "error"
REASON_FENCED = "fenced"  # the part registered again on another replica (peers.py)


class Session:
    """One registered rank part's stream: its identity and its outbound queue."""

    __slots__ = (
        "_base_limit",
        "_ended",
        "_limit",
        "_queue",
        "_registering",
        "_unacked",
        "incarnation",
        "ref",
        "registration",
    )

    def __init__(
        self, registration: RankPartRegistration, ref: PartRef, incarnation: int, limit: int
    ) -> None:
        self.registration = registration
        self.ref = ref
        self.incarnation = incarnation
        self._base_limit = self._limit = limit
        self._queue: asyncio.Queue[Outbound | SessionEnd] = asyncio.Queue()
        self._ended = False
        self._registering = False
        # Releases given to this session and not acknowledged, by lease id (oldest first).
        self._unacked: dict[str, SendRelease] = {}

    @property
    def session_id(self) -> str:
        return self.ref.session_id

    @property
    def ended(self) -> bool:
        return self._ended

    def offer(self, message: Outbound) -> bool:
        """Queues a message; False when the queue is full (the caller closes the session)
        or, for a release, when the session has ended (the caller sends it on)."""
        if self._ended:
            # Nobody reads an ended session; a release must reach the part's next one.
            return not isinstance(message, SendRelease)
        if self._limit > self._base_limit and self._queue.qsize() < self._base_limit:
            self._limit = self._base_limit  # the registration's answers were read
        if self._queue.qsize() >= self._limit:
            if not self._registering:
                return False
            # The registration's own answers (one per held lease it names, one per abort
            # it owes: both bounded) always fit; the room stays for them to be read.
            self._limit += 1
        self._queue.put_nowait(message)
        if isinstance(message, SendRelease):
            unacked = self._unacked
            unacked[message.lease_id] = message
            if len(unacked) > MAX_UNACKED_RELEASES:
                del unacked[next(iter(unacked))]
        return True

    def release_acked(self, lease_id: str) -> bool:
        """The holder freed the lease's pins; False if no release of it was waiting."""
        return self._unacked.pop(lease_id, None) is not None

    @contextlib.contextmanager
    def registering(self) -> Iterator[None]:
        """While the Register's own answers are queued (RegisterAck, recovery notices,
        aborts owed): a part holding more leases than the queue's bound still registers."""
        self._registering = True
        try:
            yield
        finally:
            self._registering = False

    def end(self, end: SessionEnd) -> list[SendRelease]:
        """Leaves only the end marker; returns the releases the holder never acknowledged,
        whether still queued or read (a stream can break after the engine read one)."""
        if self._ended:
            return []
        self._ended = True
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(end)
        unacked = list(self._unacked.values())
        self._unacked.clear()
        return unacked

    async def next_outbound(self) -> Outbound | SessionEnd:
        return await self._queue.get()


class PartListener(Protocol):
    """Told when a rank part leaves (the inventory and lease facades listen)."""

    def on_part_removed(self, child_engine_id: str, rank: RankKey, reason: str) -> None:
        """The part is no longer registered (its child engine is not READY)."""

    def on_part_gone(self, child_engine_id: str, rank: RankKey, session_id: str) -> None:
        """`session_grace_ms` after removal, the part has not come back: treat it as gone."""


@dataclass(frozen=True, slots=True)
class _Unaccounted:
    """In place of a gone timer: a remote part this replica lost track of (a store loss,
    a snapshot reload; peers.py `PeerLink.forget_all`). Its engine is not proven gone
    while it stands; `unaccounted_part_gone` starts the real timer."""

    session_id: str

    def cancel(self) -> None:
        """Nothing runs: the part came back, or the coordinator is shutting down."""


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    """A PublishHandoff's answer, decided here or by the decode engine's replica."""

    lease_id: str
    state: LeaseState
    parts_reported: int
    parts_expected: int


@dataclass(slots=True)
class _LeftToOwner:
    """A local part's held prefix loads left to their live owner at its registration."""

    child_engine_id: str
    rank_key: RankKey
    left_ms: int  # monotonic, when they were left
    held: dict[str, HeldLease]  # by lease id
    quarantined: set[str]  # the owner quarantined them: the holder keeps them for good


@dataclass(frozen=True, slots=True)
class CompleteOutcome:
    """A transfer report's answer, decided here or by the replica that owns the lease."""

    state: LeaseState
    quiescent: bool


@dataclass(frozen=True, slots=True)
class ChildEngineStatus:
    view: ChildEngineView
    reuse: ReuseStatus
    inventory_entries: int = 0
    stale: bool = False  # its inventory stream lost events; awaiting a full dump
    draining: bool = False


# StatusRequest.max_leases: 0 asks for the default. A status answer stays bounded
# (every open lease listed outgrew a client's 4 MiB receive limit past ~6,800).
DEFAULT_STATUS_LEASES = 1_000
MAX_STATUS_LEASES = 10_000  # ~6 MB of answer: well inside the server's 16 MiB send limit


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    version: str
    reuse_enabled: bool
    warming: bool
    child_engines: tuple[ChildEngineStatus, ...]
    inventory_entries: int = 0
    # In flight and quarantined, at most the max_leases asked for (`status_leases`).
    leases: tuple[LeaseView, ...] = ()
    leases_total: int = 0  # every open lease, listed or not
    store: str = "memory"  # the shared store's URL, without credentials
    store_unavailable_reason: str = ""  # "" while the store is reachable
    remote_child_engines: int = 0  # other replicas' engines in this replica's index
    cost: CostStatus | None = None  # this replica's own cost estimates (I9-cost-gate)


@dataclass(frozen=True, slots=True)
class CostStatus:
    config: CostConfig
    # Measured, least recently first, each with its fit's age in ms (None: unknown).
    links: tuple[tuple[LinkKey, LinkEstimate, int | None], ...]
    prefill_rates: tuple[tuple[str, PrefillEstimate], ...]
    # The prediction each open, granted prefix load was granted on.
    decisions: tuple[tuple[str, Prediction], ...] = ()


def status_leases(leases: Sequence[LeaseView], max_leases: int) -> tuple[LeaseView, ...]:
    """The `max_leases` an operator needs first: quarantined ones (they wait for a human),
    then the soonest deadlines (none last); ties keep `leases`' order. O(n log k)."""

    def urgency(view: LeaseView) -> tuple[bool, bool, int]:
        deadline = view.deadline_ms
        return (view.state is not LeaseState.QUARANTINED, deadline is None, deadline or 0)

    return tuple(heapq.nsmallest(max_leases, leases, key=urgency))


class Coordinator:
    def __init__(
        self,
        config: CoordinatorConfig,
        metrics: Metrics | None = None,
        clock: Clock | None = None,
        inventory: Inventory | None = None,
        lease_id_owner: str = "",
    ) -> None:
        self.config = config
        self.metrics = metrics if metrics is not None else Metrics()
        # Every deadline runs on the monotonic clock (the wire edge converts to unix ms).
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._clock_ms = self.clock.monotonic_ms
        # Refused registrations (and a state file cut short): one line per kind per 10 s.
        self._refusal_log = RateLimitedLog(log, self._clock_ms)
        # Parts registering and leaving, engines READY or gone: one budget for all of
        # them, here and in both flows (a register/close loop must not fill the log).
        self._lifecycle_log = LogBudget(self._clock_ms)
        clock_ms = self._clock_ms
        self.registry = Registry(config.max_rank_parts, config.max_endpoint_bytes)
        self._sessions: dict[str, Session] = {}
        # Per local session: held prefix loads its part re-announced while their owner
        # (another replica) was live, so left to it. Rebuilt here if that owner falls
        # silent first (`owner_silent`); dropped once the owner releases one, or the
        # session ends. At most one Register's held leases per session.
        self._left_to_owner: dict[str, _LeftToOwner] = {}
        # With a shared store: the other replicas' rank parts and lease messages (peers.py).
        self.peers: PeerLink | None = None
        self._listeners: list[PartListener] = []
        # Parts inside their grace period, per child engine: `proven_gone` is O(1).
        self._gone_timers: dict[str, dict[RankKey, Timer]] = {}
        # Incarnations grow across restarts too: seeded from the wall clock (an identity,
        # never a deadline).
        self._incarnations = itertools.count(self.clock.wall_ms() * 1000)
        self._watchdog: Timer | None = None
        self._shutting_down = False
        # Inventory ingest, lookup and status (coordinator/runtime/inventory_flow.py).
        self.inventory = InventoryFlow(
            config,
            self.metrics,
            self.registry,
            self.reuse_for,
            self.clock,
            self._send_to,
            inventory,
            lifecycle_log=self._lifecycle_log,
        )
        self.add_part_listener(self.inventory)
        # Both lease flows (coordinator/runtime/lease_flow.py).
        self.leases = LeaseFlow(
            registry=self.registry,
            inventory=self.inventory.inventory,
            metrics=self.metrics,
            send_to_part=self.send_to_part,
            reuse_for=self.reuse_for,
            proven_gone=self.proven_gone,
            clock=self.clock,
            table=LeaseTable(config.leases, id_owner=lease_id_owner),
            cost=CostModel(config.cost, self.declared_prefill, config.declared_links),
            lifecycle_log=self._lifecycle_log,
        )
        self.inventory.set_lease_side(
            self.leases.leases_in_flight, self.leases.may_lend, self.leases.is_draining
        )
        self.inventory.set_saving_predictor(self.leases.cost_model)
        self.add_part_listener(self.leases)
        # Restart recovery (coordinator/core/recovery.py): warm-up and the known engines.
        self._known: dict[str, KnownEngine] = {}
        self._known_written: tuple[KnownEngine, ...] | None = None
        self._state_timer: Timer | None = None
        self._warmup_timer: Timer | None = None
        # The key lease ids name their holder with (coordinator/core/lease_ids.py): the
        # state file's, a new one written there, or (no file) this process's own.
        self._lease_id_key: bytes | None = None
        self._lease_id_key_written = False
        self._state_unreadable = False
        self.warmup = self._load_warmup(clock_ms())
        if self._lease_id_key is None:
            self._lease_id_key = secrets.token_bytes(KEY_BYTES)
            if not self._state_unreadable:
                # Kept at once. An unreadable file is left as it is until an engine change
                # rewrites it (as before): rewritten now it would list no engines, and a
                # second restart would skip the fail-safe warm-up.
                self._schedule_state_write()
        self.leases.table.set_id_key(self._lease_id_key)
        self.inventory.warming = self.warming_status
        self.inventory.on_stale_changed = self._stale_changed
        self.leases.warming = self.warming_status
        self.metrics.warming.set(1 if self.warmup.warming else 0)
        self._update_gauges()
        # A shared store says why it is unreachable here (coordinator/edges/server.py).
        self.store_unavailable: Callable[[], str | None] = lambda: None

    def attach_peers(self, peers: PeerLink) -> None:
        self.peers = peers
        peers.attach(self)

    # --- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._arm_watchdog()
        status = self.warmup.status()
        if status.warming and status.deadline_ms is not None:
            self._warmup_timer = self.clock.call_later(
                status.deadline_ms - self._clock_ms() + 10, self._warmup_deadline
            )
        self.inventory.start()
        await self.leases.start()

    async def shutdown(self) -> None:
        """Ends every session (UNAVAILABLE: engines reconnect to the next coordinator)."""
        self._shutting_down = True
        self.leases.close_to_changes()  # first: no lease may end into a closed session
        if self.peers is not None:
            # Calls to another replica too: their answers could no longer be read here.
            self.peers.fail_calls(COORDINATOR_SHUTTING_DOWN)
        for handle in (self._state_timer, self._warmup_timer):
            if handle is not None:
                handle.cancel()  # before the flush, which forgets the state timer's handle
        self._flush_state()  # the sessions closing below are not departures
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        for session in list(self._sessions.values()):
            self.close_session(
                session,
                REASON_SHUTDOWN,
                SessionEnd(ErrorCode.UNAVAILABLE, COORDINATOR_SHUTTING_DOWN),
            )
        for timers in self._gone_timers.values():
            for timer in timers.values():
                timer.cancel()
        self._gone_timers.clear()
        await self.inventory.close()
        await self.leases.shutdown()

    def add_part_listener(self, listener: PartListener) -> None:
        self._listeners.append(listener)

    # --- sessions --------------------------------------------------------------

    def open_session(self, registration: RankPartRegistration) -> Session:
        """Registers a rank part (KvrcError when refused; nothing changes then)."""
        if self._shutting_down:
            raise KvrcError(ErrorCode.UNAVAILABLE, COORDINATOR_SHUTTING_DOWN)
        # The registry, the session and the peers keep the registration for the part's
        # life; its held leases (up to max_held_leases ids, ~2 MB) are used once, below.
        held_leases = registration.held_leases
        registration = replace(registration, held_leases=())
        now = self._clock_ms()
        session_id = f"s-{secrets.token_hex(8)}"
        incarnation = next(self._incarnations)
        displaced = self._replace_remote_part(registration)
        try:
            result = self.registry.register(registration, session_id, incarnation, now)
        except KvrcError as e:
            if displaced is not None:
                displaced[0]()  # the remote copy it would have replaced stays
            self.metrics.registrations.labels(result=e.code.value).inc()
            self._refusal_log.info(
                f"register {e.code.value}",
                "registration refused: %s rank %s: %s: %s",
                registration.child_engine_id,
                format_rank(registration.rank),
                e.code.value,
                e.message,
            )
            raise
        ref = PartRef(registration.child_engine_id, registration.rank, session_id)
        session = Session(registration, ref, incarnation, self.config.session_queue_size)
        self._sessions[session_id] = session
        timer = self._take_gone_timer(ref)
        if timer is not None:
            timer.cancel()  # came back within the grace period
        self.metrics.registrations.labels(result="ok").inc()
        if self.peers is not None:
            displaced_other = displaced[1] if displaced is not None else None
            self.peers.part_registered(
                session_id, registration, displaced is not None, displaced_other
            )
        self._update_gauges()
        view = result.view
        reuse = self.reuse_for(view)
        self.inventory.part_registered(registration, incarnation, view, reuse)
        self._remember(view.child_engine_id, view.engine_id, view.parts_expected)
        session.offer(
            RegisterReply(
                session_id=session_id,
                incarnation=incarnation,
                view=view,
                reuse=reuse,
                heartbeat_interval_ms=self.config.heartbeat_interval_ms,
                heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
            )
        )
        self._lifecycle_log.info(
            log,
            "rank part registered: %s rank %s session %s (%d/%d parts)",
            view.child_engine_id,
            format_rank(registration.rank),
            session_id,
            view.parts_present,
            view.parts_expected,
        )
        if result.readiness_changed:
            self._readiness_changed(view, reuse, skip_session=session_id)
        held = held_leases
        if held and self.peers is not None:
            # Owned by a live replica: it keeps the lease; this part's answers reach it.
            # So does one whose owner this replica, just started, cannot tell alive or
            # not yet (`PeerLink.caught_up`: rebuilt here if it stays silent).
            peers = self.peers
            unknown = {h.lease_id for h in held if peers.owner_unknown(h.lease_id)}
            left = {
                h.lease_id: h
                for h in held
                if h.lease_id in unknown or peers.owner_of(h.lease_id) is not None
            }
            if left:
                held = tuple(h for h in held if h.lease_id not in left)
                # Handoffs left to a live owner are not kept: their reports are not routed
                # by the ledger, and the prefill frees an unquarantined one at its own
                # hold deadline. Those of an owner not heard yet are, to be rebuilt here
                # if it stays silent (as before this replica could tell).
                loads = {
                    i: h
                    for i, h in left.items()
                    if i in unknown or flow_of_lease_id(i) is Flow.PREFIX_LOAD
                }
                if loads:
                    self._left_to_owner[session_id] = _LeftToOwner(
                        view.child_engine_id,
                        registration.rank,
                        self.clock.monotonic_ms(),
                        loads,
                        set(),
                    )
        with session.registering():
            if held:
                # Restart recovery: pins this part still holds (after the RegisterAck).
                self.leases.recover_held(view.child_engine_id, registration.rank, held)
            # What was sent while it was between sessions was dropped: it goes again (but
            # the quarantines of the leases it just re-announced: those it was told).
            self.leases.on_part_registered(
                view.child_engine_id, registration.rank, {h.lease_id for h in held}
            )
        return session

    def on_pin_result(
        self,
        ref: PartRef,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None:
        """A holder part's PinResult: to this replica's lease, or to the replica whose pin
        request reached this session (only then: anything else a session sends about
        another replica's lease is not relayed into the shared log)."""
        peers = self.peers
        owner = peers.pin_asker(ref.session_id, lease_id) if peers is not None else None
        if owner is not None and peers is not None:
            peers.reply_pin_result(owner, ref, lease_id, pinned_blocks, descriptor, error_message)
            return
        self.leases.on_pin_result(
            ref.child_engine_id, ref.rank, lease_id, pinned_blocks, descriptor, error_message
        )

    def on_release_acks(self, session: Session, lease_ids: Sequence[str]) -> None:
        """The holder freed these leases' pins: their releases are delivered (I6). An id
        with no release waiting (sent again after a broken stream, or unknown) is ignored."""
        unknown = sum(not session.release_acked(lease_id) for lease_id in lease_ids)
        if unknown:
            log.debug(
                "session %s acknowledged %d release(s) not waiting for an ack",
                session.session_id,
                unknown,
            )

    def on_abort_ack(self, ref: PartRef, lease_id: str) -> None:
        """A target part's abort ack: to this replica's lease, or to the live replica that
        owns it: the one that sent the abort (it owned the lease when it asked, and may
        have rebuilt it from a silent owner), else the one its id names. Dropped, the
        quarantine would wait for an operator (I6-quiescence)."""
        peers = self.peers
        owner = None
        if peers is not None and not self.leases.table.knows(lease_id):
            owner = peers.abort_sender(lease_id) or peers.owner_of(lease_id)
        if owner is not None and peers is not None:
            peers.reply_abort_ack(owner, ref, lease_id)
            return
        self.leases.on_abort_ack(ref.child_engine_id, ref.rank, lease_id)

    async def publish_handoff(self, req: PublishHandoffRequest) -> PublishOutcome:
        """A prefill part's publish; the decode engine's replica owns the handoff."""
        owner = self._replica_of(req.decode_child_engine_id)
        if owner is not None and self.peers is not None:
            raw = await self.peers.call(owner, CALL_PUBLISH_HANDOFF, encode_publish(req))
            lease_id, state, reported, expected = raw
            return PublishOutcome(str(lease_id), LeaseState(state), int(reported), int(expected))
        view, reported, expected = self.leases.publish_handoff(req)
        return PublishOutcome(view.lease_id, view.state, reported, expected)

    async def begin_handoff(self, req: BeginHandoffRequest) -> HandoffGrant:
        """A handoff published here is begun here. Otherwise the decode engine's replica
        owns it (publish_handoff forwards a publish that names the decode engine): a
        begin that reached another replica is asked of that one, and waits there. (An
        unreserved handoff lives where it was published: a begin must reach that one.)"""
        owner = self._replica_of(req.decode_child_engine_id)
        here = self.leases.table.find_handoff(req.prefill_child_engine_id, req.request_id)
        if owner is not None and self.peers is not None and here is None:
            timeout_s = req.wait_timeout_ms / 1000 + DEFAULT_CALL_TIMEOUT_S
            # The deadline: from when the call was sent, plus what the owner waited and
            # what it left (never later than the owner's, by the log's delay at most).
            sent_ms = self._clock_ms()
            raw = await self.peers.call(owner, CALL_BEGIN_HANDOFF, encode_begin(req), timeout_s)
            return decode_grant(raw, sent_ms)
        return await self.leases.begin_handoff(req)

    async def extend_handoff(self, lease_id: str, decode_child_engine_id: str) -> int:
        """The new deadline (monotonic ms here), from the replica that owns the lease."""
        owner = self.peers.owner_of(lease_id) if self.peers is not None else None
        if owner is not None and self.peers is not None:
            payload = [lease_id, decode_child_engine_id]
            sent_ms = self._clock_ms()
            left_ms = await self.peers.call(owner, CALL_EXTEND_HANDOFF, payload)
            return sent_ms + int(left_ms)
        return self.leases.extend_handoff(lease_id, decode_child_engine_id)

    def decided_here(self, lease_id: str, flow: Flow) -> bool:
        """A report on the lease is decided by this replica's table, now: no other replica
        may own it (else `complete`, which may ask one, answers it)."""
        if self.peers is None or self.leases.table.knows(lease_id):
            return True
        if self.peers.owner_of(lease_id) is not None:
            return False
        return self.leases.ledger is None or flow is not Flow.PREFIX_LOAD

    async def complete(self, report: TransferReport, flow: Flow) -> CompleteOutcome:
        """A target part's report, to this replica's lease or to the live replica that owns
        it: a report may come through another channel than the grant did."""
        owner = await self._owner_of(report.lease_id, flow)
        if owner is not None and self.peers is not None:
            kind = CALL_COMPLETE_PREFIX_LOAD if flow is Flow.PREFIX_LOAD else CALL_COMPLETE_HANDOFF
            state, quiescent = await self.peers.call(owner, kind, encode_report(report))
            return CompleteOutcome(LeaseState(state), bool(quiescent))
        return self.complete_here(report, flow)

    async def _owner_of(self, lease_id: str, flow: Flow) -> str | None:
        """The other live replica that owns a lease (None: this one decides). The one its
        id names; else, for a prefix load not here, the one the lease ledger names: a
        lease whose owner fell silent is rebuilt by the replica its holder re-announced
        it to (`recover_held`), and the ledger records that adoption. Decided anywhere
        else, the report would be NOT_FOUND and the holder stay pinned (I6-quiescence)."""
        peers, ledger = self.peers, self.leases.ledger
        if peers is None or self.decided_here(lease_id, flow):
            return None
        owner = peers.owner_of(lease_id)
        if owner is not None or ledger is None:
            return owner
        recorded = await ledger.owner_of(lease_id)
        if recorded is not None:
            live = peers.live_other(recorded)
            if live is not None or recorded == peers.origin:
                return live
            silent = recorded
        else:
            silent = owner_of_lease_id(lease_id)  # its record may be pruned already
            if not peers.called_silent(silent):
                return None
        # Its owner fell silent and nobody rebuilt it yet: NOT_FOUND would end the
        # requester's reporting, while its holder may re-announce it any moment.
        raise KvrcError(
            ErrorCode.UNAVAILABLE,
            f"lease {lease_id!r} was owned by replica {silent}, which fell silent; the "
            "replica its holder re-announces it to takes it over: try again",
        )

    def complete_here(self, report: TransferReport, flow: Flow) -> CompleteOutcome:
        """The report, decided by this replica's lease table."""
        if flow is Flow.PREFIX_LOAD:
            view = self.leases.complete_prefix_load(report)
        else:
            view = self.leases.complete_handoff(report)
        return CompleteOutcome(view.state, view.quiescent)

    async def _begun_for_peer(self, req: BeginHandoffRequest) -> list[Any]:
        received_ms = self._clock_ms()
        grant = await self.leases.begin_handoff(req)
        now_ms = self._clock_ms()
        return encode_grant(grant, now_ms, waited_ms=now_ms - received_ms)

    def calls_cancelled(self) -> None:
        self.leases.forget_cancelled_begins()

    def run_call(self, kind: str, payload: Any) -> Any:
        if kind == CALL_PUBLISH_HANDOFF:
            view, reported, expected = self.leases.publish_handoff(decode_publish(payload))
            return [view.lease_id, int(view.state), reported, expected]
        flows = {CALL_COMPLETE_PREFIX_LOAD: Flow.PREFIX_LOAD, CALL_COMPLETE_HANDOFF: Flow.HANDOFF}
        if kind in flows:
            outcome = self.complete_here(decode_report(payload), flows[kind])
            return [int(outcome.state), outcome.quiescent]
        if kind == CALL_BEGIN_HANDOFF:
            return self._begun_for_peer(decode_begin(payload))
        if kind == CALL_EXTEND_HANDOFF:
            lease_id, decode = payload
            deadline = self.leases.extend_handoff(str(lease_id), str(decode))
            return deadline - self._clock_ms()
        # A newer replica's call (a rolling upgrade): nothing the engine sent is wrong.
        raise KvrcError(
            ErrorCode.UNAVAILABLE,
            f"replica {self.peers.origin if self.peers else ''} does not know the forwarded "
            f"call {kind!r} (it runs an older kvrc): try again once every replica is upgraded",
        )

    def _replica_of(self, child_engine_id: str | None) -> str | None:
        """The other replica that holds the engine's first part's session (None: here)."""
        if child_engine_id is None or self.peers is None:
            return None
        parts = self.registry.parts_of(child_engine_id)
        if not parts or any(p.session_id in self._sessions for p in parts):
            return None
        return self.peers.origin_of(min(parts, key=lambda p: p.rank).session_id)

    def heartbeat(self, session: Session) -> None:
        now = self._clock_ms()
        if self.registry.heartbeat(session.ref, now):
            self._send(session, HeartbeatReply(server_time_ms=now))

    def touch(self, session: Session) -> None:
        """Any message from the engine proves it alive."""
        self.registry.heartbeat(session.ref, self._clock_ms())

    def close_session(self, session: Session, reason: str, end: SessionEnd | None = None) -> None:
        """Removes the session's rank part (idempotent) and ends its stream."""
        unacked = session.end(end if end is not None else SessionEnd(None, ""))
        self._left_to_owner.pop(session.session_id, None)
        if self._sessions.pop(session.session_id, None) is None:
            return
        self.metrics.sessions_closed.labels(reason=reason).inc()
        if self._part_removed(session.ref, reason) and self.peers is not None:
            self.peers.part_left(session.ref)
        if unacked:
            # Never acknowledged: the part's next session gets them (I6-quiescence). Aborts
            # and quarantines are sent again by the lease table when it registers.
            given_up = self.leases.releases_returned(unacked)
            self._lifecycle_log.info(
                log,
                "session %s of %s rank %s ended with %d release(s) not acknowledged: "
                "sent on to the part's next session%s",
                session.session_id,
                session.ref.child_engine_id,
                format_rank(session.ref.rank),
                len(unacked),
                f" but {given_up}, unacknowledged by {MAX_RELEASE_RETURNS} sessions "
                "(does the engine send ReleaseAck?)"
                if given_up
                else "",
            )

    def _part_removed(self, ref: PartRef, reason: str, unaccounted: bool = False) -> bool:
        """Removes a registered part (local or remote) and tells the listeners; False if gone.

        Its grace period starts, after which its engine may be proven gone; for a part
        this replica lost track of (`unaccounted`), only once it is known to have left
        (`unaccounted_part_gone`): until then it counts as inside its grace period.
        """
        removed = self.registry.remove(ref)
        if removed is None:
            return False
        self._update_gauges()
        view = removed.view
        self._lifecycle_log.info(
            log,
            "rank part removed (%s): %s rank %s session %s (%d/%d parts)",
            reason,
            view.child_engine_id,
            format_rank(ref.rank),
            ref.session_id,
            view.parts_present,
            view.parts_expected,
        )
        if removed.readiness_changed:
            self._readiness_changed(view, self.reuse_for(view))
        for listener in self._listeners:
            try:
                listener.on_part_removed(ref.child_engine_id, ref.rank, reason)
            except Exception:  # one listener's bug must not keep the part registered
                log.exception("part listener %r failed on removal", listener)
        if self._listeners and not self._shutting_down:
            old = self._take_gone_timer(ref)
            if old is not None:
                old.cancel()
            timer = _Unaccounted(ref.session_id) if unaccounted else self._grace(ref)
            self._gone_timers.setdefault(ref.child_engine_id, {})[ref.rank] = timer
        return True

    def _grace(self, ref: PartRef) -> Timer:
        """The part's grace timer; or, while another session of it that this replica lost
        track of may be the live one, a hold until that one is accounted for."""
        other = (
            self.peers.unaccounted_session(ref.child_engine_id, ref.rank)
            if self.peers is not None
            else None
        )
        if other is not None:
            return _Unaccounted(other)
        return self.clock.call_later(self.config.session_grace_ms, lambda: self._part_gone(ref))

    # --- the other replicas' parts (PeerHost, coordinator/runtime/peers.py) ------------

    def register_remote_part(
        self, origin: str, session_id: str, registration: RankPartRegistration
    ) -> bool:
        if self._shutting_down:
            return False
        held = self.registry.session_of(registration.child_engine_id, registration.rank)
        if held is not None and held in self._sessions:
            return False  # a local session is first hand
        if held is not None and self.peers is not None:
            # It moved between two other replicas: the later registration (log order) wins.
            self.peers.forget_session(held)
            self.registry.remove(PartRef(registration.child_engine_id, registration.rank, held))
        try:
            result = self.registry.register(registration, session_id, 0, self._clock_ms())
        except KvrcError as e:
            log.warning(
                "rank part %s rank %s of replica %s not registered here: %s",
                registration.child_engine_id,
                format_rank(registration.rank),
                origin,
                e.message,
            )
            return False
        timer = self._take_gone_timer(
            PartRef(registration.child_engine_id, registration.rank, session_id)
        )
        if timer is not None:
            timer.cancel()  # it came back, on another replica
        self._update_gauges()
        log.info(
            "rank part of replica %s registered: %s rank %s session %s",
            origin,
            registration.child_engine_id,
            format_rank(registration.rank),
            session_id,
        )
        if result.readiness_changed:
            self._readiness_changed(result.view, self.reuse_for(result.view))
        return True

    def remove_remote_part(self, ref: PartRef, reason: str, unaccounted: bool = False) -> bool:
        return self._part_removed(ref, reason, unaccounted)

    def unaccounted_part_gone(self, ref: PartRef) -> None:
        timers = self._gone_timers.get(ref.child_engine_id, {})
        if timers.get(ref.rank) == _Unaccounted(ref.session_id):  # not back since
            timers[ref.rank] = self._grace(ref)

    def part_unaccounted(self, ref: PartRef) -> None:
        timers = self._gone_timers.get(ref.child_engine_id, {})
        timer = timers.get(ref.rank)
        if timer is not None and not isinstance(timer, _Unaccounted):
            timer.cancel()  # I6-quiescence: that session may be the part's live one
            timers[ref.rank] = _Unaccounted(ref.session_id)

    def deliver(self, ref: PartRef, message: LeaseOutbound, registering: bool = False) -> bool:
        session = self._sessions.get(ref.session_id)
        if session is None or session.ref != ref:
            delivered = False  # fenced: that session is not here any more
        elif registering:
            with session.registering():
                delivered = self._send_lease_message(session, message)
        else:
            delivered = self._send_lease_message(session, message)
        if delivered or not isinstance(message, SendRelease):
            return delivered
        # The owner ended the lease: only the holder's pins are left, and the part's
        # next session must free them (I6-quiescence), not its safety net.
        log.info(
            "release of lease %s for %s rank %s found its session gone: sent on",
            message.lease_id,
            message.child_engine_id,
            format_rank(message.rank_key),
        )
        self.leases.release_again(message)
        return True

    def _send_lease_message(self, session: Session, message: LeaseOutbound) -> bool:
        """Queues a lease message on a local session (False: its full queue closed the
        session instead); what it tells of a lease the part left to its owner updates
        that entry."""
        left = self._left_to_owner.get(session.session_id)
        if left is not None and isinstance(message, SendRelease):
            left.held.pop(message.lease_id, None)  # ended: never rebuilt here
        elif isinstance(message, SendQuarantine) and left and message.lease_id in left.held:
            left.quarantined.add(message.lease_id)  # kept by the holder however old
        return self._send(session, message)

    def owners_left_to(self) -> set[str]:
        return {
            owner_of_lease_id(lease_id)
            for left in self._left_to_owner.values()
            for lease_id in left.held
        }

    def owner_silent(self, origin: str) -> None:
        """Another replica fell silent: the prefix loads it owned that a local holder part
        had re-announced while it was live are rebuilt here now, QUARANTINED, as if the
        part registered again (I6-quiescence: else nothing ends them before the holder's
        own pin deadline, and the requester's report finds no lease). Not one the owner
        released, nor one left so long ago that the holder has freed it by itself (unless
        the owner had quarantined it: that one the holder keeps)."""
        leases = self.config.leases
        kept_ms = (
            leases.max_pin_timeout_ms
            + leases.max_transfer_ttl_ms
            + leases.abort_timeout_ms
            + HOLDER_GRACE_MS
        )
        expired_ms = self.clock.monotonic_ms() - kept_ms
        for session_id, left in list(self._left_to_owner.items()):
            held = [h for h in left.held.values() if owner_of_lease_id(h.lease_id) == origin]
            if not held:
                continue
            for entry in held:
                del left.held[entry.lease_id]
            if not left.held:
                del self._left_to_owner[session_id]
            if left.left_ms < expired_ms:
                held = [h for h in held if h.lease_id in left.quarantined]
            session = self._sessions.get(session_id)
            if session is None or not held:
                continue
            log.info(
                "%d lease(s) %s rank %s holds, owned by silent replica %s: rebuilt here",
                len(held),
                left.child_engine_id,
                format_rank(left.rank_key),
                origin,
            )
            try:
                with session.registering():  # its notices may go past the queue's cap
                    self.leases.recover_held(left.child_engine_id, left.rank_key, held)
            except Exception:  # runs on the store's health loop: one part must not stop it
                log.exception("rebuilding the leases of %s failed", left.child_engine_id)

    def remote_pin_result(
        self,
        ref: PartRef,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None:
        if self.registry.session_of(ref.child_engine_id, ref.rank) != ref.session_id:
            log.info("pin result of lease %s from a session that left dropped", lease_id)
            return
        self.leases.on_pin_result(
            ref.child_engine_id, ref.rank, lease_id, pinned_blocks, descriptor, error_message
        )

    def remote_abort_ack(self, ref: PartRef, lease_id: str) -> None:
        if self.registry.session_of(ref.child_engine_id, ref.rank) == ref.session_id:
            self.leases.on_abort_ack(ref.child_engine_id, ref.rank, lease_id)

    def fence_local(self, session_id: str, reason: str) -> None:
        session = self._sessions.get(session_id)
        if session is None:
            return
        log.warning(
            "session %s of %s rank %s fenced out: %s",
            session_id,
            session.ref.child_engine_id,
            format_rank(session.ref.rank),
            reason,
        )
        self.close_session(
            session,
            REASON_FENCED,
            SessionEnd(ErrorCode.UNAVAILABLE, f"this rank part's session was {reason}"),
        )

    def _replace_remote_part(
        self, registration: RankPartRegistration
    ) -> tuple[Callable[[], None], Other | None] | None:
        """A part registering here replaces its remote copy (it moved to this replica).
        Returns what puts the copy back if the registration is refused, and the copy
        (None: no copy).

        Put back here, not heard of again: a hello would have every replica announce
        all its parts, once per refused retry of an engine (the registry refuses
        without changing anything, so the copy fits again as it was)."""
        held = self.registry.session_of(registration.child_engine_id, registration.rank)
        if held is None or held in self._sessions or self.peers is None:
            return None
        peers = self.peers
        removed = self.registry.remove(
            PartRef(registration.child_engine_id, registration.rank, held)
        )
        other = peers.remote(held, removed.part.registration) if removed is not None else None
        undo_forget = peers.forget_session(held)

        def undo() -> None:
            undo_forget()
            if removed is None:
                return
            part = removed.part
            try:
                self.registry.register(
                    part.registration, held, part.incarnation, part.registered_ms
                )
            except KvrcError:  # not expected (see above): hear of it again instead
                log.exception("the remote copy of a refused registration was not put back")
                peers.hello()

        return undo, other

    # --- reads -----------------------------------------------------------------

    def reuse_for(self, view: ChildEngineView) -> ReuseStatus:
        return reuse_status(self.config.reuse, view.profile, self.config.declared_profiles)

    def declared_prefill(self, child_engine_id: str) -> float | None:
        """The prefill rate the requester's declared profile names (the cost model's prior)."""
        view = self.registry.get(child_engine_id)
        if view is None:
            return None
        return declared_prefill_rate(view.profile, self.config.declared_profiles)

    def cost_status(self) -> CostStatus:
        model = self.leases.cost_model
        measured = dict(model.prefill_rates(now_ms := self._clock_ms()))
        registered = [v.child_engine_id for v in self.registry.views()]
        rates = [(c, model.prefill(c, now_ms)) for c in registered]
        known = set(registered)  # once, not per measured requester
        rates += [(c, e) for c, e in measured.items() if c not in known]
        decisions = []
        for view in self.leases.open_leases():
            prediction = self.leases.cost_decision(view.lease_id)
            if prediction is not None:
                decisions.append((view.lease_id, prediction))
        return CostStatus(
            model.config, model.links(self._clock_ms()), tuple(rates), tuple(decisions)
        )

    def status(self, max_leases: int = DEFAULT_STATUS_LEASES) -> StatusSnapshot:
        """At most `max_leases` open leases (`status_leases`); `leases_total` counts all."""
        children = []
        for view in self.registry.views():
            inv = self.inventory.engine_status(view.child_engine_id)
            children.append(
                ChildEngineStatus(
                    view,
                    self.reuse_for(view),
                    inv.entries,
                    inv.stale,
                    self.leases.is_draining(view.child_engine_id),
                )
            )
        open_leases = self.leases.open_leases()
        return StatusSnapshot(
            version=__version__,
            reuse_enabled=self.config.reuse,
            warming=self.warming_status() is not None,
            child_engines=tuple(children),
            inventory_entries=self.inventory.entries_total(),
            leases=status_leases(open_leases, max_leases),
            leases_total=len(open_leases),
            store=self.config.store.url,
            store_unavailable_reason=self.store_unavailable() or "",
            remote_child_engines=self.inventory.remote_engine_count(),
            cost=self.cost_status(),
        )

    def send_to_part(self, child_engine_id: str, rank: RankKey, message: LeaseOutbound) -> bool:
        """Queues a lease message for one rank part (here, or on its replica); False: none."""
        session_id = self.registry.session_of(child_engine_id, rank)
        if session_id is None:
            return False
        session = self._sessions.get(session_id)
        if session is None:
            # A remote part: its replica delivers the message (peers.py).
            return self.peers is not None and self.peers.send(session_id, message)
        return self._send_lease_message(session, message)

    def proven_gone(self, child_engine_id: str) -> bool:
        """No part of the child engine is registered and none is inside its grace period."""
        return child_engine_id not in self._gone_timers and not self.registry.is_registered(
            child_engine_id
        )

    # --- internals -------------------------------------------------------------

    def _take_gone_timer(self, ref: PartRef) -> Timer | None:
        timers = self._gone_timers.get(ref.child_engine_id)
        if timers is None:
            return None
        timer = timers.pop(ref.rank, None)
        if not timers:
            del self._gone_timers[ref.child_engine_id]
        return timer

    def _part_gone(self, ref: PartRef) -> None:
        self._take_gone_timer(ref)
        child = ref.child_engine_id
        if self.proven_gone(child):
            self._forget(child)
        for listener in self._listeners:
            try:
                listener.on_part_gone(ref.child_engine_id, ref.rank, ref.session_id)
            except Exception:
                log.exception("part listener %r failed on gone", listener)

    def reply(self, session: Session, message: object) -> None:
        """Queues an answer the edge encoded on `session` (a full queue ends the session)."""
        self._send(session, EncodedReply(message))

    def _send_to(self, session_id: str, message: Outbound) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            self._send(session, message)

    def _send(self, session: Session, message: Outbound) -> bool:
        """Queues `message`; False when the queue was full and the session is closed."""
        if session.offer(message):
            return True
        self.close_session(
            session,
            REASON_ERROR,
            SessionEnd(
                ErrorCode.RESOURCE_EXHAUSTED,
                f"outbound queue of session {session.session_id} is full "
                f"({self.config.session_queue_size} messages): the engine is not reading "
                "its session stream",
            ),
        )
        return False

    def _readiness_changed(
        self, view: ChildEngineView, reuse: ReuseStatus, skip_session: str = ""
    ) -> None:
        if view.ready:
            self._lifecycle_log.info(
                log, "child engine %s READY (%d parts)", view.child_engine_id, view.parts_expected
            )
            if self.warmup.engine_ready(view.child_engine_id):
                self._warm("every known child engine is back")
        else:
            self._lifecycle_log.info(
                log, "child engine %s not READY: %s", view.child_engine_id, view.not_ready_reason
            )
        self._push_state(view, reuse, skip_session)

    def _stale_changed(self, child_engine_id: str) -> None:
        view = self.registry.get(child_engine_id)
        if view is not None:
            self._push_state(view, self.reuse_for(view))

    def _push_state(
        self, view: ChildEngineView, reuse: ReuseStatus, skip_session: str = ""
    ) -> None:
        """The one path that tells a child engine's parts its state (readiness, stale)."""
        child = view.child_engine_id
        update = StateUpdate(
            view, reuse, self.inventory.is_stale(child), self.leases.is_draining(child)
        )
        for ref in self.registry.parts_of(child):
            session = self._sessions.get(ref.session_id)
            if session is not None and ref.session_id != skip_session:
                self._send(session, update)

    # --- restart recovery (coordinator/core/recovery.py) -------------------------------

    def warming_status(self) -> ReuseStatus | None:
        """While warming, the reuse status lookups and prefix loads answer; else None."""
        if not self.warmup.warming:
            return None
        if self.warmup.tick(self._clock_ms()):
            self._warm("the warm-up deadline passed")
            return None
        return ReuseStatus(False, ReuseReason.WARMING, self.warmup.status().detail)

    def _warmup_deadline(self) -> None:
        self._warmup_timer = None
        if self.warmup.tick(self._clock_ms()):
            self._warm("the warm-up deadline passed")

    def _warm(self, why: str) -> None:
        status = self.warmup.status()
        missing = [c for c in status.expected if self.registry.get(c) is None]
        if missing:
            log.warning(
                "warm: %s; %d known child engine(s) did not come back: %s",
                why,
                len(missing),
                ", ".join(missing[:10]),
            )
        else:
            log.info("warm: %s", why)
        self.metrics.warming.set(0)
        if self._warmup_timer is not None:
            self._warmup_timer.cancel()
            self._warmup_timer = None
        for child in missing:  # not back in time: no longer known
            self._forget(child)

    def _load_warmup(self, now: int) -> Warmup:
        cfg = self.config
        expected: tuple[KnownEngine, ...] = ()
        unreadable = False
        if cfg.state_file is not None:
            try:
                with open(cfg.state_file, "rb") as f:
                    data = f.read(MAX_STATE_FILE_BYTES + 1)
                state = decode_state_file(data)
                expected, self._lease_id_key = state.engines, state.lease_id_key
                self._lease_id_key_written = state.lease_id_key is not None
            except FileNotFoundError:
                pass  # a first start
            except (OSError, StateFileError) as e:
                # Fail safe: some engines may have been known; warm up for the deadline.
                log.warning(
                    "state file %s unusable (%s): warming until the deadline", cfg.state_file, e
                )
                unreadable = self._state_unreadable = True
        warmup_ms = cfg.warmup_ms if cfg.warmup_ms is not None else DEFAULT_WARMUP_MS
        timed = unreadable or (cfg.state_file is None and cfg.warmup_ms is not None)
        warmup = Warmup(
            expected=[e.child_engine_id for e in expected],
            started_ms=now,
            warmup_ms=warmup_ms,
            timed=timed,
        )
        # Until they are back or the warm-up ends, the file keeps listing them.
        self._known = {e.child_engine_id: e for e in expected}
        self._known_written = expected
        if warmup.warming:
            log.warning("warming: %s", warmup.status().detail)
        return warmup

    def _remember(self, child_engine_id: str, engine_id: str, parts_expected: int) -> None:
        known = KnownEngine(child_engine_id, engine_id, parts_expected)
        if self._known.get(child_engine_id) != known:
            self._known[child_engine_id] = known
            self._schedule_state_write()

    def _forget(self, child_engine_id: str) -> None:
        if self._known.pop(child_engine_id, None) is not None:
            self._schedule_state_write()

    def _schedule_state_write(self) -> None:
        if self.config.state_file is None or self._state_timer is not None:
            return
        if self._shutting_down:
            return
        self._state_timer = self.clock.call_later(_STATE_WRITE_DELAY_MS, self._flush_state)

    def _flush_state(self) -> None:
        self._state_timer = None
        path = self.config.state_file
        if path is None:
            return
        known = tuple(sorted(self._known.values(), key=lambda e: e.child_engine_id))
        if known == self._known_written and self._lease_id_key_written:
            return
        tmp = path.with_name(path.name + ".tmp")
        try:
            # Atomic replace: a crash mid-write leaves the previous file, never half of one.
            # Private: the lease id key is in it.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.fchmod(fd, 0o600)  # a .tmp an older kvrc left keeps its mode otherwise
            data = encode_state(known, self.clock.wall_ms(), self._lease_id_key)
            if len(data) > MAX_STATE_FILE_BYTES // 2 or len(known) > MAX_KNOWN_ENGINES:
                listed = data.count(b'"child_engine_id"')
                if listed < len(known):
                    self._refusal_log.warning(
                        "state file",
                        "state file %s lists %d of %d known child engines (its size limit): "
                        "a restart warms up for those only",
                        path,
                        listed,
                        len(known),
                    )
            with open(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as e:
            log.error("cannot write state file %s: %s", path, e)
            return
        self._known_written = known
        self._lease_id_key_written = True

    def use_lease_id_key_secret(self, secret: bytes) -> None:
        """Replicas: lease ids are tagged under a key every replica derives from the same
        secret (the shared store's epoch), since any replica may rebuild a lease that a
        silent one owned. A new secret (a store loss) makes older ids unverifiable."""
        self.leases.table.set_id_key(derived_key(secret, "replicas"))

    def _update_gauges(self) -> None:
        if self.peers is None:
            ready, not_ready = self.registry.readiness_counts()
        else:
            # Only engines with a session here: a sum over the replicas counts each once.
            local = {s.ref.child_engine_id for s in self._sessions.values()}
            ready = sum(1 for cid in local if self.registry.is_ready(cid))
            not_ready = len(local) - ready
        self.metrics.child_engines.labels(state="ready").set(ready)
        self.metrics.child_engines.labels(state="not_ready").set(not_ready)
        self.metrics.rank_parts.set(len(self._sessions))
        self.metrics.registry_rank_parts.set(self.registry.num_parts)
        self.metrics.registry_endpoint_bytes.set(self.registry.endpoint_bytes)

    def _arm_watchdog(self) -> None:
        timeout = self.config.heartbeat_timeout_ms
        # Check often enough that removal lags the timeout by at most ~20 %.
        self._watchdog = self.clock.call_later(
            min(max(timeout // 5, 20), 1000), self._watchdog_pass
        )

    def _watchdog_pass(self) -> None:
        try:
            self._expire(self._clock_ms(), self.config.heartbeat_timeout_ms)
        except Exception:  # the watchdog must outlive any one bad removal
            log.exception("heartbeat watchdog pass failed")
        if not self._shutting_down:
            self._arm_watchdog()

    def _expire(self, now: int, timeout: int) -> None:
        for ref in self.registry.expired(now, timeout):
            session = self._sessions.get(ref.session_id)
            if session is None:
                continue
            self.close_session(
                session,
                REASON_HEARTBEAT_TIMEOUT,
                SessionEnd(
                    ErrorCode.UNAVAILABLE,
                    f"no heartbeat from rank part {format_rank(ref.rank)} of "
                    f"{ref.child_engine_id!r} for more than {timeout} ms",
                ),
            )
