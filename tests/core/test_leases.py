"""Unit tests of the lease core: every rule of both flows and every error status."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from functools import partial
from types import MappingProxyType
from typing import Any

import pytest
from lease_steps import CHAIN, DEC, HOLD, PARAMS, PRE, REQ, T0, TP2, open_load_step

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import RankKey
from coordinator.core.leases import (
    Action,
    Flow,
    HandoffPublished,
    HandoffReady,
    LeaseAborting,
    LeaseConfig,
    LeaseEnded,
    LeaseGranted,
    LeaseMissed,
    LeaseQuarantined,
    LeaseState,
    LeaseStep,
    LeaseTable,
    MissReason,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
)
from kvrc.ids import MAX_GRID_PARTS


def table(**config: int) -> LeaseTable:
    counter = itertools.count()
    return LeaseTable(LeaseConfig(**config), id_factory=lambda: f"L{next(counter)}")


def of(actions: Sequence[Action], kind: type[Any]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def snapshot(t: LeaseTable) -> object:
    return (t.list_leases(include_terminal=True), t.counts(), t.next_deadline_ms())


def refused(t: LeaseTable, code: ErrorCode, call: Callable[[], object]) -> KvrcError:
    """The call raises `code` and changes nothing."""
    before = snapshot(t)
    with pytest.raises(KvrcError) as info:
        call()
    assert info.value.code is code, info.value
    assert snapshot(t) == before
    return info.value


def open_load(t: LeaseTable, request_id: str = "r1", **fields: Any) -> str:
    """`open_load_step`'s lease id."""
    return open_load_step(t, request_id, **fields).view.lease_id


def granted_load(t: LeaseTable, request_id: str = "r1", pinned: int = 8) -> str:
    lease_id = open_load(t, request_id)
    for key in TP2:
        t.on_pin_result(lease_id, HOLD, key, pinned, {"desc": key}, T0 + 10)
    assert t.get(lease_id).state is LeaseState.ACTIVE
    return lease_id


def publish(
    t: LeaseTable,
    rank_key: RankKey,
    descriptor: object,
    request_id: str = "h1",
    *,
    decode: str | None = None,
    now: int = T0,
) -> HandoffPublished:
    """One prefill part of PRE (grid TP2) publishes its 6 blocks and PARAMS."""
    return t.publish_handoff(
        request_id=request_id,
        prefill_child_engine_id=PRE,
        prefill_rank_keys=TP2,
        rank_key=rank_key,
        descriptor=descriptor,
        kv_transfer_params=PARAMS,
        decode_child_engine_id=decode,
        num_blocks=6,
        now_ms=now,
    )


def publish_all(t: LeaseTable, request_id: str = "h1", decode: str | None = None) -> str:
    lease_id = ""
    for key in TP2:
        lease_id = publish(t, key, ("desc", key), request_id, decode=decode).view.lease_id
    return lease_id


def begin(
    t: LeaseTable,
    request_id: str = "h1",
    *,
    decode: str = DEC,
    decode_grid: Sequence[RankKey] = TP2,
    now: int = T0,
) -> LeaseStep:
    """A decode child engine begins the handoff of PRE's `request_id`."""
    return t.begin_handoff(
        request_id=request_id,
        prefill_child_engine_id=PRE,
        decode_child_engine_id=decode,
        decode_rank_keys=decode_grid,
        now_ms=now,
    )


def begun(t: LeaseTable, request_id: str = "h1") -> str:
    publish_all(t, request_id)
    return begin(t, request_id, now=T0 + 5).view.lease_id


# --------------------------------------------------------------------- prefix load


def test_open_sends_a_pin_to_every_holder_part() -> None:
    t = table()
    step = open_load_step(t, "r1", min_blocks=2, group_idx=1)
    assert step.view.state is LeaseState.PINNING and step.view.flow is Flow.PREFIX_LOAD
    pins = of(step.actions, SendPin)
    assert [(p.child_engine_id, p.rank_key) for p in pins] == [(HOLD, k) for k in TP2]
    assert all(p.block_hashes == CHAIN and p.group_idx == 1 for p in pins)
    assert all(p.requester_child_engine_id == REQ for p in pins)
    assert len(step.actions) == 2
    assert t.counts() == {(Flow.PREFIX_LOAD, LeaseState.PINNING): 1}


def test_grant_matches_the_shortest_pin_and_passes_descriptors_through() -> None:
    t = table()
    lease_id = open_load(t, min_blocks=2)
    desc0, desc1 = object(), object()
    first = t.on_pin_result(lease_id, HOLD, TP2[0], 5, desc0, T0 + 10)
    assert first.actions == () and first.view.state is LeaseState.PINNING
    step = t.on_pin_result(lease_id, HOLD, TP2[1], 3, desc1, T0 + 20)
    assert step.view.state is LeaseState.ACTIVE
    assert of(step.actions, LeaseGranted) == [LeaseGranted(lease_id, Flow.PREFIX_LOAD, 20)]
    grant = step.view.prefix_load_grant
    assert grant is not None
    assert grant.matched_blocks == 3  # the hint was 8: a holder may pin fewer
    assert grant.source_child_engine_id == HOLD and grant.deadline_ms == T0 + 20 + 5_000
    assert [(p.rank_key, p.pinned_blocks) for p in grant.source_parts] == [(TP2[0], 5), (TP2[1], 3)]
    assert grant.source_parts[0].descriptor is desc0 and grant.source_parts[1].descriptor is desc1


def test_zero_pin_is_a_miss_and_releases_only_parts_that_may_hold_pins() -> None:
    t = table()
    lease_id = open_load(t)
    t.on_pin_result(lease_id, HOLD, TP2[0], 0, None, T0 + 10)
    view = t.get(lease_id)
    assert view.state is LeaseState.MISSED and view.miss_reason is MissReason.SHORT_PIN
    # Three parts: one pinned 4, one pinned 0, one never answered.
    t = table()
    grid3 = ((0, 0, 0), (1, 0, 0), (2, 0, 0))
    lease_id = open_load(t, holder_grid=grid3)
    assert t.on_pin_result(lease_id, HOLD, grid3[0], 4, None, T0 + 1).actions == ()
    step = t.on_pin_result(lease_id, HOLD, grid3[1], 0, None, T0 + 2)
    assert step.view.state is LeaseState.MISSED
    released = {a.rank_key for a in of(step.actions, SendRelease)}
    assert released == {grid3[0], grid3[2]}
    assert of(step.actions, LeaseMissed) == [LeaseMissed(lease_id, REQ, "r1", MissReason.SHORT_PIN)]
    assert of(step.actions, LeaseEnded)[0].quiescence_ms is None


def test_pin_below_min_blocks_is_a_miss() -> None:
    t = table()
    lease_id = open_load(t, min_blocks=4)
    step = t.on_pin_result(lease_id, HOLD, TP2[0], 3, None, T0 + 1)
    assert step.view.state is LeaseState.MISSED
    assert step.view.miss_reason is MissReason.BELOW_MIN_BLOCKS
    assert [a.rank_key for a in of(step.actions, SendRelease)] == list(TP2)


def test_pin_timeout_misses_and_releases_answered_and_silent_parts() -> None:
    t = table()
    lease_id = open_load(t)
    t.on_pin_result(lease_id, HOLD, TP2[0], 8, None, T0 + 10)
    assert t.tick(T0 + 499) == []
    actions = t.tick(T0 + 500)
    assert t.get(lease_id).state is LeaseState.MISSED
    assert t.get(lease_id).miss_reason is MissReason.PIN_TIMEOUT
    assert {a.rank_key for a in of(actions, SendRelease)} == set(TP2)
    # The silent part answers late: a no-op, no second release.
    late = t.on_pin_result(lease_id, HOLD, TP2[1], 8, None, T0 + 600)
    assert late.actions == () and late.view.state is LeaseState.MISSED


def test_release_waits_for_every_requester_part() -> None:
    t = table()
    lease_id = granted_load(t)
    first = t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0 + 100)
    assert first.actions == () and first.view.state is LeaseState.ACTIVE
    assert not first.view.quiescent
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 300)
    assert step.view.state is LeaseState.COMPLETED and step.view.quiescent
    assert [(a.child_engine_id, a.rank_key) for a in of(step.actions, SendRelease)] == [
        (HOLD, k) for k in TP2
    ]
    ended = of(step.actions, LeaseEnded)
    assert ended == [
        LeaseEnded(
            lease_id, Flow.PREFIX_LOAD, LeaseState.COMPLETED, 290, 300, (HOLD, REQ), T0 + 300, "r1"
        )
    ]
    assert t.counts() == {}


def test_a_failed_part_ends_failed_with_release() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 100)
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 100)
    assert step.view.state is LeaseState.FAILED
    assert len(of(step.actions, SendRelease)) == 2


def test_unknown_outcome_quarantines_until_an_operator_resolves() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 100)
    assert step.view.state is LeaseState.QUARANTINED
    assert of(step.actions, SendRelease) == []
    assert [a.rank_key for a in of(step.actions, SendQuarantine)] == list(TP2)
    assert len(of(step.actions, LeaseQuarantined)) == 1
    # Time passing, the requester dying and late reports do not release it.
    assert t.tick(T0 + 10**9) == []
    assert t.on_engine_gone(REQ, T0 + 10**9) == []
    assert [v.state for v in t.leases_of(HOLD)] == [LeaseState.QUARANTINED]
    assert t.counts() == {(Flow.PREFIX_LOAD, LeaseState.QUARANTINED): 1}
    resolved = t.resolve_quarantine(lease_id, T0 + 10**9)
    assert resolved.view.state is LeaseState.RESOLVED
    assert len(of(resolved.actions, SendRelease)) == 2
    refused(t, ErrorCode.FAILED_PRECONDITION, lambda: t.resolve_quarantine(lease_id, T0))


def test_an_unknown_part_proves_its_reads_quiet_with_an_abort_ack_and_the_quarantine_ends() -> None:
    # I6-quiescence: the part that reported UNKNOWN is asked (an abort) to prove its
    # reads quiet; its ack is that proof, and only then is the holder released.
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 100)
    assert step.view.state is LeaseState.QUARANTINED
    assert [(a.child_engine_id, a.rank_key) for a in of(step.actions, SendAbort)] == [(REQ, TP2[0])]
    # The control: an ack from the part that owes nothing, and time, change nothing.
    assert t.on_abort_ack(lease_id, REQ, TP2[1], T0 + 200).actions == ()
    assert t.tick(T0 + 10**9) == []
    assert t.get(lease_id).state is LeaseState.QUARANTINED
    proven = t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 10**9)
    assert proven.view.state is LeaseState.FAILED
    assert [(a.child_engine_id, a.rank_key) for a in of(proven.actions, SendRelease)] == [
        (HOLD, k) for k in TP2
    ]
    assert "proved its reads quiet" in proven.view.reason
    # A repeated ack changes nothing; a report cannot change the UNKNOWN either.
    assert t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 10**9).actions == ()
    refused(
        t,
        ErrorCode.FAILED_PRECONDITION,
        lambda: t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0 + 10**9),
    )


def test_a_late_abort_ack_ends_the_quarantine_it_caused() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 100)
    t.tick(T0 + 10 + 5_000)  # ACTIVE -> ABORTING: TP2[1] is asked to stop
    quarantined = t.tick(T0 + 10**8)  # never acknowledged in time
    assert t.get(lease_id).state is LeaseState.QUARANTINED
    assert of(quarantined, SendRelease) == []
    # The abort (or its ack) may have been lost: the part that owes the ack is asked again.
    assert [a.rank_key for a in of(quarantined, SendAbort)] == [TP2[1]]
    late = t.on_abort_ack(lease_id, REQ, TP2[1], T0 + 10**8 + 1)
    assert late.view.state is LeaseState.FAILED and len(of(late.actions, SendRelease)) == 2


def test_a_quarantine_whose_target_is_gone_waits_for_the_operator() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    t.tick(T0 + 10 + 5_000)  # TP2[1] is aborted
    actions = t.on_engine_gone(REQ, T0 + 6_000)  # quarantined: nobody left to prove it
    assert t.get(lease_id).state is LeaseState.QUARANTINED and of(actions, SendAbort) == []
    assert t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 7_000).actions == ()
    assert t.on_abort_ack(lease_id, REQ, TP2[1], T0 + 7_000).actions == ()
    assert t.get(lease_id).state is LeaseState.QUARANTINED


def test_deadline_with_live_requester_aborts_and_releases_only_after_every_ack() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 100)
    deadline = T0 + 10 + 5_000
    assert t.tick(deadline - 1) == []
    actions = t.tick(deadline)
    assert t.get(lease_id).state is LeaseState.ABORTING
    assert of(actions, SendRelease) == []
    assert [(a.child_engine_id, a.rank_key) for a in of(actions, SendAbort)] == [(REQ, TP2[1])]
    assert len(of(actions, LeaseAborting)) == 1
    # An ack from a part that already reported changes nothing.
    assert t.on_abort_ack(lease_id, REQ, TP2[0], deadline + 1).actions == ()
    step = t.on_abort_ack(lease_id, REQ, TP2[1], deadline + 2)
    assert step.view.state is LeaseState.FAILED
    assert len(of(step.actions, SendRelease)) == 2
    # Duplicate ack after the end: no-op.
    assert t.on_abort_ack(lease_id, REQ, TP2[1], deadline + 3).actions == ()


def test_a_report_during_abort_counts_as_settled() -> None:
    t = table()
    lease_id = granted_load(t)
    t.tick(T0 + 10 + 5_000)
    t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 6_000)
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 6_001)
    assert step.view.state is LeaseState.FAILED  # aborted, proven quiet
    assert len(of(step.actions, SendRelease)) == 2


def test_an_unacknowledged_abort_goes_to_quarantine() -> None:
    t = table(abort_timeout_ms=1_000)
    lease_id = granted_load(t)
    t.tick(T0 + 10 + 5_000)
    actions = t.tick(T0 + 10 + 6_000)
    assert t.get(lease_id).state is LeaseState.QUARANTINED
    assert of(actions, SendRelease) == [] and len(of(actions, SendQuarantine)) == 2
    # A late ack does not undo the quarantine (fail closed).
    assert t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 7_000).actions == ()
    assert t.get(lease_id).state is LeaseState.QUARANTINED


def test_requester_gone_mid_transfer_releases_at_the_leases_deadline() -> None:
    """ "Gone" is a session closed past the grace: a requester alive without its session
    may still read until the lease's deadline (past it, it discards what it reads). The
    release waits for that deadline, never aborts (nobody to ask), and a requester that
    comes back before it is not gone after all: the deadline then aborts as for any
    live target."""
    t = table()
    lease_id = granted_load(t)
    deadline = t.get(lease_id).deadline_ms
    assert deadline is not None
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0 + 100)
    assert t.on_engine_gone(REQ, T0 + 200) == []
    assert t.get(lease_id).state is LeaseState.ACTIVE  # before: released here
    assert "released at the lease's deadline" in t.get(lease_id).reason
    assert t.tick(deadline - 1) == []
    actions = t.tick(deadline)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert len(of(actions, SendRelease)) == 2 and of(actions, SendAbort) == []

    back = table()
    lease_id = granted_load(back)
    back.on_engine_gone(REQ, T0 + 200)
    back.resend_owed_aborts(REQ, TP2[0])  # a part of it registered again
    actions = back.tick(deadline)
    assert back.get(lease_id).state is LeaseState.ABORTING
    assert of(actions, SendRelease) == [] and len(of(actions, SendAbort)) == 2


def test_requester_gone_while_pinning_releases_the_holder() -> None:
    t = table()
    lease_id = open_load(t)
    actions = t.on_engine_gone(REQ, T0 + 1)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert len(of(actions, SendRelease)) == 2


def reannounce(t: LeaseTable, lease_id: str, part: RankKey, source: str = HOLD) -> list[Any]:
    """A source part back after being declared gone re-announces the lease: what it gets."""
    step = t.recover_held(
        lease_id=lease_id,
        holder_child_engine_id=source,
        holder_rank_keys=TP2,
        rank_key=part,
        now_ms=T0 + 10**6,
    )
    got = []
    for a in step.actions:
        assert isinstance(a, SendRelease | SendQuarantine)
        got.append((type(a).__name__, a.rank_key))
    return got


def test_holder_gone_before_answering_is_a_miss_and_its_release_is_decided() -> None:
    t = table()
    lease_id = open_load(t)
    actions = t.on_engine_gone(HOLD, T0 + 100)
    view = t.get(lease_id)
    assert view.state is LeaseState.MISSED and view.miss_reason is MissReason.HOLDER_GONE
    assert of(actions, LeaseMissed)[0].reason is MissReason.HOLDER_GONE
    # "Gone" may be a blip past the grace: nothing was read, so its release is decided
    # now, and a holder that comes back still pinning gets it again.
    assert [a.rank_key for a in of(actions, SendRelease)] == list(TP2)
    assert reannounce(t, lease_id, TP2[1]) == [("SendRelease", TP2[1])]


def test_holder_gone_mid_transfer_fails_and_tells_the_requester_to_stop() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0 + 100)
    actions = t.on_engine_gone(HOLD, T0 + 200)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert of(actions, SendRelease) == []
    assert [a.rank_key for a in of(actions, SendAbort)] == [TP2[1]]
    # A holder back meanwhile keeps its pins: TP2[1] may still read (I6-quiescence).
    assert reannounce(t, lease_id, TP2[0]) == []
    # The requester's report proves its reads quiet: the release is decided then.
    late = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.FAILED, T0 + 300)
    assert late.view.state is LeaseState.FAILED
    assert [a.rank_key for a in of(late.actions, SendRelease)] == list(TP2)
    assert reannounce(t, lease_id, TP2[0]) == [("SendRelease", TP2[0])]


def test_a_holder_declared_gone_is_released_only_once_every_read_is_proven_quiet() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    t.tick(T0 + 10 + 5_000)  # quarantined: TP2[0] owes an ack (TP2[1] still reading)
    t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 5_100)
    t.tick(T0 + 10 + 6_000)
    lease2 = granted_load(t, "r2")
    t.complete_prefix_load(lease2, REQ, TP2[1], Outcome.UNKNOWN, T0 + 6_100)
    actions = t.on_engine_gone(HOLD, T0 + 6_200)
    # lease2: the UNKNOWN part and the silent one are both asked to stop; nothing released.
    assert sorted(a.rank_key for a in of(actions, SendAbort) if a.lease_id == lease2) == list(TP2)
    assert of(actions, SendRelease) == [] and t.get(lease2).state is LeaseState.FAILED
    assert t.complete_prefix_load(lease2, REQ, TP2[0], Outcome.UNKNOWN, T0 + 6_300).actions == ()
    assert t.on_abort_ack(lease2, REQ, TP2[1], T0 + 6_400).actions == ()  # TP2[0] still owes
    done = t.on_abort_ack(lease2, REQ, TP2[0], T0 + 6_500)
    assert [(a.lease_id, a.rank_key) for a in of(done.actions, SendRelease)] == [
        (lease2, k) for k in TP2
    ]
    assert t.on_abort_ack(lease2, REQ, TP2[0], T0 + 6_600).actions == ()  # once


def test_a_gone_holders_release_is_decided_when_its_requester_is_gone_too() -> None:
    t = table()
    quiet, unknown = granted_load(t, "r1"), granted_load(t, "r2")
    t.complete_prefix_load(unknown, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    t.on_engine_gone(HOLD, T0 + 200)
    actions = t.on_engine_gone(REQ, T0 + 300)
    # Nothing reads any more; an UNKNOWN outcome never proven stays closed (no release).
    assert {(a.lease_id, a.rank_key) for a in of(actions, SendRelease)} == {(quiet, k) for k in TP2}
    assert reannounce(t, unknown, TP2[0]) == []
    assert t.resend_owed_aborts(REQ, TP2[1]) == []


def test_a_prefill_declared_gone_before_the_begin_gets_its_release() -> None:
    t = table()
    waiting = publish(t, TP2[0], "d0", "h1").view.lease_id
    ready = publish_all(t, "h2")
    actions = t.on_engine_gone(PRE, T0 + 100)
    assert {(a.lease_id, a.rank_key) for a in of(actions, SendRelease)} == {
        (waiting, TP2[0]),
        (ready, TP2[0]),
        (ready, TP2[1]),
    }
    assert reannounce(t, ready, TP2[1], source=PRE) == [("SendRelease", TP2[1])]


def test_a_failed_report_of_a_part_that_owes_an_ack_ends_the_quarantine() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 100)
    t.tick(T0 + 10 + 5_000)
    t.tick(T0 + 10**8)  # the abort to TP2[1] was lost: quarantined
    # Its FAILED report says its reads ended: the proof it owed, like the ack.
    step = t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.FAILED, T0 + 10**8 + 1)
    assert step.view.state is LeaseState.FAILED and len(of(step.actions, SendRelease)) == 2


def test_a_re_registered_source_part_is_told_again_of_every_quarantine() -> None:
    """A QuarantineNotice sent while the holder part was between sessions was dropped;
    without it, its safety net frees pins whose reads were never proven quiet."""
    t = table()
    quarantined, active = granted_load(t, "r1"), granted_load(t, "r2")
    t.complete_prefix_load(quarantined, REQ, TP2[0], Outcome.UNKNOWN, T0 + 100)
    t.complete_prefix_load(quarantined, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 100)
    assert t.get(quarantined).state is LeaseState.QUARANTINED
    assert t.get(active).state is LeaseState.ACTIVE
    for key in TP2:
        again = t.resend_quarantines(HOLD, key)
        told = of(again, SendQuarantine)
        assert len(told) == len(again) == 1
        assert (told[0].lease_id, told[0].child_engine_id, told[0].rank_key) == (
            quarantined,
            HOLD,
            key,
        )
        assert again == t.resend_quarantines(HOLD, key)  # nothing changed
    # The requester is no source: it is told nothing (it is asked for its acks instead).
    assert t.resend_quarantines(REQ, TP2[0]) == []
    # Once the quarantine ends, there is nothing to tell.
    t.on_abort_ack(quarantined, REQ, TP2[0], T0 + 200)
    assert t.get(quarantined).state is LeaseState.FAILED
    assert t.resend_quarantines(HOLD, TP2[0]) == []


def test_a_re_registered_target_part_is_asked_again_for_every_ack_it_owes() -> None:
    t = table()
    aborting, quarantined, quiet = (granted_load(t, f"r{i}") for i in range(3))
    gone_holder = open_load(t, "r3", holder="holder-x")
    for key in TP2:
        t.on_pin_result(gone_holder, "holder-x", key, 8, {"desc": key}, T0 + 10)
    t.complete_prefix_load(quarantined, REQ, TP2[1], Outcome.UNKNOWN, T0 + 100)
    t.complete_prefix_load(quarantined, REQ, TP2[0], Outcome.SUCCEEDED, T0 + 100)
    for key in TP2:
        t.complete_prefix_load(quiet, REQ, key, Outcome.SUCCEEDED, T0 + 100)
    t.tick(T0 + 10 + 5_000)  # `aborting` and `gone_holder`: both parts asked to stop
    t.on_abort_ack(aborting, REQ, TP2[0], T0 + 5_100)
    t.on_engine_gone("holder-x", T0 + 5_200)  # `gone_holder` ends; its release awaits acks
    t.on_abort_ack(gone_holder, REQ, TP2[0], T0 + 5_300)
    states = [t.get(lid).state for lid in (aborting, quarantined, gone_holder)]
    assert states == [LeaseState.ABORTING, LeaseState.QUARANTINED, LeaseState.FAILED]
    # The part that acked, or owes nothing, is asked nothing; a source part owes no ack.
    assert t.resend_owed_aborts(REQ, TP2[0]) == []
    assert t.resend_owed_aborts(HOLD, TP2[1]) == []
    again = of(t.resend_owed_aborts(REQ, TP2[1]), SendAbort)
    assert again == t.resend_owed_aborts(REQ, TP2[1])  # aborts only, and nothing changed
    assert sorted((a.lease_id, a.child_engine_id, a.rank_key) for a in again) == sorted(
        (lid, REQ, TP2[1]) for lid in (aborting, quarantined, gone_holder)
    )
    # Its ack then ends each: the release of the gone holder is decided with the last one.
    done = t.on_abort_ack(gone_holder, REQ, TP2[1], T0 + 5_400)
    assert [(a.child_engine_id, a.rank_key) for a in of(done.actions, SendRelease)] == [
        ("holder-x", k) for k in TP2
    ]


def test_same_request_id_returns_the_same_lease_even_after_it_ended() -> None:
    t = table()
    lease_id = granted_load(t)
    again = open_load_step(t, "r1", holder="someone-else", now=T0 + 50)
    assert again.view == t.get(lease_id) and again.actions == ()
    for key in TP2:
        t.complete_prefix_load(lease_id, REQ, key, Outcome.SUCCEEDED, T0 + 100)
    assert open_load(t, "r1") == lease_id
    assert t.get(lease_id).state is LeaseState.COMPLETED  # not re-opened
    assert t.find_prefix_load(REQ, "r1") == t.get(lease_id)
    assert t.find_prefix_load(HOLD, "r1") is None
    refused(t, ErrorCode.ALREADY_EXISTS, lambda: open_load(t, "r1", chain=CHAIN[:4]))


def test_prefix_load_errors_change_nothing() -> None:
    t = table()
    lease_id = granted_load(t)
    refused(
        t,
        ErrorCode.NOT_FOUND,
        lambda: t.complete_prefix_load("nope", REQ, TP2[0], Outcome.SUCCEEDED, T0),
    )
    # A foreign engine is denied; a rank part outside the requester's grid is a bad
    # request of the requester itself (INVALID_ARGUMENT: no auth denial counted).
    refused(
        t,
        ErrorCode.PERMISSION_DENIED,
        lambda: t.complete_prefix_load(lease_id, "x", TP2[0], Outcome.SUCCEEDED, T0),
    )
    error = refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: t.complete_prefix_load(lease_id, REQ, (5, 0, 0), Outcome.SUCCEEDED, T0),
    )
    assert "rank part (5, 0, 0) is not one of the 2 requester part(s)" in str(error)
    refused(
        t,
        ErrorCode.PERMISSION_DENIED,
        lambda: t.complete_prefix_load(lease_id, HOLD, TP2[0], Outcome.SUCCEEDED, T0),
    )
    refused(t, ErrorCode.PERMISSION_DENIED, lambda: t.on_abort_ack(lease_id, HOLD, TP2[0], T0))
    # Duplicate report: idempotent; a changed report: refused.
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 1)
    before = snapshot(t)
    assert t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.FAILED, T0 + 2).actions == ()
    assert snapshot(t) == before
    refused(
        t,
        ErrorCode.FAILED_PRECONDITION,
        lambda: t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0),
    )
    not_an_outcome: Any = 7
    refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: t.complete_prefix_load(lease_id, REQ, TP2[1], not_an_outcome, T0),
    )
    # Pin answers: from a non-holder, too long, or changed.
    refused(
        t, ErrorCode.PERMISSION_DENIED, lambda: t.on_pin_result(lease_id, REQ, TP2[0], 1, None, T0)
    )
    refused(
        t, ErrorCode.INVALID_ARGUMENT, lambda: t.on_pin_result(lease_id, HOLD, TP2[0], 9, None, T0)
    )
    refused(
        t,
        ErrorCode.FAILED_PRECONDITION,
        lambda: t.on_pin_result(lease_id, HOLD, TP2[0], 7, None, T0),
    )
    refused(t, ErrorCode.NOT_FOUND, lambda: t.resolve_quarantine("nope", T0))
    refused(t, ErrorCode.FAILED_PRECONDITION, lambda: t.resolve_quarantine(lease_id, T0))


def test_report_before_the_grant_is_refused() -> None:
    t = table()
    lease_id = open_load(t)
    refused(
        t,
        ErrorCode.FAILED_PRECONDITION,
        lambda: t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.SUCCEEDED, T0),
    )


@pytest.mark.parametrize(
    ("overrides", "code"),
    [
        ({"chain": ()}, ErrorCode.INVALID_ARGUMENT),
        ({"chain": CHAIN * 3}, ErrorCode.INVALID_ARGUMENT),  # over max_chain_blocks=16
        ({"min_blocks": 9}, ErrorCode.INVALID_ARGUMENT),
        ({"min_blocks": -1}, ErrorCode.INVALID_ARGUMENT),
        ({"holder": REQ}, ErrorCode.INVALID_ARGUMENT),
        ({"holder": ""}, ErrorCode.INVALID_ARGUMENT),
        ({"requester": "x" * 257}, ErrorCode.INVALID_ARGUMENT),
        ({"holder_grid": ()}, ErrorCode.INVALID_ARGUMENT),
        ({"holder_grid": (TP2[0], TP2[0])}, ErrorCode.INVALID_ARGUMENT),
        ({"requester_grid": ((0, -1, 0),)}, ErrorCode.INVALID_ARGUMENT),
        (
            {"requester_grid": tuple((i, 0, 0) for i in range(MAX_GRID_PARTS + 1))},
            ErrorCode.INVALID_ARGUMENT,
        ),
    ],
)
def test_bad_prefix_load_requests_are_refused(overrides: dict[str, Any], code: ErrorCode) -> None:
    t = table(max_chain_blocks=16)
    open_load(t, "existing")
    refused(t, code, lambda: open_load(t, "r-bad", **overrides))


@pytest.mark.parametrize(
    ("pin_timeout", "ttl"), [(0, 5_000), (500, 0), (60_001, 5_000), (500, 600_001)]
)
def test_bad_durations_are_refused(pin_timeout: int, ttl: int) -> None:
    t = table()
    refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: open_load_step(t, "r", pin_timeout_ms=pin_timeout, transfer_ttl_ms=ttl),
    )


def test_open_lease_bounds_total_and_per_engine() -> None:
    t = table(max_open_leases=3, max_open_leases_per_engine=2)
    open_load(t, "a")
    open_load(t, "b")
    err = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: open_load(t, "c"))
    assert "per-engine" in err.message
    open_load(t, "c", requester="other-req", holder="other-hold")
    err = refused(
        t, ErrorCode.RESOURCE_EXHAUSTED, lambda: open_load(t, "d", requester="r3", holder="h3")
    )
    assert "3 leases are open" in err.message
    # Ending a lease frees its slot.
    t.on_engine_gone(HOLD, T0 + 1)
    open_load(t, "d", requester="r3", holder="h3")


def test_an_engine_of_many_dp_ranks_takes_at_most_its_share_of_the_table() -> None:
    """The share was per child engine only (4,096 of 65,536): an engine with 17 DP ranks
    filled the whole table and every other engine's publish was RESOURCE_EXHAUSTED (a
    review's finding). Its DP ranks' child engines together now hold at most
    max_open_leases_per_dp_engine (a quarter by default); other engines still open."""
    t = table(max_open_leases=100, max_open_leases_per_engine=3, max_open_leases_per_dp_engine=5)
    for i in range(5):  # big_dp0: 3 (its own share), big_dp1: 2
        open_load(t, f"r{i}", requester=f"req{i}", holder=f"big_dp{i // 3}")
    err = refused(
        t,
        ErrorCode.RESOURCE_EXHAUSTED,
        lambda: open_load(t, "r5", requester="other-req2", holder="big_dp2"),
    )
    assert "engine 'big' (its DP ranks together) has 5 open leases" in err.message
    # A lease between two DP ranks of one engine counts twice: refused at 4 of 5.
    t2 = table(max_open_leases_per_engine=3, max_open_leases_per_dp_engine=5)
    for i in range(4):
        open_load(t2, f"q{i}", requester=f"x{i}", holder=f"big_dp{i // 2}")
    refused(
        t2,
        ErrorCode.RESOURCE_EXHAUSTED,
        lambda: open_load(t2, "q4", requester="big_dp3", holder="big_dp2"),
    )
    # Others are unaffected, and a bare engine id is one engine (its own share only).
    open_load(t, "r5", requester="other-req2", holder="small")
    # The engine's leases ending frees its share.
    t.on_engine_gone("big_dp0", T0 + 1)
    open_load(t, "r6", requester="other-req3", holder="big_dp2")


def test_handoffs_reserved_for_a_decode_count_against_their_prefill_until_begun() -> None:
    """A prefill that reserves handoffs for a decode engine must not fill that engine's
    share (it would lock every other prefill out of it); the share counts once the
    decode begins. And a begin opens no lease: a full table does not refuse it."""

    def handoff(t: LeaseTable, prefill: str, request_id: str, decode: str | None) -> str:
        return t.publish_handoff(
            request_id=request_id,
            prefill_child_engine_id=prefill,
            prefill_rank_keys=TP2[:1],
            rank_key=TP2[0],
            descriptor="d",
            kv_transfer_params=PARAMS,
            decode_child_engine_id=decode,
            num_blocks=1,
            now_ms=T0,
        ).view.lease_id

    def take(t: LeaseTable, prefill: str, request_id: str) -> LeaseStep:
        return t.begin_handoff(
            request_id=request_id,
            prefill_child_engine_id=prefill,
            decode_child_engine_id=DEC,
            decode_rank_keys=TP2,
            now_ms=T0 + 1,
        )

    t = table(max_open_leases_per_engine=2)
    for i in range(2):
        handoff(t, "greedy", f"g{i}", DEC)  # the prefill's share, reserved for DEC
    handoff(t, "honest", "h0", None)
    handoff(t, "honest", "h1", DEC)  # refused before: DEC "had" 2 open leases
    assert take(t, "honest", "h0").view.state is LeaseState.ACTIVE
    assert take(t, "honest", "h1").view.state is LeaseState.ACTIVE
    # DEC's share is now taken by what it began: its next begin is refused, unchanged.
    err = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: take(t, "greedy", "g0"))
    assert f"child engine {DEC!r} has 2 open leases" in err.message
    # The decode's loss ends the handoffs reserved for it (those it began, at their
    # deadline).
    t.on_engine_gone(DEC, T0 + 2)
    t.tick(T0 + 1 + LeaseConfig().handoff_heartbeat_timeout_ms)
    assert t.open_counts_by_engine() == {}

    full = table(max_open_leases=2)
    handoff(full, "p0", "r", None)
    handoff(full, "p1", "r", None)
    assert take(full, "p0", "r").view.state is LeaseState.ACTIVE  # refused before: "2 open"


def test_ended_leases_are_purged_by_age_and_by_count() -> None:
    t = table(terminal_retention_ms=1_000, max_terminal_leases=2)
    ids = [open_load(t, f"r{i}") for i in range(3)]
    t.on_engine_gone(HOLD, T0)  # all three miss at T0
    assert t.retained_lease_count() == 2  # count bound: the oldest went first
    refused(t, ErrorCode.NOT_FOUND, lambda: t.get(ids[0]))
    assert t.find_prefix_load(REQ, "r0") is None
    assert t.next_deadline_ms() == T0 + 1_000
    t.tick(T0 + 999)
    assert t.retained_lease_count() == 2
    t.tick(T0 + 1_000)
    assert t.retained_lease_count() == 0 and t.find_prefix_load(REQ, "r2") is None


# -------------------------------------------------------------------------- handoff


def test_handoff_is_ready_only_when_every_prefill_part_published() -> None:
    t = table()
    first = publish(t, TP2[1], "d1")
    assert first.view.state is LeaseState.WAITING_READY and first.view.flow is Flow.HANDOFF
    assert (first.parts_reported, first.parts_expected) == (1, 2) and first.actions == ()
    lease_id = first.view.lease_id
    err = refused(t, ErrorCode.FAILED_PRECONDITION, lambda: begin(t))
    assert "1 of 2" in err.message
    second = publish(t, TP2[0], "d0", now=T0 + 3)
    assert second.view.state is LeaseState.READY and second.view.lease_id == lease_id
    assert second.actions == (HandoffReady(lease_id, PRE, "h1"),)


def test_begin_hands_over_params_and_descriptors_unchanged() -> None:
    t = table()
    lease_id = begun(t)
    view = t.get(lease_id)
    grant = view.handoff_grant
    assert view.state is LeaseState.ACTIVE and grant is not None
    assert grant.kv_transfer_params == PARAMS and grant.num_blocks == 6
    assert grant.prefill_child_engine_id == PRE and grant.decode_child_engine_id == DEC
    assert [(p.rank_key, p.descriptor) for p in grant.source_parts] == [
        (k, ("desc", k)) for k in TP2
    ]
    assert grant.deadline_ms == T0 + 5 + 10_000
    # Same decode again: the same grant; another decode: refused.
    again = begin(t, now=T0 + 6)
    assert again.view == view and again.actions == ()
    refused(t, ErrorCode.PERMISSION_DENIED, lambda: begin(t, decode="other"))


def test_begin_errors() -> None:
    t = table()
    refused(t, ErrorCode.NOT_FOUND, lambda: begin(t, "none"))
    publish_all(t, "h1", decode=DEC)
    refused(t, ErrorCode.PERMISSION_DENIED, lambda: begin(t, decode="intruder"))
    refused(t, ErrorCode.INVALID_ARGUMENT, lambda: begin(t, decode_grid=()))


def test_prefill_parts_must_agree() -> None:
    t = table()
    publish(t, TP2[0], "d0")
    base: dict[str, Any] = {
        "request_id": "h1",
        "prefill_child_engine_id": PRE,
        "prefill_rank_keys": TP2,
        "rank_key": TP2[1],
        "descriptor": "d1",
        "kv_transfer_params": PARAMS,
        "decode_child_engine_id": None,
        "num_blocks": 6,
        "now_ms": T0,
    }
    changes: list[tuple[str, object]] = [
        ("kv_transfer_params", PARAMS + b"!"),
        ("num_blocks", 7),
        ("decode_child_engine_id", DEC),
        ("prefill_rank_keys", (*TP2, (2, 0, 0))),
    ]
    for field, value in changes:
        changed: dict[str, Any] = {**base, field: value}
        err = refused(t, ErrorCode.FAILED_PRECONDITION, partial(t.publish_handoff, **changed))
        assert field in err.message
    # The same part re-publishing a different descriptor is refused; the same one is a no-op.
    refused(
        t,
        ErrorCode.FAILED_PRECONDITION,
        lambda: t.publish_handoff(**{**base, "rank_key": TP2[0], "descriptor": "other"}),
    )
    assert t.publish_handoff(**{**base, "rank_key": TP2[0], "descriptor": "d0"}).parts_reported == 1
    # A rank outside the grid is a bad request, not a foreign caller (no auth denial).
    err = refused(
        t, ErrorCode.INVALID_ARGUMENT, lambda: t.publish_handoff(**{**base, "rank_key": (9, 0, 0)})
    )
    assert "grid of 2 rank part(s)" in err.message
    refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: t.publish_handoff(**{**base, "request_id": "h2", "kv_transfer_params": "str"}),
    )
    refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: t.publish_handoff(**{**base, "request_id": "h2", "decode_child_engine_id": PRE}),
    )
    refused(
        t,
        ErrorCode.INVALID_ARGUMENT,
        lambda: t.publish_handoff(**{**base, "request_id": "h2", "num_blocks": -1}),
    )


def test_heartbeats_keep_a_handoff_alive_and_silence_aborts_it() -> None:
    t = table()
    lease_id = begun(t)
    deadline = T0 + 5 + 10_000
    assert t.extend_handoff(lease_id, DEC, T0 + 9_000) == T0 + 19_000
    assert t.tick(deadline) == []  # the old deadline no longer fires
    refused(t, ErrorCode.PERMISSION_DENIED, lambda: t.extend_handoff(lease_id, "other", T0 + 9_500))
    refused(t, ErrorCode.NOT_FOUND, lambda: t.extend_handoff("nope", DEC, T0))
    late = refused(
        t, ErrorCode.FAILED_PRECONDITION, lambda: t.extend_handoff(lease_id, DEC, T0 + 19_003)
    )
    # Said in ms a person can read, never a value of kvrc's monotonic clock.
    assert "expired 3 ms before this heartbeat (heartbeat within 10000 ms" in late.message
    actions = t.tick(T0 + 19_000)
    assert t.get(lease_id).state is LeaseState.ABORTING
    assert of(actions, SendRelease) == [] and len(of(actions, SendAbort)) == 2
    assert all(a.child_engine_id == DEC and a.flow is Flow.HANDOFF for a in of(actions, SendAbort))
    refused(t, ErrorCode.FAILED_PRECONDITION, lambda: t.extend_handoff(lease_id, DEC, T0 + 19_001))
    for key in TP2:
        step = t.on_abort_ack(lease_id, DEC, key, T0 + 19_100)
    assert step.view.state is LeaseState.FAILED
    assert [(a.child_engine_id, a.rank_key) for a in of(step.actions, SendRelease)] == [
        (PRE, k) for k in TP2
    ]


def test_extending_in_a_tight_loop_keeps_timer_memory_bounded() -> None:
    t = table()
    lease_id = begun(t)
    for now in range(T0 + 6, T0 + 6 + 20_000):
        t.extend_handoff(lease_id, DEC, now)
    assert t.pending_timer_count() <= 2 * t.retained_lease_count() + 65
    # The live timer survived the compaction: silence still aborts the lease.
    t.tick(T0 + 5 + 20_000 + 10_000)
    assert t.get(lease_id).state is LeaseState.ABORTING


def test_extend_after_the_deadline_or_before_begin_is_refused() -> None:
    t = table()
    lease_id = publish_all(t)
    refused(t, ErrorCode.FAILED_PRECONDITION, lambda: t.extend_handoff(lease_id, DEC, T0))
    lease_id = begun(t, "h2")
    refused(
        t, ErrorCode.FAILED_PRECONDITION, lambda: t.extend_handoff(lease_id, DEC, T0 + 5 + 10_000)
    )


def test_decode_reports_release_the_prefill() -> None:
    t = table()
    lease_id = begun(t)
    t.complete_handoff(lease_id, DEC, TP2[0], Outcome.SUCCEEDED, T0 + 50)
    step = t.complete_handoff(lease_id, DEC, TP2[1], Outcome.SUCCEEDED, T0 + 60)
    assert step.view.state is LeaseState.COMPLETED
    assert [(a.child_engine_id, a.rank_key) for a in of(step.actions, SendRelease)] == [
        (PRE, k) for k in TP2
    ]
    assert of(step.actions, LeaseEnded)[0].quiescence_ms == 55


def test_kept_payload_is_bounded_ended_leases_go_first_then_new_ones_are_refused() -> None:
    """Ended leases kept their kv_transfer_params and descriptors for the whole
    retention: 3.5 MB a handoff, hundreds of GiB within the count bounds."""
    t = table(max_payload_bytes=5_000)
    big = bytes(1_000)

    def handoff(request_id: str) -> str:
        lease_id = ""
        for key in TP2:
            lease_id = publish(t, key, big + bytes([key[0]]), request_id).view.lease_id
        return lease_id

    per_lease = 2 * 1_001 + len(PARAMS)
    first = handoff("h1")
    handoff("h2")
    assert t.payload_bytes == 2 * per_lease
    # Nothing has ended: a third does not fit, and the refusal changes nothing.
    error = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: publish(t, TP2[0], big, "h3"))
    assert "more would pass the limit 5000" in error.message
    # The first ends; it is still kept (retention) until the room is needed.
    begin(t, "h1", now=T0 + 5)
    for key in TP2:
        t.complete_handoff(first, DEC, key, Outcome.SUCCEEDED, T0 + 50)
    assert t.get(first).state is LeaseState.COMPLETED and t.payload_bytes == 2 * per_lease
    handoff("h3")  # the ended lease made room
    assert t.payload_bytes == 2 * per_lease
    assert first not in {v.lease_id for v in t.list_leases(include_terminal=True)}
    # A prefix load's chain counts too.
    open_load(t, "r1")
    assert t.payload_bytes == 2 * per_lease + sum(map(len, CHAIN))


def test_one_engine_cannot_take_the_shared_payload_bound_from_the_others() -> None:
    """What an engine sends (a prefill's parameters and descriptors, a requester's
    chains) counts against its own share while its leases are open: past it that
    engine is refused, another is not, and the holders' answers are not charged."""
    t = table(max_payload_bytes=100_000, max_payload_bytes_per_engine=5_000)
    big = bytes(1_000)
    per_lease = 2 * 1_001 + len(PARAMS)

    def handoff(request_id: str) -> str:
        lease_id = ""
        for key in TP2:
            lease_id = publish(t, key, big + bytes([key[0]]), request_id).view.lease_id
        return lease_id

    first = handoff("h1")
    handoff("h2")
    assert t._open_payload_by_engine == {PRE: 2 * per_lease}
    # PRE's share is full, the table is not: PRE is refused, and nothing changes.
    error = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: publish(t, TP2[0], big, "h3"))
    assert f"child engine {PRE!r}'s open leases keep {2 * per_lease} bytes" in error.message
    assert "per-engine limit 5000" in error.message
    # Another engine's requests still fit; a holder's descriptors are not its own share.
    chain = tuple(bytes([i]) * 500 for i in range(8))
    load = open_load(t, "r1", chain=chain)
    for key in TP2:
        t.on_pin_result(load, HOLD, key, 8, big * 3, T0 + 10)
    assert t._open_payload_by_engine == {PRE: 2 * per_lease, REQ: 4_000}
    assert t.payload_bytes == 2 * per_lease + 4_000 + 6_000
    # A chain past the requester's share is refused, as a prefill's parameters were.
    refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: open_load(t, "r2", chain=chain))
    # An ended lease frees its engine's share (its bytes are kept until room is needed).
    begin(t, "h1", now=T0 + 5)
    for key in TP2:
        t.complete_handoff(first, DEC, key, Outcome.SUCCEEDED, T0 + 50)
    assert t._open_payload_by_engine == {PRE: per_lease, REQ: 4_000}
    assert t.payload_bytes == 2 * per_lease + 10_000
    handoff("h3")
    assert t._open_payload_by_engine[PRE] == 2 * per_lease


def test_flows_never_share_a_lease() -> None:
    t = table()
    load_id = granted_load(t)
    handoff_id = begun(t)
    refused(
        t,
        ErrorCode.NOT_FOUND,
        lambda: t.complete_handoff(load_id, REQ, TP2[0], Outcome.SUCCEEDED, T0),
    )
    refused(
        t,
        ErrorCode.NOT_FOUND,
        lambda: t.complete_prefix_load(handoff_id, DEC, TP2[0], Outcome.SUCCEEDED, T0),
    )
    refused(t, ErrorCode.NOT_FOUND, lambda: t.extend_handoff(load_id, REQ, T0))
    refused(t, ErrorCode.NOT_FOUND, lambda: t.on_pin_result(handoff_id, PRE, TP2[0], 1, None, T0))
    assert t.get(load_id).flow is Flow.PREFIX_LOAD and t.get(handoff_id).flow is Flow.HANDOFF


def test_ready_handoff_never_begun_expires_with_release() -> None:
    t = table(handoff_ready_max_wait_ms=1_000)
    lease_id = publish_all(t)
    assert t.tick(T0 + 999) == []
    actions = t.tick(T0 + 1_000)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert len(of(actions, SendRelease)) == 2


def test_incomplete_handoff_expires_releasing_only_published_parts() -> None:
    t = table(handoff_publish_timeout_ms=1_000)
    published = publish(t, TP2[0], "d0")
    actions = t.tick(T0 + 1_000)
    assert [a.rank_key for a in of(actions, SendRelease)] == [TP2[0]]
    # The missing part arrives late: it sees the end and nothing changes.
    late = publish(t, TP2[1], "d1", now=T0 + 2_000)
    assert late.view.lease_id == published.view.lease_id
    assert late.view.state is LeaseState.FAILED and late.actions == () and late.parts_reported == 1


def test_prefill_gone_fails_without_release_and_stops_the_decode() -> None:
    t = table()
    lease_id = begun(t)
    actions = t.on_engine_gone(PRE, T0 + 100)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert of(actions, SendRelease) == [] and len(of(actions, SendAbort)) == 2


def test_a_prefill_back_from_a_blip_is_told_to_hold_until_the_decode_proves_quiet() -> None:
    """The prefill was proven gone while its decode read (a blip), and is back. Its
    hold's end asks kvrc by repeating its publish: the answer must not be terminal
    while the release waits for the decode's abort acks (I6-quiescence), or it frees
    blocks a hung read may still land on. Once the decode proves quiet, the release
    goes and the answer is the lease's end."""
    t = table(max_terminal_leases=8)
    lease_id = begun(t)
    t.on_engine_gone(PRE, T0 + 100)
    assert t.get(lease_id).state is LeaseState.FAILED
    ended = {LeaseState.COMPLETED, LeaseState.FAILED, LeaseState.RESOLVED, LeaseState.MISSED}

    def repeat(key: RankKey) -> HandoffPublished | None:
        return t.repeated_publish(
            request_id="h1",
            prefill_child_engine_id=PRE,
            rank_key=key,
            descriptor=("desc", key),
            kv_transfer_params=PARAMS,
            decode_child_engine_id=None,
            num_blocks=6,
        )

    for now in range(T0 + 1_000, T0 + 120_000, 10_000):
        t.tick(now)
    # Past the ended leases' retention, and their count (8 here): kept, still RELEASING.
    t.tick(T0 + 100 + LeaseConfig().terminal_retention_ms + 1)
    for i in range(10):
        publish_all(t, f"other{i}")
        begin(t, f"other{i}", decode="other-dec", now=T0 + 200)
    t.on_engine_gone("other-dec", T0 + 300)
    t.tick(T0 + 200 + LeaseConfig().handoff_heartbeat_timeout_ms)  # their deadline
    assert t.retained_lease_count() == 8 + 1
    for key in TP2:
        answer = repeat(key)
        assert answer is not None and answer.view.lease_id == lease_id
        assert answer.view.state is LeaseState.RELEASING and answer.view.state not in ended
    assert t.get(lease_id).state is LeaseState.FAILED  # what status shows is unchanged
    t.on_abort_ack(lease_id, DEC, TP2[0], T0 + 120_000)
    owing = repeat(TP2[1])
    assert owing is not None and owing.view.state is LeaseState.RELEASING  # one part owes
    step = t.on_abort_ack(lease_id, DEC, TP2[1], T0 + 120_001)
    assert len(of(step.actions, SendRelease)) == 2
    settled = repeat(TP2[0])
    assert settled is not None and settled.view.state is LeaseState.FAILED


def test_decode_gone_releases_the_prefill_at_the_leases_deadline() -> None:
    t = table()
    lease_id = begun(t)
    t.complete_handoff(lease_id, DEC, TP2[0], Outcome.SUCCEEDED, T0 + 50)
    assert t.on_engine_gone(DEC, T0 + 100) == []
    # Its heartbeats (unary, not its session) may go on: the deadline moves with them.
    deadline = t.extend_handoff(lease_id, DEC, T0 + 1_000)
    assert t.tick(deadline - 1) == []
    actions = t.tick(deadline)
    assert t.get(lease_id).state is LeaseState.FAILED and len(of(actions, SendRelease)) == 2
    # A report before the deadline ends it as any report does.
    other = table()
    lease_id = begun(other)
    other.on_engine_gone(DEC, T0 + 100)
    other.complete_handoff(lease_id, DEC, TP2[0], Outcome.SUCCEEDED, T0 + 200)
    step = other.complete_handoff(lease_id, DEC, TP2[1], Outcome.SUCCEEDED, T0 + 300)
    assert step.view.state is LeaseState.COMPLETED and len(of(step.actions, SendRelease)) == 2


def test_heartbeats_keep_a_handoff_alive_only_up_to_its_maximum_lifetime() -> None:
    """A decode whose keepalive outlives a stuck read must not pin the prefill's blocks
    for ever: past `handoff_max_lifetime_ms` after its begin, a heartbeat is refused and
    the lease aborts at its last deadline, as a silent one does."""
    t = table(handoff_max_lifetime_ms=30_000)
    lease_id = begun(t)  # begun at T0 + 5
    now = T0 + 5
    deadlines = []
    while now < T0 + 5 + 30_000:
        deadlines.append(t.extend_handoff(lease_id, DEC, now))
        now += 3_000
    assert deadlines[-1] == T0 + 5 + 30_000  # clamped: never past the maximum
    err = refused(t, ErrorCode.FAILED_PRECONDITION, lambda: t.extend_handoff(lease_id, DEC, now))
    assert "its maximum of 30000 ms (--handoff-max-lifetime-ms)" in err.message
    actions = t.tick(T0 + 5 + 30_000)
    assert t.get(lease_id).state is LeaseState.ABORTING and len(of(actions, SendAbort)) == 2
    with pytest.raises(ValueError, match="at least handoff_heartbeat_timeout_ms"):
        LeaseConfig(handoff_max_lifetime_ms=5_000)


def test_a_refused_begin_never_hands_the_lease_id_to_its_caller() -> None:
    # A lease id is what a party acts on a lease with (and, after a restart, reports on
    # it with): a begin refused to another engine names the handoff by its request.
    t = table()
    reserved = publish_all(t, "h-reserved", decode=DEC)
    taken = publish_all(t, "h-taken")
    begin(t, "h-taken")
    waiting = publish(t, TP2[0], ("desc", TP2[0]), "h-waiting").view.lease_id
    for request_id, lease_id, code in (
        ("h-reserved", reserved, ErrorCode.PERMISSION_DENIED),
        ("h-taken", taken, ErrorCode.PERMISSION_DENIED),
        ("h-waiting", waiting, ErrorCode.FAILED_PRECONDITION),
    ):
        error = refused(t, code, partial(begin, t, request_id, decode="intruder"))
        assert lease_id not in error.message and repr(request_id) in error.message


def test_reserved_decode_gone_before_begin_releases_the_prefill() -> None:
    t = table()
    lease_id = publish_all(t, decode=DEC)
    assert [v.lease_id for v in t.leases_of(DEC)] == [lease_id]
    actions = t.on_engine_gone(DEC, T0 + 100)
    assert t.get(lease_id).state is LeaseState.FAILED and len(of(actions, SendRelease)) == 2


def test_abort_engine_for_drain() -> None:
    t = table()
    pinning = open_load(t, "p")
    active = granted_load(t, "a")
    ready = publish_all(t, "h-ready", decode=HOLD)
    quarantined = granted_load(t, "q")
    for key in TP2:
        t.complete_prefix_load(quarantined, REQ, key, Outcome.UNKNOWN, T0 + 20)
    assert {v.lease_id for v in t.leases_of(HOLD)} == {pinning, active, ready, quarantined}
    actions = t.abort_engine(HOLD, T0 + 100)
    assert t.get(pinning).state is LeaseState.MISSED
    assert t.get(pinning).miss_reason is MissReason.DRAINING
    assert t.get(active).state is LeaseState.ABORTING
    assert t.get(ready).state is LeaseState.FAILED
    assert t.get(quarantined).state is LeaseState.QUARANTINED
    released = {(a.lease_id, a.child_engine_id) for a in of(actions, SendRelease)}
    assert released == {(pinning, HOLD), (ready, PRE)}
    assert {a.lease_id for a in of(actions, SendAbort)} == {active}
    assert {v.lease_id for v in t.leases_of(HOLD)} == {active, quarantined}


def test_counts_and_listing_follow_states() -> None:
    t = table()
    open_load(t, "p")
    granted_load(t, "a")
    publish_all(t, "h")
    assert t.counts() == {
        (Flow.PREFIX_LOAD, LeaseState.PINNING): 1,
        (Flow.PREFIX_LOAD, LeaseState.ACTIVE): 1,
        (Flow.HANDOFF, LeaseState.READY): 1,
    }
    assert len(t.list_leases()) == 3 and t.open_lease_count() == 3
    assert t.open_counts_by_engine() == {REQ: 2, HOLD: 2, PRE: 1}
    t.on_engine_gone(HOLD, T0 + 1)
    assert [v.state for v in t.list_leases()] == [LeaseState.READY]
    assert len(t.list_leases(include_terminal=True)) == 3
    assert t.open_counts_by_engine() == {PRE: 1}


def test_lease_config_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match="abort_timeout_ms"):
        LeaseConfig(abort_timeout_ms=0)


def test_reused_lease_id_from_the_factory_is_an_internal_error() -> None:
    t = LeaseTable(id_factory=lambda: "same")
    open_load(t, "a")
    with pytest.raises(RuntimeError):
        open_load(t, "b")
    assert t.open_lease_count() == 1


class _CountingDict(dict[str, int]):
    """Counts the entries written and any walk over the whole dict."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.walks = 0

    def __setitem__(self, key: str, value: int) -> None:
        self.writes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        self.writes += 1
        super().__delitem__(key)

    def __iter__(self) -> Any:
        self.walks += 1
        return super().__iter__()


def test_open_counts_per_engine_are_kept_per_change_not_rebuilt() -> None:
    t = table()
    counts = _CountingDict()
    # White box: the table's per-engine counts, swapped for one that counts its writes.
    t._open_by_engine = counts
    t._open_by_engine_view = MappingProxyType(counts)
    view = t.open_counts_by_engine()
    holders = [f"holder-{i}" for i in range(500)]
    for i, holder in enumerate(holders):
        open_load_step(t, f"r{i}", holder=holder)
    # One open touches two entries (requester and holder), whatever is open already.
    assert counts.writes == 2 * len(holders)
    assert t.open_counts_by_engine() is view  # the same live view: nothing is rebuilt
    assert view[REQ] == len(holders) and view["holder-7"] == 1 and len(view) == 501
    counts.writes = 0
    t.on_engine_gone("holder-7", T0 + 1)  # its one lease ends
    assert counts.writes == 2  # the requester's count and the holder's removal
    assert "holder-7" not in view and view[REQ] == len(holders) - 1
    assert counts.walks == 0


def recovered(t: LeaseTable, lease_id: str, holder: str = HOLD) -> LeaseStep:
    """`holder`'s first part re-announces `lease_id` (after a coordinator restart)."""
    return t.recover_held(
        lease_id=lease_id,
        holder_child_engine_id=holder,
        holder_rank_keys=TP2,
        rank_key=TP2[0],
        now_ms=T0,
    )


def test_made_up_held_ids_take_a_quarter_of_recovery_never_a_holders_verified_ids() -> None:
    """Untagged ids filled all 16,384 recovered slots, and a real holder re-announcing
    its own (verifiable) lease after the restart was refused RESOURCE_EXHAUSTED."""
    key = bytes(range(32))
    before = LeaseTable(LeaseConfig())
    before.set_id_key(key)
    real = [open_load(before, f"r{i}") for i in range(3)]  # issued to HOLD, tagged
    config = LeaseConfig(max_recovered_leases=8, max_unverified_recovered_leases=2)
    t = LeaseTable(config)  # the restarted coordinator, the same key (state file)
    t.set_id_key(key)
    recover = partial(recovered, t)
    for i in range(2):
        assert recover(f"pl-made-up-{i}", f"squatter-{i}").view.state is LeaseState.QUARANTINED
    e = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: recover("pl-made-up-2", "squatter-2"))
    assert "2 leases rebuilt from ids this coordinator's key cannot check" in e.message
    for lease_id in real:  # the holder's own ids still find room
        assert recover(lease_id).view.state is LeaseState.QUARANTINED
    t.resolve_quarantine("pl-made-up-0", T0 + 1)  # one resolved: another may be rebuilt
    assert recover("pl-made-up-3", "squatter-3").view.state is LeaseState.QUARANTINED


def test_one_holder_cannot_take_the_unverified_recovered_bound_from_the_others() -> None:
    """One Register naming made-up ids took every unverified slot (4,096): after a
    restart without a state file every real id is unverifiable too, and another
    holder's real leases were not rebuilt."""
    config = LeaseConfig(
        max_unverified_recovered_leases=8, max_unverified_recovered_leases_per_engine=2
    )
    t = LeaseTable(config)
    recover = partial(recovered, t)
    for i in range(2):
        assert recover(f"pl-made-up-{i}", "squatter").view.state is LeaseState.QUARANTINED
    e = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: recover("pl-made-up-2", "squatter"))
    assert "per-engine limit" in e.message
    assert recover("pl-real-0", HOLD).view.state is LeaseState.QUARANTINED  # another's
    t.resolve_quarantine("pl-made-up-0", T0 + 1)  # one resolved: its holder may again
    assert recover("pl-made-up-3", "squatter").view.state is LeaseState.QUARANTINED


def test_an_engines_dp_ranks_share_its_unverified_recovered_bound() -> None:
    """The per-engine bound counted child engines: an engine with 64 DP ranks (each
    its own child engine, `x_dp<rank>`) could stack 64 shares and take the whole bound
    from the other engines."""
    config = LeaseConfig(
        max_unverified_recovered_leases=8, max_unverified_recovered_leases_per_engine=2
    )
    t = LeaseTable(config)
    recover = partial(recovered, t)
    assert recover("pl-made-up-0", "squatter_dp0").view.state is LeaseState.QUARANTINED
    assert recover("pl-made-up-1", "squatter_dp1").view.state is LeaseState.QUARANTINED
    e = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: recover("pl-made-up-2", "squatter_dp2"))
    assert "engine 'squatter' (its DP ranks together)" in e.message
    assert recover("pl-real-0", HOLD).view.state is LeaseState.QUARANTINED  # another engine
    t.resolve_quarantine("pl-made-up-1", T0 + 1)  # one resolved: a rank of it may again
    assert recover("pl-made-up-3", "squatter_dp5").view.state is LeaseState.QUARANTINED


def test_recovered_leases_are_bounded_and_never_take_the_table_from_live_grants() -> None:
    """Held ids a part re-announces are rebuilt QUARANTINED; made-up ones, from engines
    whose credential allows many child engines, must not fill the table (I8-bad-input)."""
    t = table(max_recovered_leases=3, max_open_leases=8)
    recover = partial(recovered, t)
    for i in range(3):
        assert recover(f"pl-{i}", f"h{i}").view.state is LeaseState.QUARANTINED
    e = refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: recover("pl-x", "h9"))
    assert "3 recovered leases are open" in e.message
    # Live grants still find room.
    assert t.get(open_load(t)).state is LeaseState.PINNING
    # One recovered lease resolved by the operator: another may be rebuilt.
    t.resolve_quarantine("pl-0", T0 + 1)
    assert recover("pl-y", "h9").view.state is LeaseState.QUARANTINED


@pytest.mark.parametrize("ended_by", ["operator", "holder gone"])
def test_a_late_report_on_an_ended_recovered_lease_binds_no_target(ended_by: str) -> None:
    """A recovered lease gets its target from the first report. One that came after the
    lease had ended bound it anyway: the ended lease stayed indexed under the reporter,
    counted as its open lease for good, and once purged every call that reads the
    reporter's leases (its next registration, its drain, its going) raised KeyError."""
    t = table(terminal_retention_ms=1_000)
    recovered(t, "pl-late")
    if ended_by == "operator":
        t.resolve_quarantine("pl-late", T0 + 1)
    else:
        t.on_engine_gone(HOLD, T0 + 1)
    ended = t.get("pl-late").state
    assert ended in (LeaseState.RESOLVED, LeaseState.FAILED)
    late = t.complete_prefix_load(
        "pl-late", REQ, TP2[0], Outcome.SUCCEEDED, T0 + 2, reporter_rank_keys=TP2
    )
    assert late.view.state is ended and late.actions == ()
    assert late.view.target_child_engine_id is None
    assert dict(t.open_counts_by_engine()) == {} and t.leases_of(REQ) == []
    t.tick(T0 + 5_000)  # purged
    assert not t.knows("pl-late")
    assert t.leases_of(REQ) == [] and t.on_engine_gone(REQ, T0 + 6_000) == []


def test_a_quarantine_whose_holder_is_declared_gone_is_released_once_proven_quiet() -> None:
    """A quarantined lease whose holder was declared gone (maybe a blip) ended with no
    release decided: the requester's proof was ignored, the holder back re-announcing
    got nothing, and ResolveQuarantine refused an ended lease, so its pins stayed."""
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[1], Outcome.SUCCEEDED, T0 + 50)
    quarantined = t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 60)
    assert quarantined.view.state is LeaseState.QUARANTINED
    assert [a.rank_key for a in of(quarantined.actions, SendAbort)] == [TP2[0]]
    gone = t.on_engine_gone(HOLD, T0 + 100)
    assert t.get(lease_id).state is LeaseState.FAILED
    assert of(gone, SendRelease) == []  # TP2[0] may still read (I6-quiescence)
    assert reannounce(t, lease_id, TP2[0]) == []
    # The requester's ack is the proof: the release is decided then, and re-sent.
    proven = t.on_abort_ack(lease_id, REQ, TP2[0], T0 + 200)
    assert [a.rank_key for a in of(proven.actions, SendRelease)] == list(TP2)
    assert reannounce(t, lease_id, TP2[1]) == [("SendRelease", TP2[1])]


def test_a_quarantine_ended_by_its_holders_going_is_never_released_by_its_requesters() -> None:
    """Its holder gone first (the quarantine then awaits proofs), then its requester: the
    requester's going released the pins though the abort it never acknowledged is the
    sign of a hung read (a quarantine whose target goes is the operator's call)."""
    t = table(abort_timeout_ms=1_000)
    lease_id = granted_load(t)
    t.tick(T0 + 10 + 5_000)  # the TTL: aborts to both parts
    t.tick(T0 + 10 + 6_000)  # never acknowledged: quarantined
    assert t.get(lease_id).state is LeaseState.QUARANTINED
    assert of(t.on_engine_gone(HOLD, T0 + 7_000), SendRelease) == []
    assert of(t.on_engine_gone(REQ, T0 + 8_000), SendRelease) == []
    assert reannounce(t, lease_id, TP2[0]) == []


def test_a_quarantine_with_no_proof_to_await_still_fails_closed_when_its_holder_goes() -> None:
    t = table()
    lease_id = granted_load(t)
    t.complete_prefix_load(lease_id, REQ, TP2[0], Outcome.UNKNOWN, T0 + 50)
    t.on_engine_gone(REQ, T0 + 60)  # the requester gone: nobody left to prove anything
    assert t.get(lease_id).state is LeaseState.QUARANTINED
    gone = t.on_engine_gone(HOLD, T0 + 100)
    assert t.get(lease_id).state is LeaseState.FAILED and of(gone, SendRelease) == []
    assert reannounce(t, lease_id, TP2[0]) == []


def test_a_holders_descriptor_past_the_payload_bound_is_refused_and_the_pin_times_out() -> None:
    """A pin's answer was kept unchecked: one holder answering with large descriptors
    took the table past max_payload_bytes, and every later request was refused."""
    t = table(max_payload_bytes=1_000)
    lease_id = open_load(t)
    error = refused(
        t,
        ErrorCode.RESOURCE_EXHAUSTED,
        lambda: t.on_pin_result(lease_id, HOLD, TP2[0], 8, bytes(5_000), T0 + 10),
    )
    assert "5000 more would pass the limit 1000" in error.message
    assert t.payload_bytes == sum(map(len, CHAIN))
    # A descriptor that fits is taken; the refused part is released at the pin timeout.
    t.on_pin_result(lease_id, HOLD, TP2[1], 8, bytes(100), T0 + 20)
    actions = t.tick(T0 + 500)
    assert t.get(lease_id).miss_reason is MissReason.PIN_TIMEOUT
    assert [a.rank_key for a in of(actions, SendRelease)] == list(TP2)


def test_a_grant_larger_than_one_message_is_a_miss_or_a_refused_publish() -> None:
    """Each part's descriptor was checked alone (about 2.5 MB each on the wire), and a
    grant carries them all: eight holder parts made a grant over gRPC's message limit,
    which failed to send after the lease was granted, the blocks pinned for nobody. A
    prefix load whose parts' descriptors pass the grant's bound is a miss now, and a
    handoff publish that would pass it is refused, changing nothing."""
    t = table(max_grant_payload_bytes=1_000)
    lease_id = open_load(t)
    t.on_pin_result(lease_id, HOLD, TP2[0], 8, bytes(600), T0 + 10)
    assert t.get(lease_id).state is LeaseState.PINNING  # 600 of 1,000: waits for the rest
    step = t.on_pin_result(lease_id, HOLD, TP2[1], 8, bytes(600), T0 + 20)
    assert t.get(lease_id).miss_reason is MissReason.GRANT_TOO_LARGE
    assert [a.rank_key for a in of(step.actions, SendRelease)] == list(TP2)
    # Control: the same pins within the bound are granted.
    fits = open_load(t, "r2")
    for key in TP2:
        t.on_pin_result(fits, HOLD, key, 8, bytes(400), T0 + 30)
    assert t.get(fits).state is LeaseState.ACTIVE

    # A handoff: kv_transfer_params and every part's descriptor travel in its grant.
    publish(t, TP2[0], bytes(500), "h-big")
    error = refused(
        t, ErrorCode.RESOURCE_EXHAUSTED, lambda: publish(t, TP2[1], bytes(500), "h-big")
    )
    assert "more than one grant may carry (1000)" in error.message
    refused(t, ErrorCode.RESOURCE_EXHAUSTED, lambda: publish(t, TP2[0], bytes(1_000), "h-new"))
    publish(t, TP2[1], bytes(100), "h-big")  # control: one that fits completes it
    ready = t.find_handoff(PRE, "h-big")
    assert ready is not None and ready.state is LeaseState.READY


def test_a_pins_deadline_is_never_before_the_lease_can_be_quarantined() -> None:
    """The holder's safety net frees a pin a grace after its deadline. The deadline was
    pin timeout + TTL: a load granted at the end of its pin timeout, whose abort went
    unacknowledged, was quarantined a whole abort timeout later, as late as the net
    (I6-quiescence: the net must never free what kvrc may still quarantine)."""
    t = table(abort_timeout_ms=90_000)
    step = open_load_step(t, pin_timeout_ms=500, transfer_ttl_ms=5_000)
    deadline = of(step.actions, SendPin)[0].deadline_ms
    lease_id = step.view.lease_id
    for key in TP2:
        t.on_pin_result(lease_id, HOLD, key, 8, None, T0 + 499)  # granted at the last ms
    t.tick(T0 + 499 + 5_000)  # the TTL: aborts
    assert t.get(lease_id).state is LeaseState.ABORTING
    quarantined_at = T0 + 499 + 5_000 + 90_000
    t.tick(quarantined_at - 1)
    assert t.get(lease_id).state is LeaseState.ABORTING
    actions = t.tick(quarantined_at)
    assert t.get(lease_id).state is LeaseState.QUARANTINED and of(actions, SendQuarantine)
    assert quarantined_at <= deadline == T0 + 500 + 5_000 + 90_000
