"""Both lease flows over the live service: executes what the grants core decides.

`LeaseFlow` owns the pure `Grants` (coordinator/core/grants.py, over the lease
table of coordinator/core/leases.py). Every RPC or session message is one call
into it; this runtime executes the actions that come back: pin / release /
abort / quarantine / drain messages go onto the rank parts' session streams,
the RPCs waiting for a prefix-load answer or for a READY handoff are answered
from the action that settles them, one timer fires the core's deadlines, and
the lease metrics follow every step.

Proven death (I6-quiescence): the coordinator tells this flow `on_part_gone`
`session_grace_ms` after a part's session closed, unless it came back. A child
engine counts as gone for its leases only when no part of it is registered and
no other part is still inside its grace period; only then may pins be released
without reports.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from coordinator.core.cost_model import CostModel, Prediction
from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import (
    MAX_DRAIN_TIMEOUT_MS,
    MAX_HANDOFF_WAIT_MS,
    BeginHandoffRequest,
    CostObserved,
    DrainDeadlinePassed,
    DrainingChanged,
    DrainNotice,
    DrainResult,
    GrantAction,
    Grants,
    HandoffBeginFailed,
    HandoffBegun,
    LeaseOutbound,
    PrefixLoadAnswer,
    PrefixLoadAnswered,
    PrefixLoadRequest,
    PublishHandoffRequest,
    TransferReport,
)
from coordinator.core.inventory import Inventory
from coordinator.core.leases import (
    TERMINAL_STATES,
    Flow,
    HandoffGrant,
    LeaseAborting,
    LeaseConfig,
    LeaseEnded,
    LeaseGranted,
    LeaseMissed,
    LeaseQuarantined,
    LeaseState,
    LeaseTable,
    LeaseView,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
)
from coordinator.core.profiles import ReuseStatus
from coordinator.core.registry import ChildEngineView, HeldLease, Registry
from coordinator.runtime.clock import Clock, Timer
from coordinator.runtime.lease_ledger import LeaseLedger
from coordinator.runtime.log_limit import LogBudget, RateLimitedLog
from coordinator.runtime.metrics import Metrics
from kvrc.vocabulary import COORDINATOR_SHUTTING_DOWN, RETRY_AT_THE_NEXT_COORDINATOR, RankKey, Tier

__all__ = [
    "MAX_DRAIN_TIMEOUT_MS",
    "MAX_HANDOFF_WAIT_MS",
    "BeginHandoffRequest",
    "DrainNotice",
    "DrainResult",
    "LeaseFlow",
    "LeaseOutbound",
    "PrefixLoadAnswer",
    "PrefixLoadRequest",
    "PublishHandoffRequest",
    "TransferReport",
]

log = logging.getLogger("kvrc.leases")

# After a drain deadline aborted its leases, a waiting Drain gives the acks this long.
DRAIN_ACK_GRACE_MS = 2_000
# A waiting Drain is woken by the end of its engines' leases, and re-checks at least
# this often besides (a safety net, e.g. for a table replaced from the shared store).
_DRAIN_POLL_MS = 1_000
# Releases kept for parts that had no session when they were decided (oldest dropped
# first: that holder's own pin safety net, clients/holds.py, then frees the blocks).
MAX_UNSENT_RELEASES = 4096
# A release that came back unacknowledged from this many sessions of its part in a row
# is given up (its holder's safety net frees the pins): a holder acks within ~20 ms, so
# only an engine that never acks gets here, and its releases must not crowd the other
# parts' kept ones out of MAX_UNSENT_RELEASES.
MAX_RELEASE_RETURNS = 4

_NON_TERMINAL = tuple(s for s in LeaseState if s not in TERMINAL_STATES)

SendToPart = Callable[[str, RankKey, LeaseOutbound], bool]


class LeaseFlow:
    """Both lease flows over the live service. Also a `PartListener` of the coordinator."""

    def __init__(
        self,
        *,
        registry: Registry,
        inventory: Inventory,
        metrics: Metrics,
        send_to_part: SendToPart,
        reuse_for: Callable[[ChildEngineView], ReuseStatus],
        proven_gone: Callable[[str], bool],
        clock: Clock,
        config: LeaseConfig | None = None,
        table: LeaseTable | None = None,
        cost: CostModel | None = None,
        lifecycle_log: LogBudget | None = None,
    ) -> None:
        self.core = Grants(
            table=table if table is not None else LeaseTable(config),
            registry=registry,
            inventory=inventory,
            reuse_for=reuse_for,
            cost=cost,
        )
        self.table = self.core.table
        self._metrics = metrics
        self._send_to_part = send_to_part
        self._proven_gone = proven_gone
        self._clock = clock
        # Lines a session's messages trigger: one per kind per 10 s (I8-bad-input).
        self._session_log = RateLimitedLog(log, clock.monotonic_ms)
        # Engines gone: the coordinator's lifecycle budget (I8-bad-input).
        self._lifecycle_log = lifecycle_log or LogBudget(clock.monotonic_ms)
        # Leases aborted or quarantined, messages a part had no session for: engines
        # can cause them in a loop (I8-bad-input); the metrics count every one.
        self._lease_log = LogBudget(clock.monotonic_ms, what="lease")
        # Quarantines have their own: an operator acts on each, and a loop of aborts
        # must not spend the lines that name them.
        self._quarantine_log = LogBudget(clock.monotonic_ms, what="lease quarantine")
        self._payload_shown = 0  # what kvrc_lease_payload_bytes shows (the gauge starts at 0)
        self._closing = False
        self._timer: Timer | None = None
        self._timer_due: int | None = None
        # RPCs waiting for an answer that a later core call settles.
        self._answers: dict[str, list[asyncio.Future[PrefixLoadAnswer]]] = {}
        self._begins: dict[int, asyncio.Future[HandoffGrant]] = {}
        # Waiting Drains, by the child engines each waits on: a lease's end wakes only
        # the drains of its own engines (entries leave with their waiter).
        self._drain_waiters: dict[str, set[asyncio.Event]] = {}
        # Releases whose holder part had no session when they were decided (between
        # sessions, or moved to a replica not heard from yet): sent again when it
        # registers, here or on another replica (I6: else its pins wait for its own
        # safety net). By part, then lease id; and every kept one, oldest first.
        self._unsent_releases: dict[tuple[str, RankKey], dict[str, SendRelease]] = {}
        self._unsent_order: OrderedDict[tuple[str, RankKey, str], None] = OrderedDict()
        # Per lease id: how many sessions a release came back from unacknowledged
        # (bounded as the kept releases are; an id forgotten here counts from 0 again).
        self._release_returns: OrderedDict[str, int] = OrderedDict()
        self._m_releases_waiting = metrics.releases_waiting
        self._m_draining = metrics.child_engines.labels(state="draining")
        self._m_draining.set(0)
        # Restart recovery (coordinator/core/recovery.py): a status while warming, else None.
        self.warming: Callable[[], ReuseStatus | None] = lambda: None
        # A shared store that is unreachable says why here (None: grants may go on).
        self.store_unavailable: Callable[[], str | None] = lambda: None
        # With a shared store: the lease ledger (coordinator/runtime/lease_ledger.py) records
        # every prefix load before its pins are asked for, and every later change of it.
        self.ledger: LeaseLedger | None = None
        # The gauge's children, labelled once (labels() costs µs; _execute runs per step),
        # and the value last set on each, so only changed counts are written.
        self._gauge_children = {
            (flow, state): metrics.leases.labels(flow=flow.value, state=state.name.lower())
            for flow in Flow
            for state in _NON_TERMINAL
        }
        self._update_gauge()

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._arm()

    def close_to_changes(self) -> None:
        """From now on every lease RPC answers UNAVAILABLE, changing nothing.

        Called before the sessions end: a lease that ended after that would send its
        release into a closed session, and the reporter, answered "quiescent", would not
        tell the next coordinator, which rebuilds the holder's lease quarantined. Refused
        here, the engines retry at the next coordinator (I6-quiescence). The calls that
        wait (BeginHandoff, RequestPrefixLoad) are answered so now too, before the
        sessions end: the end of a decode engine's own session would fail its begin
        "not registered" instead, and its client would not know to retry elsewhere."""
        self._closing = True
        self._execute(self.core.fail_all_begins())
        for waiting in self._answers.values():
            for future in waiting:
                if not future.done():
                    future.set_exception(
                        KvrcError(ErrorCode.UNAVAILABLE, COORDINATOR_SHUTTING_DOWN)
                    )
        self._answers.clear()

    def _check_open(self) -> None:
        if self._closing:
            raise KvrcError(ErrorCode.UNAVAILABLE, RETRY_AT_THE_NEXT_COORDINATOR)

    async def shutdown(self) -> None:
        self.close_to_changes()
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for waiters in self._drain_waiters.values():
            for woken in waiters:
                woken.set()

    # --- reads -----------------------------------------------------------------------

    @property
    def heartbeat_interval_ms(self) -> int:
        """How often a decode engine extends its handoff lease (three tries per timeout)."""
        return max(self.table.config.handoff_heartbeat_timeout_ms // 3, 1)

    def leases_in_flight(self) -> Mapping[str, int]:
        """Open leases per child engine, as source or target (a live view, O(1))."""
        return self.table.open_counts_by_engine()

    def open_leases(self) -> list[LeaseView]:
        """In flight and quarantined, oldest first (for `kvrc status`)."""
        return sorted(self.table.list_leases(), key=lambda v: (v.created_ms, v.lease_id))

    def is_draining(self, child_engine_id: str) -> bool:
        return self.core.is_draining(child_engine_id)

    def may_lend(self, holder_child_engine_id: str, compatibility_hash: str) -> bool:
        """The grants' holder check (READY, not draining, same compatibility): Score's."""
        return self.core.may_lend(holder_child_engine_id, compatibility_hash)

    @property
    def cost_model(self) -> CostModel:
        """The cost model (I9-cost-gate): `predict(...)` for Score, estimates for status."""
        return self.core.cost

    def cost_decision(self, lease_id: str) -> Prediction | None:
        return self.core.cost_decision(lease_id)

    def predict_load(
        self, holder_child_engine_id: str, requester_child_engine_id: str, tier: Tier, blocks: int
    ) -> Prediction | None:
        """Predicted load vs recompute of `blocks` blocks (Score's TTFT saving: `saving_ms`)."""
        return self.core.predict_load(
            holder_child_engine_id,
            requester_child_engine_id,
            tier,
            blocks,
            self._clock.monotonic_ms(),
        )

    # --- prefix load -------------------------------------------------------------------

    async def request_prefix_load(self, req: PrefixLoadRequest) -> PrefixLoadAnswer:
        """One core call; a lease waiting for its pins is answered by the call that settles it."""
        self._check_open()
        reason = self.store_unavailable()
        if reason is not None:
            # Fail closed: replicas that cannot reach the shared store grant nothing new.
            raise KvrcError(ErrorCode.UNAVAILABLE, f"no new grants: {reason}")
        step = self.core.request_prefix_load(req, self._clock.monotonic_ms(), self.warming())
        if step.answer is not None and step.answer.view is None:
            self._metrics.prefix_load_misses.labels(reason=step.answer.miss_reason).inc()
        if step.answer is not None:
            self._execute(step.actions)
            return step.answer
        assert step.lease_id is not None
        future: asyncio.Future[PrefixLoadAnswer] = asyncio.get_running_loop().create_future()
        self._answers.setdefault(step.lease_id, []).append(future)
        self._execute(step.actions)  # a pin may be answered inside (same stream order)
        try:
            return await future
        finally:
            waiting = self._answers.get(step.lease_id)
            if waiting is not None and future in waiting:
                waiting.remove(future)
                if not waiting:
                    del self._answers[step.lease_id]

    def complete_prefix_load(self, report: TransferReport) -> LeaseView:
        self._check_open()
        return self._complete(report, Flow.PREFIX_LOAD)

    def on_pin_result(
        self,
        holder_child_engine_id: str,
        rank_key: RankKey,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        error_message: str,
    ) -> None:
        """A holder part's PinResult (from its session stream)."""
        if error_message:
            # The engine's own text: quoted, so that it cannot forge log lines.
            self._session_log.info(
                "PinResult error",
                "holder %s rank %s answered lease %s with %d block(s): %.300r",
                holder_child_engine_id,
                rank_key,
                lease_id,
                pinned_blocks,
                error_message,
            )
        self._session_step(
            "PinResult",
            lambda now: self.core.on_pin_result(
                holder_child_engine_id, rank_key, lease_id, pinned_blocks, descriptor, now
            ),
        )

    # --- decode handoff ------------------------------------------------------------------

    def publish_handoff(self, req: PublishHandoffRequest) -> tuple[LeaseView, int, int]:
        """Returns (view, parts reported, parts expected)."""
        self._check_open()
        step = self.core.publish_handoff(req, self._clock.monotonic_ms())
        self._execute(step.actions)
        return step.view, step.parts_reported, step.parts_expected

    async def begin_handoff(self, req: BeginHandoffRequest) -> HandoffGrant:
        """Waits up to `wait_timeout_ms` for READY (DEADLINE_EXCEEDED after), then grants."""
        self._check_open()
        started = self._clock.monotonic_ms()
        step = self.core.begin_handoff(req, started)
        self._execute(step.actions)
        if step.grant is not None:
            return step.grant
        assert step.token is not None
        future: asyncio.Future[HandoffGrant] = asyncio.get_running_loop().create_future()
        self._begins[step.token] = future
        self._arm()  # the wait's deadline may be the earliest
        try:
            return await future
        except asyncio.CancelledError:
            self.core.cancel_begin(step.token)  # the caller left: never grant it
            raise
        finally:
            self._begins.pop(step.token, None)
            waited_ms = self._clock.monotonic_ms() - started
            self._metrics.handoff_wait.observe(waited_ms / 1000)

    def forget_cancelled_begins(self) -> None:
        """Begins whose task was just cancelled (its awaited future is cancelled at once,
        `cancel_begin` runs only at the task's next step): never granted in between."""
        for token, future in self._begins.items():
            if future.cancelled():
                self.core.cancel_begin(token)

    def extend_handoff(self, lease_id: str, decode_child_engine_id: str) -> int:
        self._check_open()
        deadline = self.core.extend_handoff(
            lease_id, decode_child_engine_id, self._clock.monotonic_ms()
        )
        self._arm()
        return deadline

    def complete_handoff(self, report: TransferReport) -> LeaseView:
        self._check_open()
        return self._complete(report, Flow.HANDOFF)

    # --- both flows ----------------------------------------------------------------------

    def on_abort_ack(self, child_engine_id: str, rank_key: RankKey, lease_id: str) -> None:
        self._session_step(
            "AbortAck",
            lambda now: self.core.on_abort_ack(child_engine_id, rank_key, lease_id, now),
        )

    def recover_held(
        self, child_engine_id: str, rank_key: RankKey, held: Iterable[HeldLease]
    ) -> None:
        """A registering part's held leases: leases it still holds pins for (restart recovery).

        Unknown ones are rebuilt QUARANTINED (coordinator/core/leases.py `recover_held`); a
        bad or foreign id is logged, counted when foreign, and skipped: the session goes on.
        One whose release is kept here for this part is not rebuilt: it ended, and
        `on_part_registered` sends that release (a rebuilt copy would stay quarantined
        for an operator after the holder freed its pins).
        """
        # One line per Register, however many ids it names (a part may name thousands).
        states: Counter[str] = Counter()
        refused: Counter[str] = Counter()
        first_refusal = ""
        released = self._unsent_releases.get((child_engine_id, rank_key), {})
        for entry in held:
            lease_id = entry.lease_id
            if lease_id in released:
                states["released"] += 1
                continue
            try:
                view, actions = self.core.recover_held(
                    child_engine_id,
                    rank_key,
                    lease_id,
                    self._clock.monotonic_ms(),
                    entry.requester_child_engine_id,
                )
            except KvrcError as e:
                if e.code is ErrorCode.PERMISSION_DENIED:
                    self._metrics.auth_denied.labels(reason="foreign_lease").inc()
                refused[e.code.value] += 1
                first_refusal = first_refusal or f"{lease_id!r}: {e}"
                continue
            if actions:
                states[view.state.name] += 1
            self._execute(actions, log_quarantines=False)  # summed up below
        if states or refused:
            self._lifecycle_log.warning(  # a register/close loop must not fill the log
                log,
                "held leases re-announced by %s rank %s: %s; not recovered: %s%s",
                child_engine_id,
                rank_key,
                ", ".join(f"{n} {state}" for state, n in sorted(states.items())) or "none",
                ", ".join(f"{n} {code}" for code, n in sorted(refused.items())) or "none",
                f" (first: {first_refusal})" if first_refusal else "",
            )

    def on_part_registered(
        self, child_engine_id: str, rank_key: RankKey, announced: Collection[str] = ()
    ) -> None:
        """A rank part (re-)registered (after its RegisterReply): what was sent while it
        was between sessions was dropped, so every abort it still owes an ack for goes
        again, every quarantine of a lease it may hold (but those it just `announced`:
        `recover_held` told it), and every release kept for it."""
        actions = self.core.on_part_registered(child_engine_id, rank_key, announced)
        releases = list(self._unsent_releases.get((child_engine_id, rank_key), {}).values())
        if actions or releases:
            aborts = sum(isinstance(a, SendAbort) for a in actions)
            self._lifecycle_log.info(
                log,
                "%s rank %s re-registered: %d abort(s) it owes an ack for, %d quarantine(s) "
                "and %d release(s) sent again",
                child_engine_id,
                rank_key,
                aborts,
                len(actions) - aborts,
                len(releases),
            )
        for release in releases:
            self._send(child_engine_id, rank_key, release)
        self._execute(actions)

    def releases_returned(self, releases: Sequence[SendRelease]) -> int:
        """Releases a closing session was given and never acknowledged go on
        (`release_again`), each until it has come back MAX_RELEASE_RETURNS times; returns
        how many were given up (the caller logs them with the session)."""
        returns = self._release_returns
        given_up = 0
        for release in releases:
            count = returns.pop(release.lease_id, 0) + 1
            if count >= MAX_RELEASE_RETURNS:
                given_up += 1
                self._metrics.releases_given_up.inc()
                continue
            returns[release.lease_id] = count
            if len(returns) > 2 * MAX_UNSENT_RELEASES:
                returns.popitem(last=False)
            self.release_again(release)
        return given_up

    def release_again(self, release: SendRelease) -> None:
        """A release its holder's session never acknowledged: it ended (or its full queue
        closed it) with the release queued or read but not acked, or before another
        replica's release reached it here. It goes to the part's session now, here or on
        another replica, or is kept for its next registration (I6-quiescence: else the
        pins wait for the holder's safety net). Each hop goes to a session that
        registered after the one the release was meant for, so it never circles. The
        caller logs (one line per session closed, not per release)."""
        self._send(release.child_engine_id, release.rank_key, release, log_unsent=False)

    def resolve_quarantine(self, lease_id: str, operator_note: str) -> LeaseView:
        # Its release could no longer reach the holder: resolve at the next coordinator,
        # which rebuilds the lease quarantined from the holder's re-announcement.
        self._check_open()
        view, actions = self.core.resolve_quarantine(lease_id, self._clock.monotonic_ms())
        log.warning(
            "quarantine of %s lease %s resolved by an operator: %.300r",
            view.flow.value,
            lease_id,
            operator_note or "(no note)",
        )
        self._execute(actions)
        return view

    # --- drain ---------------------------------------------------------------------------

    async def drain(self, target: str, timeout_ms: int, wait: bool) -> DrainResult:
        """Stops new grants from/to the engine(s); aborts what runs past the deadline."""
        step = self.core.drain(target, timeout_ms, self._clock.monotonic_ms())
        for notice in step.actions:
            if isinstance(notice, DrainNotice):
                log.info("draining %s rank %s", notice.child_engine_id, notice.rank_key)
        self._execute(step.actions)
        children = step.child_engine_ids
        self._arm()
        if wait:
            await self._wait_drained(children)
        remaining = self.core.leases_remaining(children)
        return DrainResult(tuple(children), remaining, remaining == 0)

    async def _wait_drained(self, children: Sequence[str]) -> None:
        until = self.core.drain_deadline_ms(children) + DRAIN_ACK_GRACE_MS
        woken = asyncio.Event()
        for child in children:
            self._drain_waiters.setdefault(child, set()).add(woken)
        try:
            while True:
                woken.clear()  # before the check: an end after it sets it again
                if not self.core.leases_remaining(children) or self._closing:
                    return
                left = until - self._clock.monotonic_ms()
                if left <= 0:
                    return
                await self._clock.wait(woken, min(left, _DRAIN_POLL_MS))
        finally:
            for child in children:
                waiters = self._drain_waiters.get(child)
                if waiters is not None:
                    waiters.discard(woken)
                    if not waiters:
                        del self._drain_waiters[child]

    # --- part listener -------------------------------------------------------------------

    def on_part_removed(self, child_engine_id: str, rank: RankKey, reason: str) -> None:
        self._execute(self.core.on_part_removed(child_engine_id, self._clock.monotonic_ms()))

    def on_part_gone(self, child_engine_id: str, rank: RankKey, session_id: str) -> None:
        if not self._proven_gone(child_engine_id):
            return  # some part is back or still in its grace period
        actions = self.core.on_engine_gone(child_engine_id, self._clock.monotonic_ms())
        if actions:
            self._lifecycle_log.info(
                log, "child engine %s is gone: %d lease action(s)", child_engine_id, len(actions)
            )
        self._execute(actions)

    # --- internals -----------------------------------------------------------------------

    def _complete(self, report: TransferReport, flow: Flow) -> LeaseView:
        step = self.core.complete(report, flow, self._clock.monotonic_ms(), self.warming())
        if step.first_report:
            self._metrics.transfer_reports.labels(
                flow=flow.value, outcome=report.outcome.name.lower()
            ).inc()
            self._metrics.transfer_bytes.labels(flow=flow.value).inc(report.bytes_moved)
        self._execute(step.actions)
        return step.view

    def _session_step(self, what: str, call: Callable[[int], Sequence[GrantAction]]) -> None:
        """A session message about a lease: stale ones (ended, purged, foreign) are logged."""
        try:
            actions = call(self._clock.monotonic_ms())
        except KvrcError as e:
            if e.code is ErrorCode.INVALID_ARGUMENT:
                raise  # malformed: the session ends with the status
            if e.code is ErrorCode.PERMISSION_DENIED:
                self._metrics.auth_denied.labels(reason="foreign_lease").inc()
            self._session_log.warning(
                f"{what} {e.code.value}", "%s ignored: %s: %s", what, e.code.value, e.message
            )
            return
        self._execute(actions)

    def _send(
        self, child_engine_id: str, rank: RankKey, message: LeaseOutbound, log_unsent: bool = True
    ) -> None:
        sent = self._send_to_part(child_engine_id, rank, message)
        if isinstance(message, SendRelease):
            self._keep_unsent(child_engine_id, rank, message, sent)
        if not sent and log_unsent:
            self._lease_log.info(
                log,
                "%s for %s rank %s not sent: the part has no session",
                type(message).__name__,
                child_engine_id,
                rank,
            )

    def _keep_unsent(
        self, child_engine_id: str, rank: RankKey, release: SendRelease, sent: bool
    ) -> None:
        """Keeps a release its part could not be sent (newest MAX_UNSENT_RELEASES in all),
        or forgets it once sent."""
        part = (child_engine_id, rank)
        kept = self._unsent_releases.get(part)
        if sent:
            if kept is not None and kept.pop(release.lease_id, None) is not None:
                del self._unsent_order[(*part, release.lease_id)]
                if not kept:
                    del self._unsent_releases[part]
                self._m_releases_waiting.set(len(self._unsent_order))
            return
        self._unsent_releases.setdefault(part, {})[release.lease_id] = release
        self._unsent_order[(*part, release.lease_id)] = None
        while len(self._unsent_order) > MAX_UNSENT_RELEASES:
            (child, oldest_rank, lease_id), _ = self._unsent_order.popitem(last=False)
            oldest = self._unsent_releases[(child, oldest_rank)]
            del oldest[lease_id]
            if not oldest:
                del self._unsent_releases[(child, oldest_rank)]
        self._m_releases_waiting.set(len(self._unsent_order))

    def _execute(self, actions: Sequence[GrantAction], *, log_quarantines: bool = True) -> None:
        """`log_quarantines` False: the caller logs them in one line (restart recovery
        names thousands per Register)."""
        m = self._metrics
        ledger = self.ledger
        if ledger is not None:
            # Records the prefix loads' changes; holds their pins until recorded.
            ledger.observe(actions, self.table.get, self._pins_recorded)
        for action in actions:
            if isinstance(action, SendPin):
                if ledger is None:
                    self._send(action.child_engine_id, action.rank_key, action)
            elif isinstance(action, SendRelease | SendAbort | SendQuarantine | DrainNotice):
                self._send(action.child_engine_id, action.rank_key, action)
            elif isinstance(action, PrefixLoadAnswered):
                for future in self._answers.pop(action.lease_id, ()):
                    if not future.done():
                        future.set_result(action.answer)
            elif isinstance(action, HandoffBegun):
                begun = self._begins.get(action.token)
                if begun is not None and not begun.done():
                    begun.set_result(action.grant)
            elif isinstance(action, HandoffBeginFailed):
                failed = self._begins.get(action.token)
                if failed is not None and not failed.done():
                    failed.set_exception(KvrcError(action.code, action.message))
            elif isinstance(action, CostObserved):
                if action.probe:
                    m.cost_probes.inc()
                if action.predicted_load_ms > 0:
                    m.cost_prediction_error.labels(link=action.link_basis).observe(
                        action.actual_load_ms / action.predicted_load_ms
                    )
            elif isinstance(action, DrainingChanged):
                self._m_draining.set(action.draining)
            elif isinstance(action, DrainDeadlinePassed):
                log.info("drain deadline of %s passed: aborting its leases", action.child_engine_id)
            elif isinstance(action, LeaseGranted):
                m.lease_grant_duration.labels(flow=action.flow.value).observe(
                    action.grant_latency_ms / 1000
                )
            elif isinstance(action, LeaseMissed):
                m.prefix_load_misses.labels(reason=action.reason.value).inc()
            elif isinstance(action, LeaseAborting):
                m.lease_aborts.labels(flow=action.flow.value).inc()
                self._lease_log.info(
                    log,
                    "aborting %s lease %s: %s",
                    action.flow.value,
                    action.lease_id,
                    action.reason,
                )
            elif isinstance(action, LeaseQuarantined):
                m.lease_quarantines.labels(flow=action.flow.value).inc()
                if log_quarantines:
                    self._quarantine_log.warning(
                        log,
                        "%s lease %s quarantined: %s",
                        action.flow.value,
                        action.lease_id,
                        action.reason,
                    )
            elif isinstance(action, LeaseEnded):
                for child in action.child_engine_ids:
                    for woken in self._drain_waiters.get(child, ()):
                        woken.set()
                m.leases_ended.labels(flow=action.flow.value, state=action.state.name.lower()).inc()
                if action.quiescence_ms is not None:
                    m.lease_quiescence_duration.labels(flow=action.flow.value).observe(
                        action.quiescence_ms / 1000
                    )
        # Also with no actions: a step may still change counts (a first-part publish admits
        # a WAITING_READY handoff) and add a deadline (its publish timeout).
        self._update_gauge()
        self._arm()

    def _pins_recorded(self, lease_id: str, pins: Sequence[SendPin], ok: bool, why: str) -> None:
        """The ledger answered a lease's open: its pins leave now, or it misses."""
        try:
            state = self.table.get(lease_id).state
        except KvrcError:
            state = None  # purged meanwhile
        if state is not LeaseState.PINNING:
            return  # ended meanwhile (its end follows in the ledger): nobody may pin now
        if ok:
            for pin in pins:
                self._send(pin.child_engine_id, pin.rank_key, pin)
            return
        log.warning("prefix load %s not granted: %s", lease_id, why)
        self._execute(self.core.refuse_by_store(lease_id, self._clock.monotonic_ms()))

    def _update_gauge(self) -> None:
        for key, value in self.table.take_changed_counts():
            child = self._gauge_children.get(key)
            if child is not None:
                child.set(value)
        payload = self.table.payload_bytes
        if payload != self._payload_shown:  # most steps change no payload: no gauge lock
            self._payload_shown = payload
            self._metrics.lease_payload.set(payload)

    def _arm(self) -> None:
        """One timer, at the core's next deadline (re-armed when that moves earlier)."""
        if self._closing:
            return
        due = self.core.due_ms
        if due is None or (
            self._timer is not None and self._timer_due is not None and self._timer_due <= due
        ):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_due = due
        self._timer = self._clock.call_later(due - self._clock.monotonic_ms(), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_due = None
        try:
            self._execute(self.core.tick(self._clock.monotonic_ms()))
        except Exception:  # the timer must outlive any one bad step
            log.exception("lease timer pass failed")
        self._arm()
