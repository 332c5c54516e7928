"""The lease edge of the coordinator: runs both lease flows over the live service.

`LeaseFacade` owns the pure `LeaseTable` (coordinator/core/leases.py) and executes
what it returns: pin / release / abort / quarantine messages go onto the rank
parts' session streams, RPCs waiting for a grant or for a READY handoff are
woken, a deadline ticker fires the table's timers and drain deadlines, and the
lease metrics follow every step.

Proven death (invariant 6): the coordinator tells this facade `on_part_gone`
`session_grace_ms` after a part's session closed, unless it came back. A child
engine counts as gone for its leases only when no part of it is registered and
no other part is still inside its grace period; only then may pins be released
without reports.

The holder for a prefix load comes from the inventory through a `HolderFinder`
(plugged in by the coordinator); this facade gives the finder the number of
leases in flight per child engine, so busy holders rank lower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from coordinator.core.errors import ErrorCode, KvrcError, failed_precondition, not_found
from coordinator.core.events import BlockHash, RankKey
from coordinator.core.leases import (
    TERMINAL_STATES,
    Action,
    Flow,
    HandoffGrant,
    HandoffReady,
    LeaseAborting,
    LeaseConfig,
    LeaseEnded,
    LeaseGranted,
    LeaseMissed,
    LeaseQuarantined,
    LeaseState,
    LeaseTable,
    LeaseView,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
)
from coordinator.core.profiles import ReuseReason, ReuseStatus
from coordinator.core.registry import ChildEngineView, Registry, grid_ranks
from coordinator.runtime.metrics import Metrics

log = logging.getLogger("kvrc.leases")

# Defaults for requests that leave a duration at 0.
DEFAULT_PIN_TIMEOUT_MS = 2_000
DEFAULT_TRANSFER_TIMEOUT_MS = 30_000
DEFAULT_DRAIN_TIMEOUT_MS = 60_000
MAX_HANDOFF_WAIT_MS = 600_000
MAX_DRAIN_TIMEOUT_MS = 3_600_000
# After a drain deadline aborted its leases, a waiting Drain gives the acks this long.
DRAIN_ACK_GRACE_MS = 2_000
# The ticker wakes at least this often (timers are also kicked on every change).
_MAX_TICK_S = 1.0

_NON_TERMINAL = tuple(s for s in LeaseState if s not in TERMINAL_STATES)


# --- outbound session message of this edge (the core's Send* are the others) ----


@dataclass(frozen=True, slots=True)
class DrainNotice:
    child_engine_id: str
    deadline_ms: int


LeaseOutbound = SendPin | SendRelease | SendAbort | SendQuarantine | DrainNotice


# --- requests, as wire.py decodes and validates them --------------------------------


@dataclass(frozen=True, slots=True)
class PrefixLoadRequest:
    request_id: str
    requester_child_engine_id: str
    block_hashes: tuple[BlockHash, ...]
    compatibility_hash: str  # "" = the requester's own
    min_blocks: int
    group_idx: int
    pin_timeout_ms: int  # 0 = DEFAULT_PIN_TIMEOUT_MS
    transfer_timeout_ms: int  # 0 = DEFAULT_TRANSFER_TIMEOUT_MS


@dataclass(frozen=True, slots=True)
class TransferReport:
    lease_id: str
    reporter_child_engine_id: str
    rank_key: RankKey
    outcome: Outcome
    bytes_moved: int
    duration_us: int
    error_message: str


@dataclass(frozen=True, slots=True)
class PublishHandoffRequest:
    request_id: str
    prefill_child_engine_id: str
    rank_key: RankKey
    descriptor: bytes  # a serialized kvrc.v1.RankPartDescriptor, returned byte for byte
    kv_transfer_params: bytes
    decode_child_engine_id: str | None
    num_blocks: int


@dataclass(frozen=True, slots=True)
class BeginHandoffRequest:
    request_id: str
    prefill_child_engine_id: str
    decode_child_engine_id: str
    wait_timeout_ms: int


# --- answers -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixLoadAnswer:
    """A grant (`view.prefix_load_grant` set) or a miss (`miss_reason` set)."""

    view: LeaseView | None  # None: missed before any lease was opened
    miss_reason: str  # "" for a grant; a metric label value otherwise
    miss_detail: str
    reuse: ReuseStatus


@dataclass(frozen=True, slots=True)
class DrainResult:
    child_engine_ids: tuple[str, ...]
    leases_remaining: int
    safe_to_stop: bool


@dataclass(frozen=True, slots=True)
class HolderCandidate:
    child_engine_id: str
    matched_blocks: int


class HolderFinder(Protocol):
    """Ranked holders of the longest prefix of `chain` in the scope (the inventory's lookup)."""

    def __call__(
        self,
        *,
        requester_child_engine_id: str,
        compatibility_hash: str,
        group_idx: int,
        chain: Sequence[BlockHash],
        min_blocks: int,
        now_ms: int,
        leases_in_flight: Mapping[str, int],
    ) -> Sequence[HolderCandidate]: ...


def _no_holders(**_: object) -> Sequence[HolderCandidate]:
    return ()


SendToPart = Callable[[str, RankKey, LeaseOutbound], bool]


def grid_keys(view: ChildEngineView) -> tuple[RankKey, ...]:
    """Every rank part of the child engine's tp x pp x pcp grid."""
    return tuple(grid_ranks(view.profile))


class LeaseFacade:
    """Both lease flows over the live service. Also a `PartListener` of the coordinator."""

    def __init__(
        self,
        *,
        registry: Registry,
        metrics: Metrics,
        send_to_part: SendToPart,
        reuse_for: Callable[[ChildEngineView], ReuseStatus],
        proven_gone: Callable[[str], bool],
        clock_ms: Callable[[], int],
        config: LeaseConfig | None = None,
        table: LeaseTable | None = None,
    ) -> None:
        self.table = table if table is not None else LeaseTable(config)
        self._registry = registry
        self._metrics = metrics
        self._send_to_part = send_to_part
        self._reuse_for = reuse_for
        self._proven_gone = proven_gone
        self._clock_ms = clock_ms
        self.holder_finder: HolderFinder = _no_holders
        self._draining: dict[str, int] = {}  # child engine -> drain deadline (ms)
        self._drain_aborted: set[str] = set()
        self._changed = asyncio.Event()  # replaced on every change: waiters re-check
        self._kick = asyncio.Event()  # a timer may now be due earlier
        self._ticker: asyncio.Task[None] | None = None
        self._closing = False
        self._reported: dict[str, set[RankKey]] = {}  # for byte counting without duplicates
        # Restart recovery (coordinator/core/recovery.py): a status while warming, else None.
        self.warming: Callable[[], ReuseStatus | None] = lambda: None
        # The gauge's children, labelled once (labels() costs µs; _execute runs per step),
        # and the value last set on each, so only changed counts are written.
        self._gauge_children = {
            (flow, state): metrics.leases.labels(flow=flow.value, state=state.name.lower())
            for flow in Flow
            for state in _NON_TERMINAL
        }
        self._gauge_values: dict[tuple[Flow, LeaseState], int] = {}
        self._update_gauge()

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._ticker = asyncio.create_task(self._tick_loop(), name="kvrc-lease-ticker")

    async def shutdown(self) -> None:
        self._closing = True
        if self._ticker is not None:
            self._kick.set()
            # Python 3.11's wait_for may swallow a cancel that races a set event: the flag ends it.
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
            self._ticker = None
        self._notify()  # waiting RPCs re-check and answer with what they have

    # --- reads -----------------------------------------------------------------------

    @property
    def heartbeat_interval_ms(self) -> int:
        """How often a decode engine extends its handoff lease (three tries per timeout)."""
        return max(self.table.config.handoff_heartbeat_timeout_ms // 3, 1)

    def leases_in_flight(self) -> dict[str, int]:
        """Open leases per child engine, as source or target (for lookup ranking)."""
        return self.table.open_counts_by_engine()

    def open_leases(self) -> list[LeaseView]:
        """In flight and quarantined, oldest first (for `kvrc status`)."""
        return sorted(self.table.list_leases(), key=lambda v: (v.created_ms, v.lease_id))

    def is_draining(self, child_engine_id: str) -> bool:
        return child_engine_id in self._draining

    # --- prefix load -------------------------------------------------------------------

    async def request_prefix_load(self, req: PrefixLoadRequest) -> PrefixLoadAnswer:
        now = self._clock_ms()
        requester = self._registry.get(req.requester_child_engine_id)
        existing = self.table.find_prefix_load(req.requester_child_engine_id, req.request_id)
        if existing is None:
            if requester is None:
                raise failed_precondition(
                    f"requester {req.requester_child_engine_id!r} is not registered: "
                    "register its rank parts before asking for a prefix load"
                )
            reuse = self._reuse_for(requester)
            if not reuse.enabled:
                raise failed_precondition(
                    f"reuse is not enabled for {req.requester_child_engine_id!r}: {reuse.detail}"
                )
            warming = self.warming()
            if warming is not None:
                raise failed_precondition(f"prefix loads wait for warm-up: {warming.detail}")
            if not requester.ready:
                raise failed_precondition(
                    f"requester {req.requester_child_engine_id!r} is not READY: "
                    f"{requester.not_ready_reason}"
                )
            self._check_not_draining(req.requester_child_engine_id, "requester")
            if req.compatibility_hash and req.compatibility_hash != requester.compatibility_hash:
                raise failed_precondition(
                    f"compatibility_hash {req.compatibility_hash!r} is not the requester's own "
                    f"({requester.compatibility_hash!r}): engines with different layouts "
                    "never exchange KV"
                )
            pin_timeout = req.pin_timeout_ms or DEFAULT_PIN_TIMEOUT_MS
            ttl = req.transfer_timeout_ms or DEFAULT_TRANSFER_TIMEOUT_MS
            holder = self._choose_holder(req, requester, now)
            if isinstance(holder, str):
                self._metrics.prefix_load_misses.labels(reason=holder).inc()
                return PrefixLoadAnswer(None, holder, _NO_HOLDER_DETAIL[holder], reuse)
            step = self.table.open_prefix_load(
                request_id=req.request_id,
                requester_child_engine_id=req.requester_child_engine_id,
                requester_rank_keys=grid_keys(requester),
                holder_child_engine_id=holder.child_engine_id,
                holder_rank_keys=grid_keys(holder),
                block_hashes=req.block_hashes,  # the holder pins what it still has
                min_blocks=req.min_blocks,
                pin_timeout_ms=pin_timeout,
                transfer_ttl_ms=ttl,
                now_ms=now,
                group_idx=req.group_idx,
            )
            self._execute(step.actions)
            lease_id = step.view.lease_id
        else:
            # The core checks that the repeat names the same chain (holder arguments unused).
            step = self.table.open_prefix_load(
                request_id=req.request_id,
                requester_child_engine_id=req.requester_child_engine_id,
                requester_rank_keys=(),
                holder_child_engine_id=existing.source_child_engine_id,
                holder_rank_keys=(),
                block_hashes=req.block_hashes,
                min_blocks=req.min_blocks,
                pin_timeout_ms=1,
                transfer_ttl_ms=1,
                now_ms=now,
                group_idx=req.group_idx,
            )
            lease_id = step.view.lease_id
            reuse = (
                self._reuse_for(requester)
                if requester is not None
                else ReuseStatus(
                    False, ReuseReason.REQUESTER_UNKNOWN, "requester is not registered"
                )
            )
        view = await self._wait_while_pinning(lease_id)
        if view.state is LeaseState.PINNING:  # only when shutting down
            raise KvrcError(ErrorCode.UNAVAILABLE, "the coordinator is shutting down")
        if view.prefix_load_grant is not None:
            return PrefixLoadAnswer(view, "", "", reuse)
        reason = view.miss_reason.value if view.miss_reason is not None else "holder_gone"
        return PrefixLoadAnswer(view, reason, view.reason, reuse)

    def _choose_holder(
        self, req: PrefixLoadRequest, requester: ChildEngineView, now: int
    ) -> ChildEngineView | str:
        min_blocks = max(req.min_blocks, 1)
        candidates = self.holder_finder(
            requester_child_engine_id=req.requester_child_engine_id,
            compatibility_hash=requester.compatibility_hash,
            group_idx=req.group_idx,
            chain=req.block_hashes,
            min_blocks=min_blocks,
            now_ms=now,
            leases_in_flight=self.leases_in_flight(),
        )
        best = 0
        for candidate in candidates:
            best = max(best, candidate.matched_blocks)
            if candidate.child_engine_id == req.requester_child_engine_id:
                continue
            if candidate.matched_blocks < min_blocks or self.is_draining(candidate.child_engine_id):
                continue
            view = self._registry.get(candidate.child_engine_id)
            if view is None or not view.ready:
                continue
            if view.compatibility_hash != requester.compatibility_hash:
                continue  # never hand KV across layouts, whatever the finder said
            return view
        return "below_min_blocks" if 0 < best < min_blocks else "no_candidate"

    def complete_prefix_load(self, report: TransferReport) -> LeaseView:
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
            log.info(
                "holder %s rank %s answered lease %s with %d block(s): %s",
                holder_child_engine_id,
                rank_key,
                lease_id,
                pinned_blocks,
                error_message,
            )
        self._session_step(
            "PinResult",
            lambda now: (
                self.table.on_pin_result(
                    lease_id,
                    holder_child_engine_id,
                    rank_key,
                    pinned_blocks,
                    descriptor if pinned_blocks > 0 else None,
                    now,
                ).actions
            ),
        )

    # --- decode handoff ------------------------------------------------------------------

    def publish_handoff(self, req: PublishHandoffRequest) -> tuple[LeaseView, int, int]:
        """Returns (view, parts reported, parts expected)."""
        now = self._clock_ms()
        prefill = self._ready_engine(req.prefill_child_engine_id, "prefill")
        if self.table.find_handoff(req.prefill_child_engine_id, req.request_id) is None:
            self._check_not_draining(req.prefill_child_engine_id, "prefill")
        published = self.table.publish_handoff(
            request_id=req.request_id,
            prefill_child_engine_id=req.prefill_child_engine_id,
            prefill_rank_keys=grid_keys(prefill),
            rank_key=req.rank_key,
            descriptor=req.descriptor,
            kv_transfer_params=req.kv_transfer_params,
            decode_child_engine_id=req.decode_child_engine_id,
            num_blocks=req.num_blocks,
            now_ms=now,
        )
        self._execute(published.actions)
        return published.view, published.parts_reported, published.parts_expected

    async def begin_handoff(self, req: BeginHandoffRequest) -> HandoffGrant:
        """Waits up to `wait_timeout_ms` for READY (DEADLINE_EXCEEDED after), then grants."""
        started = self._clock_ms()
        deadline = started + req.wait_timeout_ms
        waited = False
        try:
            while True:
                decode = self._ready_engine(req.decode_child_engine_id, "decode")
                existing = self.table.find_handoff(req.prefill_child_engine_id, req.request_id)
                if existing is None or existing.target_child_engine_id is None:
                    self._check_not_draining(req.decode_child_engine_id, "decode")
                changed = self._changed
                try:
                    step = self.table.begin_handoff(
                        request_id=req.request_id,
                        prefill_child_engine_id=req.prefill_child_engine_id,
                        decode_child_engine_id=req.decode_child_engine_id,
                        decode_rank_keys=grid_keys(decode),
                        now_ms=self._clock_ms(),
                    )
                except KvrcError as e:
                    waitable = e.code is ErrorCode.NOT_FOUND or (
                        e.code is ErrorCode.FAILED_PRECONDITION
                        and existing is not None
                        and existing.state is LeaseState.WAITING_READY
                    )
                    remaining = deadline - self._clock_ms()
                    if not waitable or req.wait_timeout_ms == 0:
                        raise
                    if remaining <= 0 or self._closing:
                        raise KvrcError(
                            ErrorCode.DEADLINE_EXCEEDED,
                            f"handoff for request {req.request_id!r} of "
                            f"{req.prefill_child_engine_id!r} was not READY within "
                            f"{req.wait_timeout_ms} ms: {e.message}",
                        ) from None
                    waited = True
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), remaining / 1000)
                    continue
                self._execute(step.actions)
                grant = step.view.handoff_grant
                assert grant is not None
                return grant
        finally:
            if waited:
                self._metrics.handoff_wait.observe((self._clock_ms() - started) / 1000)

    def extend_handoff(self, lease_id: str, decode_child_engine_id: str) -> int:
        deadline = self.table.extend_handoff(lease_id, decode_child_engine_id, self._clock_ms())
        self._kick.set()
        return deadline

    def complete_handoff(self, report: TransferReport) -> LeaseView:
        return self._complete(report, Flow.HANDOFF)

    # --- both flows ----------------------------------------------------------------------

    def on_abort_ack(self, child_engine_id: str, rank_key: RankKey, lease_id: str) -> None:
        self._session_step(
            "AbortAck",
            lambda now: self.table.on_abort_ack(lease_id, child_engine_id, rank_key, now).actions,
        )

    def recover_held(
        self, child_engine_id: str, rank_key: RankKey, lease_ids: Iterable[str]
    ) -> None:
        """A registering part's `held_lease_ids`: leases it still holds pins for (restart recovery).

        Unknown ones are rebuilt QUARANTINED (coordinator/core/leases.py `recover_held`); a bad
        or foreign id is logged, counted when foreign, and skipped: the session goes on.
        """
        keys = self._grid_of(child_engine_id)
        if not keys:
            return
        for lease_id in lease_ids:
            try:
                step = self.table.recover_held(
                    lease_id=lease_id,
                    holder_child_engine_id=child_engine_id,
                    holder_rank_keys=keys,
                    rank_key=rank_key,
                    now_ms=self._clock_ms(),
                )
            except KvrcError as e:
                if e.code is ErrorCode.PERMISSION_DENIED:
                    self._metrics.auth_denied.labels(reason="foreign_lease").inc()
                log.warning("held lease %r of %s not recovered: %s", lease_id, child_engine_id, e)
                continue
            if step.actions:
                log.warning(
                    "lease %s re-announced by %s rank %s: %s",
                    lease_id,
                    child_engine_id,
                    rank_key,
                    step.view.state.name,
                )
            self._execute(step.actions)

    def _grid_of(self, child_engine_id: str) -> tuple[RankKey, ...]:
        view = self._registry.get(child_engine_id)
        return grid_keys(view) if view is not None else ()

    def on_release_ack(self, child_engine_id: str, rank_key: RankKey, lease_id: str) -> None:
        # The release already ended the lease (fail closed is on the holder's side now).
        log.debug(
            "release of lease %s acknowledged by %s rank %s", lease_id, child_engine_id, rank_key
        )

    def resolve_quarantine(self, lease_id: str, operator_note: str) -> LeaseView:
        step = self.table.resolve_quarantine(lease_id, self._clock_ms())
        log.warning(
            "quarantine of %s lease %s resolved by an operator: %s",
            step.view.flow.value,
            lease_id,
            operator_note or "(no note)",
        )
        self._execute(step.actions)
        return step.view

    # --- drain ---------------------------------------------------------------------------

    async def drain(self, target: str, timeout_ms: int, wait: bool) -> DrainResult:
        """Stops new grants from/to the engine(s); aborts what runs past the deadline."""
        children = self._drain_targets(target)
        now = self._clock_ms()
        timeout = timeout_ms or DEFAULT_DRAIN_TIMEOUT_MS
        for child in children:
            if child not in self._draining:
                self._draining[child] = now + timeout
                log.info("draining %s: deadline in %d ms", child, timeout)
                view = self._registry.get(child)
                if view is not None:
                    for part in view.parts:
                        self._send(child, part.registration.rank, DrainNotice(child, now + timeout))
        self._kick.set()
        if wait:
            until = max(self._draining[c] for c in children) + DRAIN_ACK_GRACE_MS
            while self._remaining(children) and not self._closing:
                changed = self._changed
                left = until - self._clock_ms()
                if left <= 0:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, 1000) / 1000)
        remaining = self._remaining(children)
        return DrainResult(tuple(children), remaining, remaining == 0)

    def _drain_targets(self, target: str) -> list[str]:
        if self._registry.get(target) is not None or target in self._draining:
            return [target]
        children = sorted(
            {v.child_engine_id for v in self._registry.views() if v.engine_id == target}
        )
        if not children:
            raise not_found(f"no child engine or engine named {target!r} is registered")
        return children

    def _remaining(self, children: Iterable[str]) -> int:
        return len({v.lease_id for c in children for v in self.table.leases_of(c)})

    # --- part listener -------------------------------------------------------------------

    def on_part_removed(self, child_engine_id: str, rank: RankKey, reason: str) -> None:
        self._notify()  # a waiter for READY engines re-checks

    def on_part_gone(self, child_engine_id: str, rank: RankKey, session_id: str) -> None:
        if not self._proven_gone(child_engine_id):
            return  # some part is back or still in its grace period
        actions = self.table.on_engine_gone(child_engine_id, self._clock_ms())
        if actions:
            log.info("child engine %s is gone: %d lease action(s)", child_engine_id, len(actions))
        self._draining.pop(child_engine_id, None)
        self._drain_aborted.discard(child_engine_id)
        self._execute(actions)

    # --- internals -----------------------------------------------------------------------

    def _ready_engine(self, child_engine_id: str, role: str) -> ChildEngineView:
        view = self._registry.get(child_engine_id)
        if view is None:
            raise failed_precondition(f"{role} child engine {child_engine_id!r} is not registered")
        if not view.ready:
            raise failed_precondition(
                f"{role} child engine {child_engine_id!r} is not READY: {view.not_ready_reason}"
            )
        return view

    def _check_not_draining(self, child_engine_id: str, role: str) -> None:
        if child_engine_id in self._draining:
            raise failed_precondition(
                f"{role} child engine {child_engine_id!r} is draining: no new grants from or to it"
            )

    def _complete(self, report: TransferReport, flow: Flow) -> LeaseView:
        now = self._clock_ms()
        try:
            before = self.table.get(report.lease_id)
        except KvrcError as e:
            if e.code is ErrorCode.NOT_FOUND and self.warming() is not None:
                # After a restart the holder may not have re-announced it yet.
                raise KvrcError(
                    ErrorCode.UNAVAILABLE,
                    f"{e.message}; the coordinator restarted and is warming: retry the report",
                ) from None
            raise
        call = (  # NOT_FOUND for a lease of the other flow
            self.table.complete_prefix_load
            if flow is Flow.PREFIX_LOAD
            else self.table.complete_handoff
        )
        step = call(
            report.lease_id,
            report.reporter_child_engine_id,
            report.rank_key,
            report.outcome,
            now,
            reporter_rank_keys=self._grid_of(report.reporter_child_engine_id),
        )
        if not before.terminal:
            seen = self._reported.setdefault(report.lease_id, set())
            if report.rank_key not in seen:
                seen.add(report.rank_key)
                self._metrics.transfer_reports.labels(
                    flow=flow.value, outcome=report.outcome.name.lower()
                ).inc()
                self._metrics.transfer_bytes.labels(flow=flow.value).inc(report.bytes_moved)
        self._execute(step.actions)
        return step.view

    def _session_step(self, what: str, call: Callable[[int], Sequence[Action]]) -> None:
        """A session message about a lease: stale ones (ended, purged, foreign) are logged."""
        try:
            actions = call(self._clock_ms())
        except KvrcError as e:
            if e.code is ErrorCode.INVALID_ARGUMENT:
                raise  # malformed: the session ends with the status
            if e.code is ErrorCode.PERMISSION_DENIED:
                self._metrics.auth_denied.labels(reason="foreign_lease").inc()
            log.warning("%s ignored: %s: %s", what, e.code.value, e.message)
            return
        self._execute(actions)

    def _send(self, child_engine_id: str, rank: RankKey, message: LeaseOutbound) -> None:
        if not self._send_to_part(child_engine_id, rank, message):
            log.info(
                "%s for %s rank %s not sent: the part has no session",
                type(message).__name__,
                child_engine_id,
                rank,
            )

    def _execute(self, actions: Sequence[Action]) -> None:
        m = self._metrics
        for action in actions:
            if isinstance(action, SendPin | SendRelease | SendAbort | SendQuarantine):
                self._send(action.child_engine_id, action.rank_key, action)
            elif isinstance(action, LeaseGranted):
                m.lease_grant_duration.labels(flow=action.flow.value).observe(
                    action.grant_latency_ms / 1000
                )
            elif isinstance(action, LeaseMissed):
                m.prefix_load_misses.labels(reason=action.reason.value).inc()
            elif isinstance(action, LeaseAborting):
                m.lease_aborts.labels(flow=action.flow.value).inc()
                log.info(
                    "aborting %s lease %s: %s", action.flow.value, action.lease_id, action.reason
                )
            elif isinstance(action, LeaseQuarantined):
                m.lease_quarantines.labels(flow=action.flow.value).inc()
                log.warning(
                    "%s lease %s quarantined: %s", action.flow.value, action.lease_id, action.reason
                )
            elif isinstance(action, LeaseEnded):
                m.leases_ended.labels(flow=action.flow.value, state=action.state.name.lower()).inc()
                if action.quiescence_ms is not None:
                    m.lease_quiescence_duration.labels(flow=action.flow.value).observe(
                        action.quiescence_ms / 1000
                    )
                self._reported.pop(action.lease_id, None)
            elif isinstance(action, HandoffReady):
                pass  # waiters wake below
        self._update_gauge()
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self._kick.set()

    async def _wait_while_pinning(self, lease_id: str) -> LeaseView:
        while True:
            changed = self._changed
            view = self.table.get(lease_id)
            if view.state is not LeaseState.PINNING or self._closing:
                return view
            # The ticker ends PINNING at the pin deadline; wake a little after it anyway.
            due = view.deadline_ms
            timeout_s = _MAX_TICK_S if due is None else max(due - self._clock_ms() + 50, 10) / 1000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), timeout_s)
            if due is not None and self._clock_ms() >= due:
                self._tick()

    def _update_gauge(self) -> None:
        counts = self.table.counts()
        last = self._gauge_values
        for key, child in self._gauge_children.items():
            value = counts.get(key, 0)
            if last.get(key) != value:
                child.set(value)
                last[key] = value

    def _tick(self) -> None:
        now = self._clock_ms()
        actions = self.table.tick(now)
        for child, deadline in sorted(self._draining.items()):
            if deadline <= now and child not in self._drain_aborted:
                self._drain_aborted.add(child)
                log.info("drain deadline of %s passed: aborting its leases", child)
                actions.extend(self.table.abort_engine(child, now))
        if actions:
            self._execute(actions)

    def _next_due_ms(self) -> int | None:
        due = self.table.next_deadline_ms()
        for child, deadline in self._draining.items():
            if child not in self._drain_aborted:
                due = deadline if due is None else min(due, deadline)
        return due

    async def _tick_loop(self) -> None:
        while not self._closing:
            try:
                self._tick()
            except Exception:  # the ticker must outlive any one bad step
                log.exception("lease ticker pass failed")
            self._kick.clear()
            due = self._next_due_ms()
            sleep_s = _MAX_TICK_S
            if due is not None:
                sleep_s = min(max(due - self._clock_ms(), 0) / 1000, _MAX_TICK_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._kick.wait(), sleep_s)


_NO_HOLDER_DETAIL = {
    "no_candidate": "no ready, compatible engine retains the first block of this chain",
    "below_min_blocks": "the longest retained prefix is shorter than min_blocks",
}
