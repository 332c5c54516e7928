"""Both lease flows as the service runs them: one call per request or message.

`Grants` owns the lease table (core/leases.py) and the drain state, and reads
the registry, the inventory and the reuse policy. Each request of an engine
(a prefix-load request, a pin result, a handoff publication or begin, a
transfer report, ...) is one method call here that returns everything the
runtime must do (`actions`) and, where the request can be answered at once,
the answer. The runtime never asks twice: an answer that has to wait (a
prefix load waiting for its pins, a handoff begin waiting for READY) arrives
later as an action of the call that settles it (`PrefixLoadAnswered`,
`HandoffBegun`, `HandoffBeginFailed`).

Pure and synchronous like the rest of the core: no I/O, no clock (`now_ms` is
an argument, on the runtime's monotonic clock).

I6-quiescence: `on_engine_gone` may be called only once the runtime has proven
the child engine gone (no part registered, none inside its grace period).

I9-cost-gate: `Grants` owns the cost model (core/cost_model.py). A holder is asked
to pin only when loading its prefix is predicted to beat recomputing it, the lease
carries the smallest pin still worth loading, every grant carries its prediction,
and each completed load feeds its measured bytes and duration back (one sample per
lease: the bytes of all rank parts, the slowest part's duration).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, replace

from coordinator.core.cost_model import MAX_BLOCK_BYTES, CostModel, LoadPlan, Prediction
from coordinator.core.errors import (
    ErrorCode,
    KvrcError,
    failed_precondition,
    not_found,
    resource_exhausted,
)
from coordinator.core.inventory import MAX_CANDIDATES, Inventory, Scope
from coordinator.core.leases import (
    DEADLINE_PASSED,
    Action,
    Flow,
    HandoffGrant,
    LeaseAborting,
    LeaseEnded,
    LeaseQuarantined,
    LeaseState,
    LeaseStep,
    LeaseTable,
    LeaseView,
    MissReason,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
)
from coordinator.core.profiles import ReuseReason, ReuseStatus
from coordinator.core.registry import ChildEngineView, Registry, grid_ranks
from kvrc.vocabulary import RETRY_AT_THE_NEXT_COORDINATOR, BlockHash, RankKey, Tier

# Defaults for requests that leave a duration at 0.
DEFAULT_PIN_TIMEOUT_MS = 2_000
DEFAULT_TRANSFER_TIMEOUT_MS = 30_000
DEFAULT_DRAIN_TIMEOUT_MS = 60_000
MAX_HANDOFF_WAIT_MS = 600_000
# BeginHandoff calls waiting for READY at once, over all decode engines (I8-bad-input):
# each is an open call and a heap entry; past it a begin is RESOURCE_EXHAUSTED.
MAX_WAITING_BEGINS = 16_384
# Of those, one decode engine's: a quarter, so one engine cannot take the shared bound
# from the others (as many as its open leases may be, LeaseConfig.max_open_leases_per_engine).
MAX_WAITING_BEGINS_PER_ENGINE = MAX_WAITING_BEGINS // 4
MAX_DRAIN_TIMEOUT_MS = 3_600_000


# --- requests, as the gRPC edge decodes and validates them ----------------------------


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
    # The requester holds the chain's first local_blocks and moves only the rest: the
    # cost gate prices the rest (I9-cost-gate). 0: the whole chain.
    local_blocks: int = 0


@dataclass(frozen=True, slots=True)
class TransferReport:
    lease_id: str
    reporter_child_engine_id: str
    rank_key: RankKey
    outcome: Outcome
    bytes_moved: int
    duration_us: int
    error_message: str
    # A prefill rate sample of the reporter (tokens, duration); 0, 0 = not measured.
    prefill_tokens: int = 0
    prefill_duration_us: int = 0


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


# --- answers and the actions of this layer ----------------------------------------------


@dataclass(frozen=True, slots=True)
class PrefixLoadAnswer:
    """A grant (`view.prefix_load_grant` set) or a miss (`miss_reason` set)."""

    view: LeaseView | None  # None: missed before any lease was opened
    miss_reason: str  # "" for a grant; a metric label value otherwise
    miss_detail: str
    reuse: ReuseStatus
    # I9-cost-gate: a grant's prediction for what it grants; a recompute_cheaper
    # miss's for the best holder it refused. None: no holder got that far.
    prediction: Prediction | None = None


@dataclass(frozen=True, slots=True)
class DrainResult:
    child_engine_ids: tuple[str, ...]
    leases_remaining: int
    safe_to_stop: bool


@dataclass(frozen=True, slots=True)
class DrainNotice:
    """Sent to every part of a draining child engine (a session message)."""

    child_engine_id: str
    rank_key: RankKey
    deadline_ms: int


@dataclass(frozen=True, slots=True)
class PrefixLoadAnswered:
    """A prefix load left PINNING: the waiting request can be answered."""

    lease_id: str
    answer: PrefixLoadAnswer


@dataclass(frozen=True, slots=True)
class HandoffBegun:
    """A waiting BeginHandoff (its `token`) got its grant."""

    token: int
    grant: HandoffGrant


@dataclass(frozen=True, slots=True)
class HandoffBeginFailed:
    """A waiting BeginHandoff ends with this error (the handoff failed, or never got READY)."""

    token: int
    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class DrainDeadlinePassed:
    child_engine_id: str


@dataclass(frozen=True, slots=True)
class DrainingChanged:
    """Child engines drained here, now (a drain began, or a drained engine left):
    `kvrc_child_engines{state="draining"}`."""

    draining: int


@dataclass(frozen=True, slots=True)
class CostObserved:
    """A completed prefix load's predicted and measured transfer (the error histogram)."""

    lease_id: str
    predicted_load_ms: float
    actual_load_ms: float
    # "measured": the prediction came from the link's fresh fit; else its prior alone:
    # "declared", "stale", "reverse" or "default" (LinkEstimate.prior).
    link_basis: str
    probe: bool = False  # a probe of a cold link (I9-cost-gate)


# The session messages of the lease flows (the rank part's session delivers them).
LeaseOutbound = SendPin | SendRelease | SendAbort | SendQuarantine | DrainNotice

GrantAction = (
    Action
    | DrainNotice
    | PrefixLoadAnswered
    | HandoffBegun
    | HandoffBeginFailed
    | DrainDeadlinePassed
    | DrainingChanged
    | CostObserved
)


@dataclass(frozen=True, slots=True)
class PrefixLoadStep:
    """`answer` is set when the request is answered now; else wait for `lease_id`'s answer."""

    lease_id: str | None
    answer: PrefixLoadAnswer | None
    actions: tuple[GrantAction, ...]


@dataclass(frozen=True, slots=True)
class BeginStep:
    """`grant` now, or `token` to wait on (HandoffBegun / HandoffBeginFailed)."""

    grant: HandoffGrant | None
    token: int | None
    actions: tuple[GrantAction, ...]


@dataclass(frozen=True, slots=True)
class PublishStep:
    view: LeaseView
    parts_reported: int
    parts_expected: int
    actions: tuple[GrantAction, ...]


@dataclass(frozen=True, slots=True)
class ReportStep:
    view: LeaseView
    first_report: bool  # this rank part's first report of a lease still open (count it)
    actions: tuple[GrantAction, ...]


@dataclass(frozen=True, slots=True)
class DrainStep:
    child_engine_ids: tuple[str, ...]
    actions: tuple[GrantAction, ...]


def _most_bytes(prediction: Prediction, context: _CostContext | None) -> int:
    """The most a load's reports may claim to have moved: what its grant asked to move,
    or, from a holder of unknown block size, MAX_BLOCK_BYTES a block."""
    if prediction.num_bytes > 0 or context is None or context.block_size <= 0:
        return prediction.num_bytes
    return prediction.num_tokens // context.block_size * MAX_BLOCK_BYTES


@dataclass(frozen=True, slots=True)
class _CostContext:
    """What a prefix-load lease's predictions need (kept while the lease is open)."""

    holder: str
    requester: str
    tier: Tier
    bytes_per_block: int
    block_size: int
    worthwhile_blocks: int = 1  # the fewest blocks worth loading, as of the request
    requested_ms: int | None = None  # when it was asked for: the grant's prediction is as of then
    have: int = 0  # the chain's first blocks the requester holds: not moved, not priced
    plan: LoadPlan | None = None  # its reach, pricing and stand-in (None: not planned)

    @property
    def probe_blocks(self) -> int:
        """> 0: a probe of a cold link, the holder asked for this many."""
        return self.plan.ceiling if self.plan is not None and self.plan.probe else 0


@dataclass
class _Measured:
    """A prefix load's reports so far: all parts' bytes, the slowest part's duration."""

    bytes_moved: int = 0
    duration_us: int = 0
    succeeded: int = 0
    # The longest a part ran before it reported FAILED on its own (0: none, or none
    # measured): a lower bound on the load's time (`_learn_failed`).
    failed_us: int = 0


@dataclass
class _PendingBegin:
    token: int
    request: BeginHandoffRequest
    deadline_ms: int
    last_error: str


_NO_HOLDER_DETAIL = {
    "no_candidate": "no ready, compatible engine retains the first block of this chain",
    "below_min_blocks": "the longest retained prefix is shorter than min_blocks",
    "recompute_cheaper": "recomputing is predicted to be cheaper than loading from any holder",
}

_NOT_REGISTERED = ReuseStatus(False, ReuseReason.REQUESTER_UNKNOWN, "requester is not registered")


def grid_keys(view: ChildEngineView) -> tuple[RankKey, ...]:
    """Every rank part of the child engine's tp x pp x pcp grid."""
    return tuple(grid_ranks(view.profile))


def check_own_compatibility(asked: str, own: str) -> None:
    """A requester asks for its own compatibility ("" = its own): FAILED_PRECONDITION
    otherwise, naming both (Lookup and RequestPrefixLoad alike)."""
    if asked and asked != own:
        raise failed_precondition(
            f"compatibility_hash {asked!r} is not the requester's own ({own!r}): engines "
            "with different layouts never exchange KV"
        )


class Grants:
    """Both lease flows over the registry, the inventory and the lease table."""

    def __init__(
        self,
        *,
        table: LeaseTable,
        registry: Registry,
        inventory: Inventory,
        reuse_for: Callable[[ChildEngineView], ReuseStatus],
        cost: CostModel | None = None,
    ) -> None:
        self.table = table
        self._registry = registry
        self._inventory = inventory
        self._reuse_for = reuse_for
        # I9-cost-gate: load or recompute, from measured cost (core/cost_model.py).
        self.cost = cost if cost is not None else CostModel()
        self._cost_ctx: dict[str, _CostContext] = {}  # per open prefix-load lease
        self._predictions: dict[str, Prediction] = {}  # per open lease, once answered
        self._measured: dict[str, _Measured] = {}
        self._aborted: dict[str, str] = {}  # open leases kvrc aborted, and why
        # Links whose last load(s) failed slow (`_learn_failed`), and how many in a row
        # (at most max_pairs).
        self._failed_in_a_row: OrderedDict[tuple[str, str, Tier], int] = OrderedDict()
        self._draining: dict[str, int] = {}  # child engine -> drain deadline (ms)
        self._drain_aborted: set[str] = set()
        self._pinning: set[str] = set()  # prefix loads whose answer someone waits for
        self._reported: dict[str, set[RankKey]] = {}  # reports counted, per open lease
        self._begins: dict[tuple[str, str], list[_PendingBegin]] = {}  # (prefill, request)
        self._begin_deadlines: list[tuple[int, int, tuple[str, str]]] = []
        # The waiting begins' tokens, each with its key: a heap entry is live when its
        # token is here (entries of begins settled early are dropped lazily, bounded).
        self._begin_keys: dict[int, tuple[str, str]] = {}
        self._waiting_by_decode: dict[str, int] = {}  # waiting begins per decode engine
        # Per decode engine, the keys its waiting begins wait on (with how many): a part
        # leaving retries its own, not a scan of every waiting begin.
        self._begins_by_decode: dict[str, dict[tuple[str, str], int]] = {}
        self._tokens = itertools.count(1)
        # When `tick` next has work, as of the last call (the runtime arms one timer at it).
        self.due_ms: int | None = None

    # --- reads ---------------------------------------------------------------------------

    def is_draining(self, child_engine_id: str) -> bool:
        return child_engine_id in self._draining

    def may_lend(self, holder_child_engine_id: str, compatibility_hash: str) -> bool:
        """May a prefix load of a requester of `compatibility_hash` be asked of this
        holder: registered, READY, not draining, and of the same compatibility (never
        hand KV across layouts, whatever the index said). Grants and Score ask it."""
        if holder_child_engine_id in self._draining:
            return False
        view = self._registry.get(holder_child_engine_id)
        return view is not None and view.ready and view.compatibility_hash == compatibility_hash

    def leases_remaining(self, child_engine_ids: Iterable[str]) -> int:
        return len({v.lease_id for c in child_engine_ids for v in self.table.leases_of(c)})

    def _next_deadline_ms(self) -> int | None:
        due = self.table.next_deadline_ms()
        for child, deadline in self._draining.items():
            if child not in self._drain_aborted:
                due = deadline if due is None else min(due, deadline)
        while self._begin_deadlines and not self._begin_live(self._begin_deadlines[0]):
            heapq.heappop(self._begin_deadlines)
        if self._begin_deadlines:
            first = self._begin_deadlines[0][0]
            due = first if due is None else min(due, first)
        return due

    # --- prefix load ---------------------------------------------------------------------

    def request_prefix_load(
        self, req: PrefixLoadRequest, now_ms: int, warming: ReuseStatus | None
    ) -> PrefixLoadStep:
        """Opens the lease and asks the holder's parts to pin (or misses at once).

        A repeat of an open request returns that lease; one whose answer is known
        answers at once, except a grant that ended (FAILED_PRECONDITION: its pins
        are released). FAILED_PRECONDITION (nothing changed) when the requester
        may not load now, with the reason.
        """
        requester = self._registry.get(req.requester_child_engine_id)
        existing = self.table.find_prefix_load(req.requester_child_engine_id, req.request_id)
        if existing is not None and existing.terminal and existing.prefix_load_grant is not None:
            # I6-quiescence: its pins are released; handing out its blocks again would send
            # a read to blocks the holder may already have reused.
            raise failed_precondition(
                f"request {req.request_id!r} of {req.requester_child_engine_id!r} already "
                f"loaded through lease {existing.lease_id!r}, which ended "
                f"({existing.state.name}) and released its pins: a new load needs a new "
                "request id"
            )
        if existing is not None:
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
                now_ms=now_ms,
                group_idx=req.group_idx,
            )
            reuse = self._reuse_for(requester) if requester is not None else _NOT_REGISTERED
            view = step.view
            if view.state is LeaseState.PINNING:
                self._pinning.add(view.lease_id)
                return PrefixLoadStep(view.lease_id, None, self._settled(()))
            return PrefixLoadStep(view.lease_id, self._answer_of(view, reuse), self._settled(()))
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
        if warming is not None:
            raise failed_precondition(f"prefix loads wait for warm-up: {warming.detail}")
        if not requester.ready:
            raise failed_precondition(
                f"requester {req.requester_child_engine_id!r} is not READY: "
                f"{requester.not_ready_reason}"
            )
        self._check_not_draining(req.requester_child_engine_id, "requester")
        check_own_compatibility(req.compatibility_hash, requester.compatibility_hash)
        choice = self._choose_holder(req, requester, now_ms)
        if not isinstance(choice, tuple):
            detail = _NO_HOLDER_DETAIL[choice.reason]
            if choice.refused is not None:
                detail = f"{detail}: best {choice.refused.describe()}"
            return PrefixLoadStep(
                None, PrefixLoadAnswer(None, choice.reason, detail, reuse, choice.refused), ()
            )
        holder, context, worthwhile, ceiling = choice
        step = self.table.open_prefix_load(
            request_id=req.request_id,
            requester_child_engine_id=req.requester_child_engine_id,
            requester_rank_keys=grid_keys(requester),
            holder_child_engine_id=holder.child_engine_id,
            holder_rank_keys=grid_keys(holder),
            block_hashes=req.block_hashes,  # the holder pins what it still has
            min_blocks=req.min_blocks,
            pin_timeout_ms=req.pin_timeout_ms or DEFAULT_PIN_TIMEOUT_MS,
            transfer_ttl_ms=req.transfer_timeout_ms or DEFAULT_TRANSFER_TIMEOUT_MS,
            now_ms=now_ms,
            group_idx=req.group_idx,
            worthwhile_blocks=worthwhile,
            pin_blocks=context.probe_blocks,
        )
        lease_id = step.view.lease_id
        self._cost_ctx[lease_id] = context
        # An unmeasured link's open loads bound its next predictions (I9-cost-gate).
        self.cost.load_started(
            lease_id,
            context.holder,
            context.requester,
            context.tier,
            max(ceiling - context.have, 0) * context.bytes_per_block,  # what moves
            now_ms,
            context.plan.stand_in if context.plan is not None else None,
        )
        if step.view.state is LeaseState.PINNING:
            self._pinning.add(lease_id)
            return PrefixLoadStep(lease_id, None, self._settled(step.actions))
        return PrefixLoadStep(
            lease_id, self._answer_of(step.view, reuse), self._settled(step.actions)
        )

    def _predict(self, context: _CostContext, blocks: int, now_ms: int | None = None) -> Prediction:
        """Loading the chain's first `blocks`, of which only those past `have` move."""
        moved = max(blocks - context.have, 0)
        return self.cost.predict(
            context.holder,
            context.requester,
            context.tier,
            moved * context.block_size,
            moved * context.bytes_per_block,
            now_ms,
            link=context.plan.link if context.plan is not None else None,
        )

    def _cost_context(
        self, holder: ChildEngineView, requester: ChildEngineView, tier: Tier, now_ms: int
    ) -> _CostContext:
        return _CostContext(
            holder.child_engine_id,
            requester.child_engine_id,
            tier,
            self.cost.block_bytes(holder.child_engine_id, holder.kv_bytes_per_block(), now_ms),
            requester.profile.block_size,
        )

    def _choose_holder(
        self, req: PrefixLoadRequest, requester: ChildEngineView, now_ms: int
    ) -> tuple[ChildEngineView, _CostContext, int, int] | _NoHolder:
        """The holder to ask, its cost context, the fewest blocks worth loading from it
        and the most it may load (the blocks it was hinted to hold, or a probe's worth)."""
        min_blocks = max(req.min_blocks, 1)
        # min_blocks 1: "below min_blocks" is told apart from "no candidate" here.
        answer = self._inventory.lookup(
            Scope(requester.compatibility_hash, req.group_idx),
            req.block_hashes,
            now_ms=now_ms,
            min_blocks=1,
            exclude_child_engine_id=req.requester_child_engine_id,
            max_candidates=MAX_CANDIDATES,
            leases_in_flight=self.table.open_counts_by_engine(),
        )
        best = 0
        refused: Prediction | None = None
        for candidate in answer.candidates:
            best = max(best, candidate.matched_blocks)
            if (
                candidate.matched_blocks < min_blocks
                # No more than the requester holds itself: nothing to move (and a
                # "recompute cheaper" of 0 tokens would be no reason).
                or candidate.matched_blocks <= req.local_blocks
                or not self.may_lend(candidate.child_engine_id, requester.compatibility_hash)
            ):
                continue
            view = self._registry.get(candidate.child_engine_id)
            assert view is not None  # may_lend: registered
            context = replace(
                self._cost_context(view, requester, candidate.tier, now_ms),
                have=req.local_blocks,
            )
            # I9-cost-gate: a link without a fresh fit or a declaration is probed, not
            # trusted (a stand-in may spare the probe, never forbid it).
            plan, worthwhile = self.cost.grantable(
                context.holder,
                context.requester,
                context.tier,
                min_blocks,
                candidate.matched_blocks,
                block_tokens=context.block_size,
                bytes_per_block=context.bytes_per_block,
                have=context.have,
                now_ms=now_ms,
            )
            ceiling = plan.ceiling
            context = replace(context, plan=plan)
            if worthwhile is None:
                # I9-cost-gate: this holder's link is too slow; another may still pay off.
                prediction = self._predict(context, ceiling, now_ms)
                if refused is None or prediction.saving_ms > refused.saving_ms:
                    refused = prediction
                continue
            context = replace(context, worthwhile_blocks=worthwhile, requested_ms=now_ms)
            return view, context, worthwhile, ceiling
        if refused is not None:
            return _NoHolder(MissReason.RECOMPUTE_CHEAPER.value, refused)
        return _NoHolder("below_min_blocks" if 0 < best < min_blocks else "no_candidate", None)

    def on_pin_result(
        self,
        holder_child_engine_id: str,
        rank_key: RankKey,
        lease_id: str,
        pinned_blocks: int,
        descriptor: bytes | None,
        now_ms: int,
    ) -> tuple[GrantAction, ...]:
        """A holder part's PinResult (KvrcError for a stale or foreign one; nothing changes)."""
        step = self.table.on_pin_result(
            lease_id,
            holder_child_engine_id,
            rank_key,
            pinned_blocks,
            descriptor if pinned_blocks > 0 else None,
            now_ms,
        )
        return self._settled(step.actions)

    def refuse_by_store(self, lease_id: str, now_ms: int) -> tuple[GrantAction, ...]:
        """The shared store did not record the lease: it misses, its pins never asked."""
        return self._settled(self.table.refuse_by_store(lease_id, now_ms).actions)

    def complete(
        self, report: TransferReport, flow: Flow, now_ms: int, warming: ReuseStatus | None
    ) -> ReportStep:
        """A target part's terminal outcome (NOT_FOUND for a lease of the other flow)."""
        try:
            before = self.table.get(report.lease_id)
        except KvrcError as e:
            if e.code is ErrorCode.NOT_FOUND and warming is not None:
                # After a restart the holder may not have re-announced it yet.
                raise KvrcError(
                    ErrorCode.UNAVAILABLE,
                    f"{e.message}; the coordinator restarted and is warming: retry the report",
                ) from None
            raise
        call = (
            self.table.complete_prefix_load
            if flow is Flow.PREFIX_LOAD
            else self.table.complete_handoff
        )
        step = call(
            report.lease_id,
            report.reporter_child_engine_id,
            report.rank_key,
            report.outcome,
            now_ms,
            reporter_rank_keys=self._grid_of(report.reporter_child_engine_id),
        )
        first = False
        if not before.terminal:
            seen = self._reported.setdefault(report.lease_id, set())
            if report.rank_key not in seen:
                seen.add(report.rank_key)
                first = True
        actions: list[GrantAction] = list(step.actions)
        if flow is Flow.PREFIX_LOAD and first:
            if len(self._reported[report.lease_id]) == 1:
                # The table checked that the reporter is this lease's requester, so a rate
                # sample is only ever the reporter's own; one per load, as its parts
                # prefill the same tokens side by side (per part, tp=8 weighed 8 samples).
                self.cost.observe_prefill(
                    report.reporter_child_engine_id,
                    report.prefill_tokens,
                    report.prefill_duration_us,
                    now_ms,
                )
            self._measure(report, actions, now_ms)
        return ReportStep(step.view, first, self._settled(actions))

    def _measure(self, report: TransferReport, actions: list[GrantAction], now_ms: int) -> None:
        """Adds one part's first report; at COMPLETED the whole load is one sample."""
        measured = self._measured.setdefault(report.lease_id, _Measured())
        context = self._cost_ctx.get(report.lease_id)
        prediction = self._predictions.get(report.lease_id)
        # A report cannot move more than the load asked for, nor take longer than since
        # it was asked for: one absurd report would otherwise steer the fit for many
        # loads (I9-cost-gate).
        duration_us = report.duration_us
        if context is not None and context.requested_ms is not None:
            duration_us = min(duration_us, max(now_ms - context.requested_ms, 0) * 1000)
        if report.outcome is Outcome.SUCCEEDED:
            measured.bytes_moved += report.bytes_moved
            if prediction is not None:
                measured.bytes_moved = min(measured.bytes_moved, _most_bytes(prediction, context))
            measured.duration_us = max(measured.duration_us, duration_us)
            measured.succeeded += 1
        elif report.outcome is Outcome.FAILED and report.lease_id not in self._aborted:
            # The requester gave up on its own (its transfer timeout, an error): the load
            # took at least this long. A part told to stop by kvrc ran as long as kvrc
            # let it, which says nothing about the link.
            measured.failed_us = max(measured.failed_us, duration_us)
        ended = any(
            isinstance(a, LeaseEnded)
            and a.lease_id == report.lease_id
            and a.state is LeaseState.COMPLETED
            for a in actions
        )
        if not ended or context is None or measured.duration_us <= 0:
            return
        # One sample per load: its parts pull in parallel, so the slowest one is the load.
        if prediction is not None:
            actions.append(
                CostObserved(
                    report.lease_id,
                    prediction.load_ms,
                    measured.duration_us / 1000.0,
                    "measured" if prediction.link.samples > 0 else prediction.link.prior,
                    context.probe_blocks > 0,
                )
            )
        self._failed_in_a_row.pop((context.holder, context.requester, context.tier), None)
        if context.bytes_per_block <= 0 and prediction is not None:
            # A holder of unknown block size: this load sizes its blocks (I9-cost-gate).
            moved_blocks = prediction.num_tokens // max(context.block_size, 1)
            self.cost.observe_block_bytes(
                context.holder, measured.bytes_moved, moved_blocks, now_ms
            )
        self.cost.observe_transfer(
            context.holder,
            context.requester,
            context.tier,
            measured.bytes_moved,
            measured.duration_us,
            now_ms,
            report.lease_id,
        )

    def _learn_failed(self, ended: LeaseEnded) -> None:
        """A granted prefix load that failed slow, twice in a row over one link: it
        moved its bytes no faster than it ran (a censored sample). It ran from its grant
        to its end when kvrc aborted it at its transfer deadline, else at least as long
        as a part that reported FAILED on its own said (its transfer timeout, shorter
        than kvrc's deadline, fired). Without it a link whose loads always time out was
        granted on its prior for ever (I9-cost-gate). One such failure alone (a
        hiccup), one no slower than predicted, one without a duration, one kvrc aborted
        for another reason, and one whose holder is gone or not ready when it ends (a
        holder killed) say nothing about the link's speed: with the fit's weight on each
        sample, one such sample would refuse the pair until the fit expires."""
        if ended.state is not LeaseState.FAILED:
            return
        context = self._cost_ctx.get(ended.lease_id)
        prediction = self._predictions.get(ended.lease_id)
        if context is None or prediction is None or prediction.num_bytes <= 0:
            return
        reason = self._aborted.get(ended.lease_id)
        measured = self._measured.get(ended.lease_id)
        if reason == DEADLINE_PASSED and ended.quiescence_ms is not None:
            ran_us = ended.quiescence_ms * 1000
        elif reason is None and measured is not None and measured.failed_us > 0:
            ran_us = max(measured.failed_us, measured.duration_us)  # the slowest part
        else:
            return
        holder = self._registry.get(context.holder)
        if ran_us <= prediction.load_ms * 1000 or holder is None or not holder.ready:
            return
        link = (context.holder, context.requester, context.tier)
        in_a_row = self._failed_in_a_row.pop(link, 0) + 1
        if in_a_row < 2:
            self._failed_in_a_row[link] = in_a_row
            while len(self._failed_in_a_row) > self.cost.config.max_pairs:
                self._failed_in_a_row.popitem(last=False)
            return
        self.cost.observe_transfer(
            context.holder,
            context.requester,
            context.tier,
            prediction.num_bytes,
            ran_us,
            ended.ended_ms,
            ended.lease_id,
        )

    def predict_load(
        self,
        holder_child_engine_id: str,
        requester_child_engine_id: str,
        tier: Tier,
        num_blocks: int,
        now_ms: int,
    ) -> Prediction | None:
        """Loading `num_blocks` from the holder against recomputing them (read-only), as
        of `now_ms` (a fit or a prefill rate past its TTL no longer counts as measured).

        The bytes come from the holder's registered regions (or profile), the tokens from
        the requester's block size, as for a grant. None: either engine is not registered.
        """
        holder = self._registry.get(holder_child_engine_id)
        requester = self._registry.get(requester_child_engine_id)
        if holder is None or requester is None:
            return None
        context = self._cost_context(holder, requester, tier, now_ms)
        return self._predict(context, num_blocks, now_ms)

    def cost_decision(self, lease_id: str) -> Prediction | None:
        """The prediction an open prefix-load lease was granted with (for `kvrc status`)."""
        return self._predictions.get(lease_id)

    # --- decode handoff ------------------------------------------------------------------

    def publish_handoff(self, req: PublishHandoffRequest, now_ms: int) -> PublishStep:
        repeat = self.table.repeated_publish(
            request_id=req.request_id,
            prefill_child_engine_id=req.prefill_child_engine_id,
            rank_key=req.rank_key,
            descriptor=req.descriptor,
            kv_transfer_params=req.kv_transfer_params,
            decode_child_engine_id=req.decode_child_engine_id,
            num_blocks=req.num_blocks,
        )
        if repeat is not None:  # answered even while the prefill is not READY
            return PublishStep(repeat.view, repeat.parts_reported, repeat.parts_expected, ())
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
            now_ms=now_ms,
        )
        actions: list[GrantAction] = list(published.actions)
        self._retry_begins((req.prefill_child_engine_id, req.request_id), now_ms, actions)
        return PublishStep(
            published.view,
            published.parts_reported,
            published.parts_expected,
            self._settled(actions),
        )

    def begin_handoff(self, req: BeginHandoffRequest, now_ms: int) -> BeginStep:
        """The grant when READY; else (with a wait) a token that a later call settles."""
        try:
            step = self._try_begin(req, now_ms)
        except KvrcError as e:
            if not self._waitable(req, e):
                raise
            if len(self._begin_keys) >= MAX_WAITING_BEGINS:
                raise resource_exhausted(
                    f"{MAX_WAITING_BEGINS} BeginHandoff calls are waiting already: retry "
                    "later, or begin with wait_timeout_ms 0 once the handoff is READY"
                ) from None
            decode = req.decode_child_engine_id
            waiting = self._waiting_by_decode.get(decode, 0)
            if waiting >= MAX_WAITING_BEGINS_PER_ENGINE:
                raise resource_exhausted(
                    f"decode engine {decode!r} has {waiting} BeginHandoff calls waiting "
                    f"already, the per-engine limit: retry later, or begin with "
                    "wait_timeout_ms 0 once the handoff is READY"
                ) from None
            self._waiting_by_decode[decode] = waiting + 1
            token = next(self._tokens)
            key = (req.prefill_child_engine_id, req.request_id)
            pending = _PendingBegin(token, req, now_ms + req.wait_timeout_ms, e.message)
            self._begins.setdefault(key, []).append(pending)
            by_key = self._begins_by_decode.setdefault(decode, {})
            by_key[key] = by_key.get(key, 0) + 1
            self._begin_keys[token] = key
            heapq.heappush(self._begin_deadlines, (pending.deadline_ms, token, key))
            return BeginStep(None, token, self._settled(()))
        grant = step.view.handoff_grant
        assert grant is not None
        return BeginStep(grant, None, self._settled(step.actions))

    def cancel_begin(self, token: int) -> None:
        """The waiting caller went away: its begin must never be granted."""
        key = self._begin_keys.get(token)
        if key is None:
            return
        pending = next(p for p in self._begins[key] if p.token == token)
        self._drop_begin(key, pending)

    def _drop_begin(self, key: tuple[str, str], pending: _PendingBegin) -> None:
        """A waiting begin is settled (granted, failed, expired or cancelled)."""
        waiting = self._begins[key]
        waiting.remove(pending)
        if not waiting:
            del self._begins[key]
        del self._begin_keys[pending.token]
        decode = pending.request.decode_child_engine_id
        left = self._waiting_by_decode[decode] - 1
        if left:
            self._waiting_by_decode[decode] = left
        else:
            del self._waiting_by_decode[decode]
        by_key = self._begins_by_decode[decode]
        if by_key[key] > 1:
            by_key[key] -= 1
        else:
            del by_key[key]
            if not by_key:
                del self._begins_by_decode[decode]
        # Settled begins leave their deadline in the heap until it comes up; a live wait
        # with an earlier deadline keeps them there. Compacted when they outnumber the
        # live ones, so the heap stays O(waiting begins) (amortised O(log n) a begin).
        heap = self._begin_deadlines
        if len(heap) > 2 * len(self._begin_keys) + 64:
            self._begin_deadlines = [e for e in heap if e[1] in self._begin_keys]
            heapq.heapify(self._begin_deadlines)

    def _try_begin(self, req: BeginHandoffRequest, now_ms: int) -> LeaseStep:
        decode = self._ready_engine(req.decode_child_engine_id, "decode")
        existing = self.table.find_handoff(req.prefill_child_engine_id, req.request_id)
        if existing is None or existing.target_child_engine_id is None:
            self._check_not_draining(req.decode_child_engine_id, "decode")
        return self.table.begin_handoff(
            request_id=req.request_id,
            prefill_child_engine_id=req.prefill_child_engine_id,
            decode_child_engine_id=req.decode_child_engine_id,
            decode_rank_keys=grid_keys(decode),
            now_ms=now_ms,
        )

    def _waitable(self, req: BeginHandoffRequest, e: KvrcError) -> bool:
        """Not published yet, or published and waiting for its last prefill parts."""
        if req.wait_timeout_ms == 0:
            return False
        if e.code is ErrorCode.NOT_FOUND:
            return True
        existing = self.table.find_handoff(req.prefill_child_engine_id, req.request_id)
        return (
            e.code is ErrorCode.FAILED_PRECONDITION
            and existing is not None
            and existing.state is LeaseState.WAITING_READY
        )

    def _retry_begins(self, key: tuple[str, str], now_ms: int, actions: list[GrantAction]) -> None:
        waiting = self._begins.get(key)
        if not waiting:
            return
        for pending in list(waiting):
            try:
                step = self._try_begin(pending.request, now_ms)
            except KvrcError as e:
                if self._waitable(pending.request, e):
                    pending.last_error = e.message
                    continue
                actions.append(HandoffBeginFailed(pending.token, e.code, e.message))
            else:
                grant = step.view.handoff_grant
                assert grant is not None
                actions.extend(step.actions)
                actions.append(HandoffBegun(pending.token, grant))
            self._drop_begin(key, pending)

    def _expire_begins(self, now_ms: int, actions: list[GrantAction]) -> None:
        while self._begin_deadlines and self._begin_deadlines[0][0] <= now_ms:
            entry = heapq.heappop(self._begin_deadlines)
            if not self._begin_live(entry):
                continue
            _, token, key = entry
            pending = next(p for p in self._begins[key] if p.token == token)
            self._drop_begin(key, pending)
            req = pending.request
            actions.append(
                HandoffBeginFailed(
                    token,
                    ErrorCode.DEADLINE_EXCEEDED,
                    f"handoff for request {req.request_id!r} of {req.prefill_child_engine_id!r} "
                    f"was not READY within {req.wait_timeout_ms} ms: {pending.last_error}",
                )
            )

    def _begin_live(self, entry: tuple[int, int, tuple[str, str]]) -> bool:
        return entry[1] in self._begin_keys

    def fail_all_begins(self) -> tuple[GrantAction, ...]:
        """Shutting down: every waiting begin ends UNAVAILABLE, as a waiting prefix load
        does: its wait has not run out, and a client retries UNAVAILABLE at the next
        coordinator (DEADLINE_EXCEEDED would make the decode give the handoff up)."""
        actions: list[GrantAction] = []
        for waiting in self._begins.values():
            for pending in waiting:
                req = pending.request
                actions.append(
                    HandoffBeginFailed(
                        pending.token,
                        ErrorCode.UNAVAILABLE,
                        f"{RETRY_AT_THE_NEXT_COORDINATOR} (handoff "
                        f"for request {req.request_id!r} of {req.prefill_child_engine_id!r} "
                        f"was not READY yet: {pending.last_error})",
                    )
                )
        self._begins.clear()
        self._begins_by_decode.clear()
        self._begin_keys.clear()
        self._waiting_by_decode.clear()
        self._begin_deadlines.clear()
        return self._settled(actions)

    def extend_handoff(self, lease_id: str, decode_child_engine_id: str, now_ms: int) -> int:
        deadline = self.table.extend_handoff(lease_id, decode_child_engine_id, now_ms)
        self._settled(())
        return deadline

    # --- both flows ----------------------------------------------------------------------

    def on_abort_ack(
        self, child_engine_id: str, rank_key: RankKey, lease_id: str, now_ms: int
    ) -> tuple[GrantAction, ...]:
        step = self.table.on_abort_ack(lease_id, child_engine_id, rank_key, now_ms)
        return self._settled(step.actions)

    def resolve_quarantine(
        self, lease_id: str, now_ms: int
    ) -> tuple[LeaseView, tuple[GrantAction, ...]]:
        step = self.table.resolve_quarantine(lease_id, now_ms)
        return step.view, self._settled(step.actions)

    def recover_held(
        self,
        child_engine_id: str,
        rank_key: RankKey,
        lease_id: str,
        now_ms: int,
        requester_child_engine_id: str = "",
    ) -> tuple[LeaseView, tuple[GrantAction, ...]]:
        """One re-announced held lease (restart recovery), with the requester its holder
        names ("" = unknown); KvrcError when refused."""
        keys = self._grid_of(child_engine_id)
        if not keys:
            raise not_found(f"{child_engine_id!r} is not registered")
        step = self.table.recover_held(
            lease_id=lease_id,
            holder_child_engine_id=child_engine_id,
            holder_rank_keys=keys,
            rank_key=rank_key,
            now_ms=now_ms,
            requester_child_engine_id=requester_child_engine_id,
        )
        return step.view, self._settled(step.actions)

    def on_part_registered(
        self, child_engine_id: str, rank_key: RankKey, announced: Collection[str] = ()
    ) -> tuple[GrantAction, ...]:
        """A rank part (re-)registered: the aborts it still owes an ack for, and the
        quarantines of leases it may hold but did not just re-announce, sent again."""
        table = self.table
        again = table.resend_owed_aborts(child_engine_id, rank_key)
        told = table.resend_quarantines(child_engine_id, rank_key, announced)
        return self._settled(again + told)

    def tick(self, now_ms: int) -> tuple[GrantAction, ...]:
        """Fires due lease timers, drain deadlines and begin waits."""
        actions: list[GrantAction] = list(self.table.tick(now_ms))
        for child, deadline in sorted(self._draining.items()):
            if deadline <= now_ms and child not in self._drain_aborted:
                self._drain_aborted.add(child)
                actions.append(DrainDeadlinePassed(child))
                actions.extend(self.table.abort_engine(child, now_ms))
        self._retry_ended_begins(now_ms, actions)
        self._expire_begins(now_ms, actions)
        return self._settled(actions)

    def on_engine_gone(self, child_engine_id: str, now_ms: int) -> tuple[GrantAction, ...]:
        """The child engine is proven gone (I6-quiescence): its leases may end without reports."""
        actions: list[GrantAction] = list(self.table.on_engine_gone(child_engine_id, now_ms))
        if self._draining.pop(child_engine_id, None) is not None:
            actions.append(DrainingChanged(len(self._draining)))
        self._drain_aborted.discard(child_engine_id)
        self._retry_ended_begins(now_ms, actions)
        return self._settled(actions)

    def on_part_removed(self, child_engine_id: str, now_ms: int) -> tuple[GrantAction, ...]:
        """A part left: begins waiting for this decode engine fail, as they would on a retry.
        O(its own waiting begins): they are kept per decode engine."""
        actions: list[GrantAction] = []
        for key in list(self._begins_by_decode.get(child_engine_id, ())):
            self._retry_begins(key, now_ms, actions)
        return self._settled(actions)

    def _retry_ended_begins(self, now_ms: int, actions: list[GrantAction]) -> None:
        """Begins waiting on a handoff that ended among `actions` fail now, not at their
        deadline (a handoff leaves WAITING_READY for READY only in a publish, which
        retries its own). O(handoffs ended), never a scan of every waiting begin."""
        for action in list(actions):
            if isinstance(action, LeaseEnded) and action.flow is Flow.HANDOFF:
                key = (action.child_engine_ids[0], action.request_id)
                if key in self._begins:
                    self._retry_begins(key, now_ms, actions)

    # --- drain ---------------------------------------------------------------------------

    def drain(self, target: str, timeout_ms: int, now_ms: int) -> DrainStep:
        """Stops new grants from/to the engine(s); the deadline aborts what still runs."""
        children = self._drain_targets(target)
        timeout = timeout_ms or DEFAULT_DRAIN_TIMEOUT_MS
        actions: list[GrantAction] = []
        for child in children:
            deadline = now_ms + timeout
            running = self._draining.get(child)
            if running is not None and running <= deadline:
                continue  # already draining, to an earlier deadline: it stands
            # A new drain, or one asked again with a shorter timeout: the earlier
            # deadline wins (an operator who shortens it gets the answer in time).
            if running is None:
                actions.append(DrainingChanged(len(self._draining) + 1))
            self._draining[child] = deadline
            view = self._registry.get(child)
            if view is not None:
                for part in view.parts:
                    actions.append(DrainNotice(child, part.registration.rank, deadline))
        return DrainStep(tuple(children), self._settled(actions))

    def drain_deadline_ms(self, child_engine_ids: Iterable[str]) -> int:
        return max(self._draining[c] for c in child_engine_ids)

    def _drain_targets(self, target: str) -> list[str]:
        if self._registry.get(target) is not None or target in self._draining:
            return [target]
        children = sorted(
            {v.child_engine_id for v in self._registry.views() if v.engine_id == target}
        )
        if not children:
            raise not_found(f"no child engine or engine named {target!r} is registered")
        return children

    # --- internals -----------------------------------------------------------------------

    def _settled(self, actions: Sequence[GrantAction]) -> tuple[GrantAction, ...]:
        """Adds the answers of waiting prefix loads that these actions settled."""
        out = list(actions)
        if self._pinning:
            for lease_id in {getattr(a, "lease_id", None) for a in actions}:
                if lease_id is None or lease_id not in self._pinning:
                    continue
                view = self.table.get(lease_id)
                if view.state is LeaseState.PINNING:
                    continue
                self._pinning.discard(lease_id)
                requester = view.target_child_engine_id
                req_view = self._registry.get(requester) if requester is not None else None
                reuse = self._reuse_for(req_view) if req_view is not None else _NOT_REGISTERED
                out.append(PrefixLoadAnswered(lease_id, self._answer_of(view, reuse)))
        for action in actions:
            if isinstance(action, LeaseAborting):
                self._aborted.setdefault(action.lease_id, action.reason)  # the first reason
            elif isinstance(action, LeaseQuarantined):
                # Its read hangs: it no longer bounds the link's next predictions (that
                # bound shrinks for ever, and would refuse even a probe until the
                # quarantine ends); its end teaches the link instead (`_learn_failed`).
                self.cost.load_ended(action.lease_id)
            elif isinstance(action, LeaseEnded):
                self._learn_failed(action)
                self._aborted.pop(action.lease_id, None)
                self._reported.pop(action.lease_id, None)
                self._cost_ctx.pop(action.lease_id, None)
                self.cost.load_ended(action.lease_id)
                self._predictions.pop(action.lease_id, None)
                self._measured.pop(action.lease_id, None)
        self.due_ms = self._next_deadline_ms()
        return tuple(out)

    def _grid_of(self, child_engine_id: str) -> tuple[RankKey, ...]:
        view = self._registry.get(child_engine_id)
        return grid_keys(view) if view is not None else ()

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

    def _answer_of(self, view: LeaseView, reuse: ReuseStatus) -> PrefixLoadAnswer:
        """The answer of a lease that left PINNING, with its prediction (I9-cost-gate)."""
        context = self._cost_ctx.get(view.lease_id)
        grant = view.prefix_load_grant
        if grant is not None:
            prediction = self._predictions.get(view.lease_id)
            if prediction is None and context is not None:
                prediction = self._predict(context, grant.matched_blocks, context.requested_ms)
                if not view.terminal:
                    self._predictions[view.lease_id] = prediction
            return PrefixLoadAnswer(view, "", "", reuse, prediction)
        reason = view.miss_reason.value if view.miss_reason is not None else "holder_gone"
        if view.miss_reason is MissReason.RECOMPUTE_CHEAPER and context is not None:
            detail = (
                f"the holder pinned fewer than the {context.worthwhile_blocks} blocks a load "
                f"needs to beat recomputing ({context.holder}->{context.requester} "
                f"{context.tier.name.lower()})"
            )
            return PrefixLoadAnswer(view, reason, detail, reuse)
        return PrefixLoadAnswer(view, reason, view.reason, reuse)


@dataclass(frozen=True, slots=True)
class _NoHolder:
    reason: str  # a miss reason (metric label)
    refused: Prediction | None  # recompute_cheaper: the best holder's prediction
