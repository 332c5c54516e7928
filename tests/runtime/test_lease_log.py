"""What an engine's leases make kvrc log is bounded (I8-bad-input): handoffs opened
and abandoned in a loop are each counted, but their lines share one budget."""

from __future__ import annotations

import logging

import pytest
from manual_rig import drain_outbound, manual_coordinator

from coordinator.core.grants import BeginHandoffRequest, PublishHandoffRequest
from coordinator.core.leases import SendAbort
from coordinator.runtime.log_limit import LIFECYCLE_BURST


async def test_abandoned_handoffs_in_a_loop_are_counted_not_each_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One engine's two DP ranks publish and begin handoffs, never heartbeat, and ack
    every abort: one abort line each, past the budget's burst only counted."""
    handoffs = LIFECYCLE_BURST + 100
    # The decode's session queue holds every abort of the one tick that aborts them all.
    async with manual_coordinator(session_queue_size=4 * handoffs) as rig:
        flow = rig.coordinator.leases
        prefill, decode = rig.register("eng_dp0"), rig.register("eng_dp1")
        for i in range(handoffs):
            request = PublishHandoffRequest(f"h{i}", "eng_dp0", (0, 0, 0), b"d", b"p", "eng_dp1", 1)
            flow.publish_handoff(request)
            await flow.begin_handoff(BeginHandoffRequest(f"h{i}", "eng_dp0", "eng_dp1", 0))
        with caplog.at_level(logging.INFO, logger="kvrc.leases"):
            await rig.advance(11_000, prefill, decode)  # no ExtendHandoff: every lease aborts
            aborts = [m for m in drain_outbound(decode) if isinstance(m, SendAbort)]
            for abort in aborts:
                rig.coordinator.on_abort_ack(decode.ref, abort.lease_id)
        assert len(aborts) == handoffs
        aborted = rig.coordinator.metrics.registry.get_sample_value(
            "kvrc_lease_aborts_total", {"flow": "handoff"}
        )
        assert aborted == handoffs  # the metric counts every one
    lines = [r.getMessage() for r in caplog.records if r.name == "kvrc.leases"]
    assert len([m for m in lines if m.startswith("aborting handoff lease")]) == LIFECYCLE_BURST
    assert len([m for m in lines if "lease lines are over their budget" in m]) == 1
