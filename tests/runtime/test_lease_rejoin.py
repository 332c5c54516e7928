"""Engines whose session broke and came back, over the runtime on a manual clock.

A session down longer than `session_grace_ms` makes its engine "proven gone", but the
process may be alive (a network blip with the client's reconnect backoff): a holder
back still pinning must get its release once that is safe (I6-quiescence), and a
target part back must be asked again for every abort it owes an ack for.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest
from manual_rig import CHAIN, PROFILE, Rig, drain_outbound, manual_coordinator, settle

from coordinator.core.grants import PrefixLoadRequest, PublishHandoffRequest, TransferReport
from coordinator.core.leases import Flow, LeaseState, Outcome, SendAbort, SendPin, SendRelease
from coordinator.core.registry import HeldLease, RankPartRegistration
from coordinator.runtime import coordinator as coordinator_module
from coordinator.runtime import lease_flow as lease_flow_module
from coordinator.runtime.coordinator import Session, SessionEnd

RANK = (0, 0, 0)


async def granted_load(rig: Rig, holder: Session) -> str:
    c = rig.coordinator
    task = asyncio.ensure_future(
        c.leases.request_prefix_load(PrefixLoadRequest("q1", "r", CHAIN, "", 1, 0, 2_000, 10_000))
    )
    await settle()
    pin = next(m for m in drain_outbound(holder) if isinstance(m, SendPin))
    c.leases.on_pin_result("h", RANK, pin.lease_id, 8, b"d", "")
    answer = await task
    assert answer.view is not None and answer.view.state is LeaseState.ACTIVE
    return answer.view.lease_id


async def load_in_flight(rig: Rig) -> tuple[Session, Session, str]:
    """Holder `h` and requester `r` registered, and a prefix load from h to r granted."""
    holder, requester = rig.register("h"), rig.register("r")
    rig.store(holder)
    drain_outbound(holder)
    return holder, requester, await granted_load(rig, holder)


def sent(session: Session, kind: type[SendAbort | SendRelease]) -> list[str]:
    """The lease ids of `kind` the session was sent; releases are acknowledged, as a
    holder acknowledges them once its pins are free (revision 4)."""
    lease_ids = [m.lease_id for m in drain_outbound(session) if isinstance(m, kind)]
    if kind is SendRelease:
        for lease_id in lease_ids:
            session.release_acked(lease_id)
    return lease_ids


def released(session: Session) -> list[str]:
    """The releases the session was sent, read but not acknowledged."""
    return [m.lease_id for m in drain_outbound(session) if isinstance(m, SendRelease)]


def holder_back(rig: Rig, lease_id: str) -> Session:
    reg = RankPartRegistration("h", 0, "h", RANK, PROFILE, held_leases=(HeldLease(lease_id),))
    return rig.coordinator.open_session(reg)


async def test_a_holder_back_after_its_grace_gets_its_release_once_the_reads_are_quiet() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, requester, lease_id = await load_in_flight(rig)
        c.close_session(holder, "closed")  # the holder's stream breaks...
        await rig.advance(2_500, requester)  # ...and it reconnects after the grace
        assert c.leases.table.get(lease_id).state is LeaseState.FAILED
        assert sent(requester, SendAbort) == [lease_id]  # told to stop reading
        # Back and re-announcing while the requester may still read: it keeps its pins.
        holder = holder_back(rig, lease_id)
        await settle()
        assert sent(holder, SendRelease) == []
        # The requester's ack proves its reads quiet: the release reaches the holder.
        c.leases.on_abort_ack("r", RANK, lease_id)
        assert sent(holder, SendRelease) == [lease_id]
        # Its stream breaks again before it read the release: it re-announces, gets it again.
        c.close_session(holder, "closed")
        holder = holder_back(rig, lease_id)
        await settle()
        assert sent(holder, SendRelease) == [lease_id]


async def test_a_requester_back_from_a_blip_is_asked_again_for_the_abort_it_owes() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, requester, lease_id = await load_in_flight(rig)
        c.close_session(requester, "closed")  # the requester's session blips
        report = TransferReport(lease_id, "r", RANK, Outcome.UNKNOWN, 0, 0, "read timed out")
        assert c.leases.complete_prefix_load(report).state is LeaseState.QUARANTINED
        await rig.advance(500, holder)  # the quarantine's abort found no session
        requester = rig.register("r")  # back within the grace: alive
        await settle()
        assert sent(requester, SendAbort) == [lease_id]
        drain_outbound(holder)
        c.leases.on_abort_ack("r", RANK, lease_id)  # its reads are quiet
        assert c.leases.table.get(lease_id).state is LeaseState.FAILED
        assert sent(holder, SendRelease) == [lease_id]


async def test_the_leases_gauge_counts_a_handoff_waiting_for_its_parts() -> None:
    tp2 = replace(PROFILE, tp_size=2)
    async with manual_coordinator() as rig:
        c = rig.coordinator
        ranks = ((0, 0, 0), (1, 0, 0))
        parts = [c.open_session(RankPartRegistration("p", 0, "p", r, tp2)) for r in ranks]
        decode = rig.register("d")
        gauge = c.metrics.leases.labels(flow="handoff", state="waiting_ready")
        # The first part's publish admits the lease with no action to execute.
        out = await c.publish_handoff(PublishHandoffRequest("q", "p", ranks[0], b"x", b"", "d", 1))
        assert out.state is LeaseState.WAITING_READY
        assert c.leases.table.counts() == {(Flow.HANDOFF, LeaseState.WAITING_READY): 1}
        assert gauge._value.get() == 1
        # Its publish timeout is armed too: the lease ends, and the gauge follows.
        await rig.advance(
            c.leases.table.config.handoff_publish_timeout_ms + 1_000, *parts, decode, step_ms=5_000
        )
        assert c.leases.table.get(out.lease_id).state is LeaseState.FAILED
        assert gauge._value.get() == 0


async def test_a_part_naming_more_held_leases_than_its_queue_holds_still_registers(
    caplog: object,
) -> None:
    """After a restart a part re-announces every lease it holds: each is answered on its
    stream, so more of them than `session_queue_size` closed the new session before the
    part read anything, on every retry (I8-bad-input's bounds must fit together)."""
    import logging

    import pytest

    assert isinstance(caplog, pytest.LogCaptureFixture)
    held = tuple(f"pl-{i:032x}" for i in range(40))
    async with manual_coordinator(session_queue_size=16) as rig:
        caplog.set_level(logging.WARNING)
        reg = RankPartRegistration(
            "h", 0, "h", RANK, PROFILE, held_leases=tuple(map(HeldLease, held))
        )
        session = rig.coordinator.open_session(reg)
        await settle()
        assert not session.ended
        out = drain_outbound(session)
        assert len(out) == 1 + len(held)  # the RegisterAck and one notice per lease
        assert [v.state for v in rig.coordinator.leases.open_leases()] == [
            LeaseState.QUARANTINED
        ] * len(held)
        # One log line for the Register, not two per lease.
        lines = [r for r in caplog.records if "re-announced" in r.getMessage()]
        assert len(lines) == 1 and "40 QUARANTINED" in lines[0].getMessage()
        assert not [r for r in caplog.records if "quarantined:" in r.getMessage()]
        # Control: past the registration the queue's bound holds again.
        for _ in range(16 + len(held) + 1):
            if not session.offer(out[0]):  # type: ignore[arg-type]
                break
        else:
            raise AssertionError("the queue never filled")


async def test_a_repeated_publish_is_answered_while_a_sibling_part_reconnects() -> None:
    """A part publishes again when its first answer was lost, often while a sibling part
    reconnects: kvrc answered FAILED_PRECONDITION (prefill not READY) though it had the
    part, so the holder never learnt the lease id that lets kvrc's release reach it."""
    from coordinator.core.errors import ErrorCode, KvrcError

    tp2 = replace(PROFILE, tp_size=2)
    async with manual_coordinator() as rig:
        c = rig.coordinator
        ranks = ((0, 0, 0), (1, 0, 0))
        parts = [c.open_session(RankPartRegistration("p", 0, "p", r, tp2)) for r in ranks]
        rig.register("d")
        publish = [
            PublishHandoffRequest("q", "p", r, b"x%d" % i, b"", "d", 1) for i, r in enumerate(ranks)
        ]
        for request in publish:
            first = await c.publish_handoff(request)
        assert first.state is LeaseState.READY
        c.close_session(parts[1], "a blip")  # the sibling reconnects: p is not READY
        await settle()
        again = await c.publish_handoff(publish[0])
        assert (again.state, again.lease_id) == (LeaseState.READY, first.lease_id)
        assert c.leases.table.get(first.lease_id).state is LeaseState.READY  # unchanged
        # Anything but a word-for-word repeat still needs a READY prefill.
        for changed in (
            replace(publish[0], descriptor=b"other"),
            replace(publish[0], request_id="n"),
        ):
            try:
                await c.publish_handoff(changed)
            except KvrcError as e:
                assert e.code is ErrorCode.FAILED_PRECONDITION and "not READY" in e.message
            else:
                raise AssertionError(f"{changed} was answered while p is not READY")


async def test_releases_that_found_the_holder_between_sessions_go_when_it_registers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ended while the holder had no session: kept, and sent when it registers again,
    even without re-announcing them. Kept at most MAX_UNSENT_RELEASES (oldest dropped)."""
    monkeypatch.setattr(lease_flow_module, "MAX_UNSENT_RELEASES", 2)
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, _, first = await load_in_flight(rig)
        later = []
        for request_id in ("q2", "q3"):
            task = asyncio.ensure_future(
                c.leases.request_prefix_load(
                    PrefixLoadRequest(request_id, "r", CHAIN, "", 1, 0, 2_000, 10_000)
                )
            )
            await settle()
            pin = next(m for m in drain_outbound(holder) if isinstance(m, SendPin))
            c.leases.on_pin_result("h", RANK, pin.lease_id, 8, b"d", "")
            answer = await task
            assert answer.view is not None
            later.append(answer.view.lease_id)
        c.close_session(holder, "closed")  # between sessions, inside its grace
        for lease_id in (first, *later):
            report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
            assert c.leases.complete_prefix_load(report).quiescent
        back = rig.register("h")
        await settle()
        assert sent(back, SendRelease) == later  # the oldest went: two are kept
        c.close_session(back, "closed")
        again = rig.register("h")
        await settle()
        assert sent(again, SendRelease) == []  # delivered once: not kept any more


async def test_a_lease_whose_release_is_kept_is_not_rebuilt_when_its_holder_names_it() -> None:
    """Ended while the holder had no session, and purged from the table before it came
    back naming it: the kept release is the answer, not a rebuilt QUARANTINED copy
    (before: rebuilt, and the release then freed the pins while the copy waited for an
    operator)."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, _, lease_id = await load_in_flight(rig)
        c.close_session(holder, "closed")
        report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
        assert c.leases.complete_prefix_load(report).quiescent
        await rig.advance(c.leases.table.config.terminal_retention_ms + 1, step_ms=60_000)
        assert not c.leases.table.knows(lease_id), "not purged: the case is not set up"
        back = holder_back(rig, lease_id)
        await settle()
        assert sent(back, SendRelease) == [lease_id]
        assert not c.leases.table.knows(lease_id), "rebuilt although its release was kept"


async def test_a_release_unread_when_the_holders_stream_broke_reaches_its_next_session() -> None:
    """The release was queued on the holder's session, and the stream broke before the
    engine read it: it goes to the part's next session (before: discarded with the
    queue, and the pins waited for the holder's safety net)."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, _, lease_id = await load_in_flight(rig)
        report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
        assert c.leases.complete_prefix_load(report).quiescent  # queued, not read
        c.close_session(holder, "closed")
        back = rig.register("h")
        await settle()
        assert sent(back, SendRelease) == [lease_id]
        c.close_session(back, "closed")  # read and acknowledged this time: not sent again
        again = rig.register("h")
        await settle()
        assert sent(again, SendRelease) == []


async def test_a_release_read_but_not_acknowledged_when_the_stream_broke_comes_again() -> None:
    """The engine read the release off its stream, and the stream broke before its
    ReleaseAck arrived (the engine may not have freed the pins): the part's next
    session gets it again (revision 4; before, only unread releases did, and the pins
    waited for the holder's safety net). Its ack there ends that."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder, _, lease_id = await load_in_flight(rig)
        report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
        assert c.leases.complete_prefix_load(report).quiescent
        assert released(holder) == [lease_id]  # read off the queue, no ack
        c.close_session(holder, "closed")
        back = rig.register("h")
        await settle()
        assert released(back) == [lease_id]
        c.on_release_acks(back, [lease_id])
        c.close_session(back, "closed")
        again = rig.register("h")
        await settle()
        assert sent(again, SendRelease) == []


async def test_a_session_closed_with_unacknowledged_releases_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine that never acknowledges and reconnects in a loop must not fill the log:
    one line per closed session however many releases it takes on (each is kept)."""
    async with manual_coordinator() as rig:
        holder = rig.register("h")
        for i in range(50):
            holder.offer(SendRelease("h", RANK, f"lease-{i}", Flow.PREFIX_LOAD, "released"))
        drain_outbound(holder)
        with caplog.at_level(logging.INFO, logger="kvrc"):
            rig.coordinator.close_session(holder, "closed")
        lines = [r.getMessage() for r in caplog.records if "release" in r.getMessage()]
        assert len(lines) == 1 and "50 release(s) not acknowledged" in lines[0], lines
        back = rig.register("h")
        await settle()
        assert len(sent(back, SendRelease)) == 50  # kept, and sent on


async def test_a_release_no_session_acknowledges_is_given_up_after_max_returns() -> None:
    """An engine that never sends ReleaseAck (and reconnects) must not have its releases
    sent for ever, crowding other parts' kept releases out: each comes back from at most
    MAX_RELEASE_RETURNS sessions, is then given up and counted. An acknowledging holder
    never gets near that (its ack takes ~20 ms)."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder = rig.register("h")
        holder.offer(SendRelease("h", RANK, "lease-x", Flow.PREFIX_LOAD, "released"))
        for _ in range(lease_flow_module.MAX_RELEASE_RETURNS - 1):
            assert released(holder) == ["lease-x"]
            c.close_session(holder, "closed")  # read, never acknowledged
            holder = rig.register("h")
            await settle()
        assert released(holder) == ["lease-x"]
        given_up = c.metrics.releases_given_up
        before = given_up._value.get()
        c.close_session(holder, "closed")
        assert given_up._value.get() == before + 1
        last = rig.register("h")
        await settle()
        assert sent(last, SendRelease) == []


async def test_unacknowledged_releases_a_session_keeps_are_bounded() -> None:
    """An engine that never acknowledges (a client older than revision 4 cannot
    register; a broken one) costs at most MAX_UNACKED_RELEASES entries, and the newest
    are the ones kept."""
    async with manual_coordinator() as rig:
        holder = rig.register("h")
        limit = coordinator_module.MAX_UNACKED_RELEASES
        for i in range(limit + 10):
            holder.offer(SendRelease("h", RANK, f"lease-{i}", Flow.PREFIX_LOAD, "released"))
            drain_outbound(holder)  # read, never acknowledged
        assert not holder.release_acked("lease-9"), "the oldest were to be forgotten"
        assert holder.release_acked("lease-10")
        assert holder.release_acked(f"lease-{limit + 9}")
        unacked = holder.end(SessionEnd(None, ""))
        assert len(unacked) == limit - 2


async def test_a_registrations_held_leases_are_recovered_then_not_kept_with_the_part() -> None:
    """The registry, the session and the peers keep a part's registration for its whole
    life; its held leases (up to 4,096 ids, ~2 MB) went with it, though they are used
    once, at registration: 65,536 parts could hold 128 GB of them."""
    held = tuple(HeldLease(f"pl-made-up-{i}", "r") for i in range(100))
    async with manual_coordinator() as rig:
        c = rig.coordinator
        session = c.open_session(RankPartRegistration("h", 0, "h", RANK, PROFILE, held_leases=held))
        await settle()
        # Recovered (QUARANTINED, as after a restart)...
        assert {c.leases.table.get(h.lease_id).state for h in held} == {LeaseState.QUARANTINED}
        # ...and not kept: neither by the session nor by the registry.
        assert session.registration.held_leases == ()
        part = c.registry._children["h"].parts[RANK]
        assert part.registration.held_leases == ()
