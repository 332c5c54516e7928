"""The hypothesis state machine that drives both lease state machines at once.

Run on the pure core by tests/core/test_leases_stateful.py, and with every step also
written to the lease ledger in a real Redis by tests/runtime/test_lease_ledger_redis.py.

The machine plays holders, requesters, prefill and decode engines: random
orders of pins (full, partial, zero), publications, begins, heartbeats,
reports (duplicates, UNKNOWN, foreign reporters), deadlines, aborts and their
acknowledgements, drains, peer deaths and restarts, re-requests with the same
request id, and operator resolutions. It keeps its own record of what the
core told it to send, and checks after every step:

- no release before quiescence (every target part reported or acknowledged an
  abort), proven death of the target, or an operator's resolution; never a
  release while an UNKNOWN outcome stands unproven (a part that reported UNKNOWN
  proves its reads quiet only by acknowledging an abort sent to it);
- a release at most once per source part, and only to parts that were asked
  to pin (prefix load) or that published (handoff); to a source declared gone
  only for a lease nothing was read from (its pins, if it is alive after all);
- a source part that re-announces a lease gets its release again once it was
  decided, and a target part that re-registers is asked again only for the
  abort acks it still owes;
- no lease serves both flows (its flow never changes; the other flow's
  methods do not know it);
- every lease ends in exactly one terminal state, announced once, and never
  leaves it;
- when time runs far enough, every pin and every publication has been
  released, quarantined, or died with its engine.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import RankKey
from coordinator.core.leases import (
    TERMINAL_STATES,
    Action,
    Flow,
    LeaseConfig,
    LeaseEnded,
    LeaseGranted,
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
from kvrc.ids import parse_child_engine_id

ENGINES: dict[str, tuple[RankKey, ...]] = {
    "e0": ((0, 0, 0),),
    "e1_dp0": ((0, 0, 0), (1, 0, 0)),
    "e1_dp1": ((0, 0, 0), (0, 1, 0)),
    "e2": ((0, 0, 0), (1, 0, 0), (0, 0, 1)),
}
NAMES = sorted(ENGINES)
CHAIN = tuple(bytes([i]) * 4 for i in range(6))
PARAMS = (b"params-a", b"params-b")
REQUEST_IDS = ("r0", "r1", "r2", "r3")
CONFIG = LeaseConfig(
    max_open_leases=12,
    max_open_leases_per_engine=6,
    max_open_leases_per_dp_engine=8,  # e1_dp0 and e1_dp1 together: reached now and then
    max_payload_bytes_per_engine=32,  # a whole chain (24 bytes) and a bit: reached now and then
    abort_timeout_ms=1_000,
    handoff_heartbeat_timeout_ms=1_500,
    handoff_publish_timeout_ms=3_000,
    handoff_ready_max_wait_ms=3_000,
    terminal_retention_ms=10**12,  # keep ended leases: the model inspects them
)
PIN_TIMEOUT_MS = 1_500
TTL_MS = 4_000
FAR_MS = 10**7

engine_names = st.sampled_from(NAMES)
indexes = st.integers(min_value=0, max_value=63)
mostly_succeeded = st.sampled_from([Outcome.SUCCEEDED] * 6 + [Outcome.FAILED, Outcome.UNKNOWN])
sometimes = st.sampled_from([False, False, False, True])


def pick(seq: Sequence[str], index: int) -> str:
    return seq[index % len(seq)]


def pick_rank(seq: Sequence[RankKey], index: int) -> RankKey:
    return seq[index % len(seq)]


def pick_key(seq: Sequence[tuple[str, RankKey]], index: int) -> tuple[str, RankKey]:
    return seq[index % len(seq)]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ids_issued = 0  # the next lease id is f"L{ids_issued}"

        def new_id() -> str:
            self.ids_issued += 1
            return f"L{self.ids_issued - 1}"

        self.table = LeaseTable(CONFIG, id_factory=new_id)
        # What the kvrc_leases gauge shows: only the changed counts are ever read.
        self.gauge: dict[tuple[Flow, LeaseState], int] = {}
        self.now = 1_000_000
        self.alive = set(NAMES)
        self.gone_at: dict[str, int] = {}  # engine -> step of its last proven death
        self.step_no = 0
        self.flow: dict[str, Flow] = {}
        self.source: dict[str, str] = {}
        self.target: dict[str, str] = {}
        self.target_parts: dict[str, tuple[RankKey, ...]] = {}
        self.granted: set[str] = set()
        self.settled: dict[str, set[RankKey]] = {}
        self.unknown: dict[str, set[RankKey]] = {}  # lease -> parts that reported UNKNOWN
        self.abort_sent: set[tuple[str, RankKey]] = set()
        self.proven: set[tuple[str, RankKey]] = set()  # acked an abort sent to it
        self.holding: dict[tuple[str, RankKey], int] = {}  # (lease, source part) -> step
        self.zero_pins: set[tuple[str, RankKey]] = set()
        self.releases: Counter[tuple[str, str, RankKey]] = Counter()
        self.quarantined: set[str] = set()
        self.ended: dict[str, LeaseState] = {}
        self.handoff_params: dict[tuple[str, str], tuple[bytes, int, str | None]] = {}
        self.chain_len: dict[str, int] = {}
        self.answered: dict[str, set[RankKey]] = {}
        self.reported: dict[tuple[str, RankKey], Outcome] = {}
        # Target parts still prove their reads quiet (a report, an ack) after a lease stopped
        # running: quarantined, or ended by its source's death mid-read (`source_died`),
        # unless the core stopped waiting for proofs (`proofs_closed`: nobody left to ask).
        self.source_died: set[str] = set()
        self.proofs_closed: set[str] = set()
        # ACTIVE leases whose target was proven gone with reads unsettled: released at
        # their deadline (its reads may land until then), unless the target re-registers.
        self.deferred: set[str] = set()
        self.deadline_at_gone: dict[str, int] = {}

    # ---------------------------------------------------------------- helpers

    def leases(self, flow: Flow | None = None) -> list[str]:
        return sorted(lid for lid, f in self.flow.items() if flow is None or f is flow)

    def choose(self, leases: Sequence[str], index: int, anywhere: bool, *states: LeaseState) -> str:
        """Mostly a lease in one of `states` (so flows progress), sometimes any."""
        preferred = [lid for lid in leases if self.view(lid).state in states]
        return pick(preferred if preferred and not anywhere else leases, index)

    @staticmethod
    def unsettled(
        parts: Sequence[RankKey], done: set[RankKey], anywhere: bool
    ) -> Sequence[RankKey]:
        """Mostly a part that has not spoken yet; sometimes any (duplicates)."""
        fresh = [k for k in parts if k not in done]
        return fresh if fresh and not anywhere else parts

    def view(self, lease_id: str) -> LeaseView:
        return self.table.get(lease_id)

    def snapshot(self) -> object:
        t = self.table
        return (t.list_leases(include_terminal=True), t.counts(), t.next_deadline_ms())

    def attempt(self, call: Callable[[], object], *allowed: ErrorCode) -> object | None:
        """Run a core call; an allowed KvrcError must leave the core unchanged."""
        before = self.snapshot()
        try:
            return call()
        except KvrcError as err:
            assert err.code in allowed, err
            assert self.snapshot() == before
            return None

    def apply(
        self,
        actions: Sequence[Action],
        *,
        resolving: str | None = None,
        gone: str | None = None,
    ) -> None:
        """Check and record what the core asks the facade to do."""
        self.step_no += 1
        for action in actions:
            if isinstance(action, SendPin):
                self.holding[(action.lease_id, action.rank_key)] = self.step_no
                assert action.child_engine_id == self.source[action.lease_id]
            elif isinstance(action, SendRelease):
                lid = action.lease_id
                key = (lid, action.child_engine_id, action.rank_key)
                self.releases[key] += 1
                assert self.releases[key] == 1, f"second release of {key}"
                assert action.child_engine_id == self.source[lid]
                assert (lid, action.rank_key) in self.holding, (
                    "release of a part that holds nothing"
                )
                # A source declared gone may be alive (a blip past the grace): its release
                # is decided, but only where nothing was read.
                assert action.child_engine_id != gone or lid not in self.granted, (
                    "release to a dead source of a granted lease"
                )
                self.check_release_allowed(lid, resolving=resolving, gone=gone)
            elif isinstance(action, SendQuarantine):
                assert action.child_engine_id == self.source[action.lease_id]
                assert (action.lease_id, action.rank_key) in self.holding
            elif isinstance(action, SendAbort):
                assert action.child_engine_id == self.target[action.lease_id]
                self.abort_sent.add((action.lease_id, action.rank_key))
            elif isinstance(action, LeaseGranted):
                self.granted.add(action.lease_id)
            elif isinstance(action, LeaseQuarantined):
                self.quarantined.add(action.lease_id)
            elif isinstance(action, LeaseEnded):
                assert action.lease_id not in self.ended, "a lease ended twice"
                assert action.state in TERMINAL_STATES
                assert action.flow is self.flow[action.lease_id]
                self.ended[action.lease_id] = action.state
                event(f"{action.flow.value} ended {action.state.name}")
            if isinstance(action, (SendRelease, SendAbort, SendQuarantine)):
                event(f"sent {type(action).__name__}")

    def check_release_allowed(self, lid: str, *, resolving: str | None, gone: str | None) -> None:
        if resolving == lid:
            return
        unproven = {k for k in self.unknown.get(lid, ()) if (lid, k) not in self.proven}
        assert not unproven, f"released despite an unproven UNKNOWN outcome of {unproven}"
        assert self.view(lid).state is not LeaseState.QUARANTINED
        if lid in self.quarantined and lid in self.granted:
            # Once quarantined, only proofs end it (or an operator): never a death.
            owed = [
                k
                for k in self.target_parts[lid]
                if k not in self.settled[lid] and (lid, k) not in self.proven
            ]
            assert not owed, f"released a quarantine with {owed} never proven quiet"
        if lid not in self.granted:
            return  # nothing was handed to a target: the pins only wait for nobody
        if gone is not None and gone == self.target.get(lid):
            return
        if lid in self.deferred and gone is None and resolving is None:
            # Its target proven gone: released once the lease's deadline (the last its
            # reads had, as extended since) passed, or as any lease, on proofs (below).
            view = self.view(lid)
            if view.state is not LeaseState.ACTIVE and self.now >= self.deadline_at_gone[lid]:
                return
        parts = self.target_parts[lid]
        assert self.settled[lid] >= set(parts), (
            f"release of {lid} before quiescence: settled {self.settled[lid]} of {parts}"
        )

    def register(self, view: LeaseView, target: str | None) -> None:
        lid = view.lease_id
        if lid in self.flow:
            assert self.flow[lid] is view.flow
            return
        self.flow[lid] = view.flow
        self.source[lid] = view.source_child_engine_id
        if target is not None:
            self.target[lid] = target
            self.target_parts[lid] = ENGINES[target]
        self.settled[lid] = set()

    # ----------------------------------------------------------------- rules

    @rule(
        req=indexes,
        hold=indexes,
        request_id=st.sampled_from(REQUEST_IDS),
        length=st.integers(1, len(CHAIN)),
        min_blocks=st.integers(0, 3),
    )
    def open_prefix_load(
        self, req: int, hold: int, request_id: str, length: int, min_blocks: int
    ) -> None:
        alive = sorted(self.alive)
        if len(alive) < 2:
            return
        requester = pick(alive, req)
        holder = pick([e for e in alive if e != requester], hold)
        existing = self.table.find_prefix_load(requester, request_id)
        step = self.attempt(
            lambda: self.table.open_prefix_load(
                request_id=request_id,
                requester_child_engine_id=requester,
                requester_rank_keys=ENGINES[requester],
                holder_child_engine_id=holder,
                holder_rank_keys=ENGINES[holder],
                block_hashes=CHAIN[:length],
                min_blocks=min(min_blocks, length),
                pin_timeout_ms=PIN_TIMEOUT_MS,
                transfer_ttl_ms=TTL_MS,
                now_ms=self.now,
            ),
            ErrorCode.RESOURCE_EXHAUSTED,
            ErrorCode.ALREADY_EXISTS,
        )
        if step is None:
            return
        view = step.view  # type: ignore[attr-defined]
        if existing is not None:
            # Idempotent: the same lease, never re-opened.
            assert view == existing and step.actions == ()  # type: ignore[attr-defined]
            return
        assert view.state is LeaseState.PINNING
        self.register(view, requester)
        self.chain_len[view.lease_id] = length
        self.apply(step.actions)  # type: ignore[attr-defined]

    @rule(
        which=indexes,
        part=indexes,
        short=st.sampled_from([0, 0, 0, 0, 1, 3, 99, -1]),
        desc=st.integers(0, 1),
        anywhere=sometimes,
    )
    def pin_result(self, which: int, part: int, short: int, desc: int, anywhere: bool) -> None:
        loads = self.leases(Flow.PREFIX_LOAD)
        if not loads:
            return
        lid = self.choose(loads, which, anywhere, LeaseState.PINNING)
        holder = self.source[lid]
        parts = self.unsettled(ENGINES[holder], self.answered.setdefault(lid, set()), anywhere)
        chain_len = self.chain_len[lid]
        # Mostly the whole chain; sometimes fewer, zero, or more than the chain.
        pinned = chain_len + 1 if short == -1 else max(chain_len - short, 0)
        self.do_pin(lid, parts[part % len(parts)], pinned, desc)

    def do_pin(self, lid: str, rank: RankKey, pinned: int, desc: int) -> None:
        holder = self.source[lid]
        if holder not in self.alive:
            return
        before = self.view(lid)
        step = self.attempt(
            lambda: self.table.on_pin_result(lid, holder, rank, pinned, ("d", desc), self.now),
            ErrorCode.FAILED_PRECONDITION,  # a changed answer
            ErrorCode.INVALID_ARGUMENT,  # more blocks than the chain
        )
        if step is None:
            return
        assert pinned <= self.chain_len[lid]
        self.answered.setdefault(lid, set()).add(rank)
        if before.state is LeaseState.PINNING and pinned == 0:
            self.zero_pins.add((lid, rank))
        self.apply(step.actions)  # type: ignore[attr-defined]

    @rule(
        which=indexes,
        prefill=indexes,
        part=indexes,
        params=st.integers(0, 1),
        blocks=st.integers(1, 2),
        restrict=st.booleans(),
        dec=indexes,
        request_id=st.sampled_from(REQUEST_IDS),
        fresh=st.booleans(),
        disagree=st.sampled_from([False, False, False, True]),
    )
    def publish(
        self,
        which: int,
        prefill: int,
        part: int,
        params: int,
        blocks: int,
        restrict: bool,
        dec: int,
        request_id: str,
        fresh: bool,
        disagree: bool,
    ) -> None:
        waiting = self.open_leases(Flow.HANDOFF, LeaseState.WAITING_READY)
        decode: str | None
        if waiting and not fresh:
            # Another part of a handoff in progress, mostly agreeing with the first.
            view = self.view(pick(waiting, which))
            pre, request_id = view.source_child_engine_id, view.request_id
            params_bytes, blocks, decode = self.handoff_params[(pre, request_id)]
            if disagree:
                params_bytes += b"-changed"
        else:
            alive = sorted(self.alive)
            if not alive:
                return
            pre = pick(alive, prefill)
            decode = pick([e for e in NAMES if e != pre], dec) if restrict else None
            params_bytes = PARAMS[params]
        grid = ENGINES[pre]
        self.do_publish(pre, request_id, grid[part % len(grid)], params_bytes, blocks, decode)

    def do_publish(
        self,
        pre: str,
        request_id: str,
        rank: RankKey,
        params_bytes: bytes,
        blocks: int,
        decode: str | None,
    ) -> None:
        if pre not in self.alive:
            return
        result = self.attempt(
            lambda: self.table.publish_handoff(
                request_id=request_id,
                prefill_child_engine_id=pre,
                prefill_rank_keys=ENGINES[pre],
                rank_key=rank,
                descriptor=("p", pre, rank),
                kv_transfer_params=params_bytes,
                decode_child_engine_id=decode,
                num_blocks=blocks,
                now_ms=self.now,
            ),
            ErrorCode.FAILED_PRECONDITION,  # disagreeing parts
            ErrorCode.RESOURCE_EXHAUSTED,
        )
        if result is None:
            return
        view = result.view  # type: ignore[attr-defined]
        if view.lease_id not in self.flow:
            self.handoff_params[(pre, request_id)] = (params_bytes, blocks, decode)
        self.register(view, None)
        if view.state not in TERMINAL_STATES:
            self.holding.setdefault((view.lease_id, rank), self.step_no)
        self.apply(result.actions)  # type: ignore[attr-defined]

    @rule(which=indexes, dec=indexes, anywhere=sometimes)
    def begin(self, which: int, dec: int, anywhere: bool) -> None:
        handoffs = self.leases(Flow.HANDOFF)
        alive = sorted(self.alive)
        if not handoffs or not alive:
            return
        lid = self.choose(handoffs, which, anywhere, LeaseState.READY)
        view = self.view(lid)
        reserved = self.handoff_params[(view.source_child_engine_id, view.request_id)][2]
        if anywhere:
            decode = pick(alive, dec)
        elif reserved is not None:
            decode = reserved
        else:
            decode = pick([e for e in alive if e != view.source_child_engine_id] or alive, dec)
        self.do_begin(lid, decode)

    def do_begin(self, lid: str, decode: str) -> None:
        view = self.view(lid)
        reserved = self.handoff_params[(view.source_child_engine_id, view.request_id)][2]
        step = self.attempt(
            lambda: self.table.begin_handoff(
                request_id=view.request_id,
                prefill_child_engine_id=view.source_child_engine_id,
                decode_child_engine_id=decode,
                decode_rank_keys=ENGINES[decode],
                now_ms=self.now,
            ),
            ErrorCode.FAILED_PRECONDITION,
            ErrorCode.PERMISSION_DENIED,
            ErrorCode.INVALID_ARGUMENT,  # decode == prefill
            ErrorCode.RESOURCE_EXHAUSTED,
        )
        if step is None:
            return
        assert view.state in (LeaseState.READY, LeaseState.ACTIVE)
        if view.state is LeaseState.READY:
            assert reserved in (None, decode)
            self.target[lid] = decode
            self.target_parts[lid] = ENGINES[decode]
        assert self.target[lid] == decode
        grant = self.view(lid).handoff_grant
        assert grant is not None
        assert (grant.kv_transfer_params, grant.num_blocks) == self.handoff_params[
            (view.source_child_engine_id, view.request_id)
        ][:2]
        self.apply(step.actions)  # type: ignore[attr-defined]

    @rule(which=indexes)
    def extend(self, which: int) -> None:
        handoffs = [lid for lid in self.leases(Flow.HANDOFF) if lid in self.target]
        if not handoffs:
            return
        lid = self.choose(handoffs, which, False, LeaseState.ACTIVE)
        before = self.view(lid)
        deadline = self.attempt(
            lambda: self.table.extend_handoff(lid, self.target[lid], self.now),
            ErrorCode.FAILED_PRECONDITION,
        )
        if deadline is not None:
            assert before.state is LeaseState.ACTIVE
            assert deadline == self.view(lid).deadline_ms

    @rule(
        which=indexes,
        part=indexes,
        outcome=mostly_succeeded,
        foreign=sometimes,
        anywhere=sometimes,
    )
    def report(
        self, which: int, part: int, outcome: Outcome, foreign: bool, anywhere: bool
    ) -> None:
        granted = sorted(lid for lid in self.target if lid in self.granted)
        if not granted:
            return
        lid = self.choose(granted, which, anywhere, LeaseState.ACTIVE, LeaseState.ABORTING)
        parts = self.unsettled(self.target_parts[lid], self.settled[lid], anywhere)
        self.do_report(lid, parts[part % len(parts)], outcome, foreign)

    def do_report(self, lid: str, rank: RankKey, outcome: Outcome, foreign: bool) -> None:
        # A source part reporting as if it were the target must be refused.
        reporter = self.source[lid] if foreign else self.target[lid]
        complete = (
            self.table.complete_prefix_load
            if self.flow[lid] is Flow.PREFIX_LOAD
            else self.table.complete_handoff
        )
        before = self.view(lid)
        step = self.attempt(
            lambda: complete(lid, reporter, rank, outcome, self.now),
            ErrorCode.FAILED_PRECONDITION,
            ErrorCode.PERMISSION_DENIED,
        )
        if foreign:
            assert step is None, "a source part's report was accepted"
            return
        earlier = self.reported.get((lid, rank))
        if earlier is not None:
            # Same outcome again: a no-op; a different one: refused.
            assert (step is None) == (earlier is not outcome)
        if step is None:
            return
        live = before.state in (LeaseState.ACTIVE, LeaseState.ABORTING)
        # A part that owes a proof (quarantined with its target alive, or its source
        # declared gone mid-read) still reports: SUCCEEDED or FAILED is that proof.
        owes = lid not in self.proofs_closed and (
            before.state is LeaseState.QUARANTINED or lid in self.source_died
        )
        if (live or owes) and rank not in self.settled[lid]:
            self.reported[(lid, rank)] = outcome
            if outcome is Outcome.UNKNOWN:
                self.unknown.setdefault(lid, set()).add(rank)
                if live:
                    self.settled[lid].add(rank)
            else:
                self.settled[lid].add(rank)
        self.apply(step.actions)  # type: ignore[attr-defined]

    @rule(which=indexes, part=indexes, anywhere=sometimes)
    def abort_ack(self, which: int, part: int, anywhere: bool) -> None:
        candidates = sorted(lid for lid in self.target if lid in self.granted)
        if not candidates:
            return
        lid = self.choose(candidates, which, anywhere, LeaseState.ABORTING, LeaseState.QUARANTINED)
        before = self.view(lid)
        if before.state is LeaseState.QUARANTINED and not anywhere:
            # Mostly a part that owes a proof (it was sent an abort).
            owing = [k for k in self.target_parts[lid] if (lid, k) in self.abort_sent]
            parts: Sequence[RankKey] = owing or self.target_parts[lid]
        else:
            parts = self.unsettled(self.target_parts[lid], self.settled[lid], anywhere)
        rank = parts[part % len(parts)]
        step = self.table.on_abort_ack(lid, self.target[lid], rank, self.now)
        if before.state is LeaseState.ABORTING:
            self.settled[lid].add(rank)
        if (lid, rank) in self.abort_sent:
            # An ack to an abort it was sent: its reads are quiet (also a late one).
            self.proven.add((lid, rank))
            self.settled[lid].add(rank)
        self.apply(step.actions)

    @rule(which=engine_names, part=indexes)
    def re_register(self, which: str, part: int) -> None:
        """A target part's session comes back: only the acks it still owes are asked for."""
        if which not in self.alive:
            return
        rank = pick_rank(ENGINES[which], part)
        # Back: a lease held to its deadline for this target is no longer (not gone).
        self.deferred -= {lid for lid, target in self.target.items() if target == which}
        actions = self.table.resend_owed_aborts(which, rank)
        for action in actions:
            assert isinstance(action, SendAbort)
            lid = action.lease_id
            assert (action.child_engine_id, action.rank_key) == (which, rank)
            assert self.target[lid] == which
            assert (lid, rank) in self.abort_sent and (lid, rank) not in self.proven
            assert rank not in self.settled[lid] or rank in self.unknown.get(lid, ())
        if actions:
            event("re-registered target part asked again for an ack")
        self.apply(actions)

    @rule(which=indexes, part=indexes)
    def reannounce(self, which: int, part: int) -> None:
        """A source part re-announces a lease it was asked to pin or published."""
        held = sorted(key for key in self.holding if self.source[key[0]] in self.alive)
        # Mostly one whose source was declared gone while it held (then came back).
        back = [
            key for key in held if self.gone_at.get(self.source[key[0]], -1) >= self.holding[key]
        ]
        if not held:
            return
        lid, rank = pick_key(back if back and which % 4 else held, which * 64 + part)
        source = self.source[lid]
        before = self.view(lid)
        step = self.table.recover_held(
            lease_id=lid,
            holder_child_engine_id=source,
            holder_rank_keys=ENGINES[source],
            rank_key=rank,
            now_ms=self.now,
        )
        assert step.view == before, "a re-announcement changed a lease kvrc knows"
        kinds = [type(a) for a in step.actions]
        if before.state in TERMINAL_STATES:
            # Its release again, once decided (the first may have been lost).
            decided = self.releases[(lid, source, rank)] > 0
            assert kinds == ([SendRelease] if decided else []), (lid, rank, kinds)
            if decided and self.gone_at.get(source, -1) >= self.holding[(lid, rank)]:
                event("re-announced by a source declared gone: released again")
        elif before.state is LeaseState.QUARANTINED:
            assert kinds == [SendQuarantine]
        else:
            assert kinds == []

    @rule(which=indexes, dec=indexes, outcome=mostly_succeeded)
    def progress(self, which: int, dec: int, outcome: Outcome) -> None:
        """The next happy-path step of some open lease, so that flows reach their ends."""
        candidates = [
            lid
            for lid in self.leases()
            if self.view(lid).state
            in (LeaseState.PINNING, LeaseState.WAITING_READY, LeaseState.READY, LeaseState.ACTIVE)
        ]
        if not candidates:
            return
        lid = pick(candidates, which)
        view = self.view(lid)
        if view.state is LeaseState.PINNING:
            rank = self.unsettled(
                ENGINES[view.source_child_engine_id], self.answered.get(lid, set()), False
            )[0]
            self.do_pin(lid, rank, self.chain_len[lid], 0)
        elif view.state is LeaseState.WAITING_READY:
            params_bytes, blocks, decode = self.handoff_params[
                (view.source_child_engine_id, view.request_id)
            ]
            published = {rank for (held, rank) in self.holding if held == lid}
            rank = self.unsettled(ENGINES[view.source_child_engine_id], published, False)[0]
            self.do_publish(
                view.source_child_engine_id, view.request_id, rank, params_bytes, blocks, decode
            )
        elif view.state is LeaseState.READY:
            reserved = self.handoff_params[(view.source_child_engine_id, view.request_id)][2]
            others = [e for e in sorted(self.alive) if e != view.source_child_engine_id]
            if reserved is not None or others:
                self.do_begin(lid, reserved if reserved is not None else pick(others, dec))
        elif lid in self.target and self.target[lid] in self.alive:
            rank = self.unsettled(self.target_parts[lid], self.settled[lid], False)[0]
            self.do_report(lid, rank, outcome, False)

    @rule(which=indexes, dec=indexes, outcome=mostly_succeeded)
    def progress_again(self, which: int, dec: int, outcome: Outcome) -> None:
        """A second entry for `progress`: rules are drawn uniformly, this doubles its weight."""
        self.progress(which, dec, outcome)

    def open_leases(self, flow: Flow, state: LeaseState) -> list[str]:
        return [
            lid
            for lid in self.leases(flow)
            if self.view(lid).state is state and self.source[lid] in self.alive
        ]

    @rule(delta=st.sampled_from([1, 10, 100, 100, 499, 500, 1_500, 3_000]))
    def advance(self, delta: int) -> None:
        self.now += delta
        self.apply(self.table.tick(self.now))

    @rule(which=engine_names)
    def engine_gone(self, which: str) -> None:
        if which not in self.alive:
            return
        self.alive.discard(which)
        self.gone_at[which] = self.step_no + 1
        running = (LeaseState.ACTIVE, LeaseState.ABORTING)
        for lid in self.leases():
            view = self.view(lid)
            state = view.state
            if (
                self.target.get(lid) == which
                and state is LeaseState.ACTIVE
                and not self.unknown.get(lid)
            ):
                # Held to its deadline, not released now (reads may still land).
                self.deferred.add(lid)
                self.deadline_at_gone[lid] = view.deadline_ms or 0
                continue
            if lid in self.deferred:
                continue  # its target was proven gone before: the deadline decides
            if self.target.get(lid) == which and (state in running or lid in self.source_died):
                self.proofs_closed.add(lid)  # quarantined or released: nobody left to ask
            if self.source[lid] == which and state in running:
                self.source_died.add(lid)
            elif (
                self.source[lid] == which
                and state is LeaseState.QUARANTINED
                and lid not in self.proofs_closed
            ):
                # Ends FAILED; its release follows the proofs it awaits (as a read in
                # flight). With none to await it fails closed.
                self.source_died.add(lid)
        self.apply(self.table.on_engine_gone(which, self.now), gone=which)
        # Nothing of a dead engine stays open, except quarantines it was the target of
        # and leases held to their deadline.
        for view in self.table.leases_of(which):
            if view.lease_id in self.deferred and view.state is LeaseState.ACTIVE:
                continue
            assert view.state is LeaseState.QUARANTINED
            assert view.source_child_engine_id != which

    @rule(which=engine_names)
    def restart(self, which: str) -> None:
        self.alive.add(which)

    @rule(which=engine_names)
    def drain_deadline(self, which: str) -> None:
        self.apply(self.table.abort_engine(which, self.now))
        for view in self.table.leases_of(which):
            if view.lease_id in self.deferred and view.state is LeaseState.ACTIVE:
                continue  # its target proven gone: its deadline ends it, nobody to ask
            assert view.state in (LeaseState.ABORTING, LeaseState.QUARANTINED)

    @rule(which=indexes)
    def resolve(self, which: int) -> None:
        leases = self.leases()
        if not leases:
            return
        lid = pick(leases, which)
        before = self.view(lid)
        step = self.attempt(
            lambda: self.table.resolve_quarantine(lid, self.now), ErrorCode.FAILED_PRECONDITION
        )
        if step is None:
            assert before.state is not LeaseState.QUARANTINED
            return
        assert before.state is LeaseState.QUARANTINED
        self.apply(step.actions, resolving=lid)  # type: ignore[attr-defined]

    @rule(which=indexes)
    def cross_flow_probe(self, which: int) -> None:
        leases = self.leases()
        if not leases:
            return
        lid = pick(leases, which)
        rank = (0, 0, 0)
        if self.flow[lid] is Flow.PREFIX_LOAD:
            self.attempt(
                lambda: self.table.complete_handoff(lid, "e0", rank, Outcome.SUCCEEDED, self.now),
                ErrorCode.NOT_FOUND,
            )
            self.attempt(
                lambda: self.table.extend_handoff(lid, "e0", self.now), ErrorCode.NOT_FOUND
            )
        else:
            self.attempt(
                lambda: self.table.complete_prefix_load(
                    lid, "e0", rank, Outcome.SUCCEEDED, self.now
                ),
                ErrorCode.NOT_FOUND,
            )
            self.attempt(
                lambda: self.table.on_pin_result(lid, "e0", rank, 1, None, self.now),
                ErrorCode.NOT_FOUND,
            )

    @rule()
    def time_runs_far(self) -> None:
        """Past every deadline: all that was held is released, quarantined or dead."""
        for _ in range(3):  # ACTIVE -> ABORTING -> QUARANTINED
            self.now += FAR_MS
            self.apply(self.table.tick(self.now))
        for (lid, rank), held_since in self.holding.items():
            if (lid, rank) in self.zero_pins:
                continue
            source = self.source[lid]
            if self.gone_at.get(source, -1) >= held_since:
                continue
            state = self.view(lid).state
            if state is LeaseState.QUARANTINED:
                assert lid in self.quarantined
                continue
            assert state in TERMINAL_STATES
            assert self.releases[(lid, source, rank)] == 1, (
                f"{lid} part {rank} of {source} was never released (state {state.name})"
            )

    # ------------------------------------------------------------ invariants

    @invariant()
    def terminal_states_are_final_and_announced_once(self) -> None:
        for lid in self.flow:
            view = self.view(lid)
            assert view.flow is self.flow[lid]
            if lid in self.ended:
                assert view.state is self.ended[lid]
            else:
                assert view.state not in TERMINAL_STATES

    @invariant()
    def quarantined_leases_were_never_released(self) -> None:
        released = {lid for (lid, _, _) in self.releases}
        for view in self.table.list_leases():
            if view.state is LeaseState.QUARANTINED:
                assert view.lease_id in self.quarantined
                assert view.lease_id not in released

    @invariant()
    def counts_match_the_listing(self) -> None:
        views = self.table.list_leases()
        listed = Counter((v.flow, v.state) for v in views)
        assert dict(listed) == self.table.counts()
        # The gauge, fed only the changed counts, shows every count (zeros included).
        self.gauge.update(self.table.take_changed_counts())
        assert {k: n for k, n in self.gauge.items() if n} == self.table.counts()
        per_engine: Counter[str] = Counter()
        shares: Counter[str] = Counter()  # what the per-engine bound counts
        for v in views:
            per_engine[v.source_child_engine_id] += 1
            shares[v.source_child_engine_id] += 1
            if v.target_child_engine_id is not None:
                per_engine[v.target_child_engine_id] += 1
                # A handoff reserved for a decode and not begun counts against its
                # prefill only (a prefill cannot fill a decode's share by reserving).
                if not (v.flow is Flow.HANDOFF and v.handoff_grant is None):
                    shares[v.target_child_engine_id] += 1
        assert dict(per_engine) == self.table.open_counts_by_engine()
        assert all(n <= CONFIG.max_open_leases_per_engine for n in shares.values())
        dp_shares: Counter[str] = Counter()  # an engine's DP ranks together
        for child, n in shares.items():
            engine, dp_rank = parse_child_engine_id(child)
            if dp_rank is not None:
                dp_shares[engine] += n
        assert all(n <= CONFIG.max_open_leases_per_dp_engine for n in dp_shares.values())
        assert sum(listed.values()) <= CONFIG.max_open_leases

    @invariant()
    def kept_payload_is_the_sum_over_kept_leases_and_bounded(self) -> None:
        kept = sum(lease.payload_bytes for lease in self.table._leases.values())
        assert self.table.payload_bytes == kept <= CONFIG.max_payload_bytes
        # Each engine's share: what it sent that its open leases keep.
        shares: Counter[str] = Counter()
        for view in self.table.list_leases():
            lease = self.table._leases[view.lease_id]
            requester = (
                view.target_child_engine_id
                if view.flow is Flow.PREFIX_LOAD
                else view.source_child_engine_id
            )
            assert requester is not None
            shares[requester] += lease.requester_payload_bytes
        assert self.table._open_payload_by_engine == {e: n for e, n in shares.items() if n}
        assert all(n <= CONFIG.max_payload_bytes_per_engine for n in shares.values())
