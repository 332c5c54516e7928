"""A coordinator that is shutting down changes no lease (I6-quiescence).

Its sessions end first; a lease that ended after that would send the holder's
release into a closed session, while the reporter, answered "quiescent", would
never tell the next coordinator: the holder's re-announced lease would stay
quarantined. So from the start of the shutdown every lease RPC answers
UNAVAILABLE, changing nothing, and the engine retries at the next coordinator.
"""

from __future__ import annotations

import asyncio

import pytest
from manual_rig import CHAIN, drain_outbound, manual_coordinator
from test_cost_gate import load, register

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import BeginHandoffRequest, PrefixLoadRequest, TransferReport
from coordinator.core.leases import LeaseState, Outcome, SendPin, SendRelease


@pytest.mark.parametrize("closing", [False, True])
async def test_a_report_during_the_shutdown_is_refused_and_changes_nothing(closing: bool) -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder)
        answer = await load(rig, holder, "q1", report=False)
        assert answer.view is not None and answer.view.prefix_load_grant is not None
        lease_id = answer.view.lease_id
        report = TransferReport(lease_id, "r", (0, 0, 0), Outcome.SUCCEEDED, 1, 0, "")
        if not closing:  # the control: the same report ends the lease with a release
            assert c.leases.complete_prefix_load(report).state is LeaseState.COMPLETED
            assert [m for m in drain_outbound(holder) if isinstance(m, SendRelease)]
            return
        c.leases.close_to_changes()
        before = c.status().leases
        for call in (
            lambda: c.leases.complete_prefix_load(report),
            lambda: c.leases.extend_handoff("ho-x", "r"),
            lambda: c.leases.resolve_quarantine(lease_id, "an operator's call"),
        ):
            with pytest.raises(KvrcError) as refused:
                call()
            assert refused.value.code is ErrorCode.UNAVAILABLE
            assert "shutting down" in refused.value.message
        with pytest.raises(KvrcError) as refused_load:
            await c.leases.request_prefix_load(PrefixLoadRequest("q2", "r", CHAIN, "", 1, 0, 0, 0))
        assert refused_load.value.code is ErrorCode.UNAVAILABLE
        assert c.status().leases == before
        assert c.leases.table.get(lease_id).state is LeaseState.ACTIVE
        assert not [m for m in drain_outbound(holder) if isinstance(m, (SendRelease, SendPin))]


async def test_a_begin_waiting_at_the_shutdown_is_told_to_retry_at_the_next_coordinator() -> None:
    """It got DEADLINE_EXCEEDED, as if its wait had run out, and the decode gave the
    handoff up; a waiting prefix load got UNAVAILABLE, which the client retries."""
    async with manual_coordinator() as rig:
        c = rig.coordinator
        register(rig, "dec")
        begin = asyncio.ensure_future(
            c.leases.begin_handoff(BeginHandoffRequest("h1", "pre", "dec", 60_000))
        )
        for _ in range(5):
            await asyncio.sleep(0)
        assert not begin.done()
        await c.leases.shutdown()
        with pytest.raises(KvrcError) as refused:
            await begin
        assert refused.value.code is ErrorCode.UNAVAILABLE
        assert "shutting down: retry at the next one" in refused.value.message
        assert "'h1' of 'pre' was not READY yet" in refused.value.message
