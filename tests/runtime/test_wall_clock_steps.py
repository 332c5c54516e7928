"""A step of the host's wall clock expires nothing; every deadline holds on monotonic time.

The coordinator runs in process on a manual clock (tests/support/manual_rig.py): the
test steps the wall clock by an hour either way while a prefix-load lease, a waiting
handoff begin and engine sessions are live, and moves monotonic time explicitly.
"""

from __future__ import annotations

import asyncio

import pytest
from manual_rig import CHAIN, drain_outbound, manual_coordinator, settle

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import BeginHandoffRequest, PrefixLoadRequest
from coordinator.core.leases import LeaseState, SendAbort, SendPin
from coordinator.edges import grpc_wire as wire

HOUR_MS = 3_600_000


async def test_wall_steps_expire_no_lease_and_the_ttl_still_ends_it_on_time() -> None:
    async with manual_coordinator(heartbeat_timeout_ms=5_000) as rig:
        c = rig.coordinator
        holder, requester = rig.register("holder"), rig.register("req")
        rig.store(holder)
        drain_outbound(holder)
        ask = asyncio.ensure_future(
            c.leases.request_prefix_load(
                PrefixLoadRequest("r1", "req", CHAIN, "", 1, 0, 2_000, 10_000)
            )
        )
        await settle()
        (pin,) = [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
        c.leases.on_pin_result("holder", (0, 0, 0), pin.lease_id, len(CHAIN), b"d", "")
        answer = await ask
        assert answer.view is not None and answer.view.prefix_load_grant is not None
        lease_id, deadline = pin.lease_id, answer.view.prefix_load_grant.deadline_ms
        assert deadline == rig.clock.monotonic_ms() + 10_000

        for step in (HOUR_MS, -2 * HOUR_MS, HOUR_MS):
            rig.clock.step_wall(step)
            await rig.advance(2_000, holder, requester)
            view = c.leases.table.get(lease_id)
            assert view.state is LeaseState.ACTIVE, step
            assert c.registry.num_parts == 2, step
            # The wire tells the deadline in the wall time of the moment it encodes.
            left = deadline - rig.clock.monotonic_ms()
            status = wire.lease_status_to_proto(view, rig.clock)
            assert status.deadline_unix_ms == rig.clock.wall_ms() + left

        # Nothing outlives its monotonic deadline either: the TTL aborts exactly at it.
        await rig.advance(deadline - rig.clock.monotonic_ms() - 1, holder, requester)
        assert c.leases.table.get(lease_id).state is LeaseState.ACTIVE
        drain_outbound(requester)
        await rig.advance(1, holder, requester)
        assert c.leases.table.get(lease_id).state is LeaseState.ABORTING
        assert any(isinstance(m, SendAbort) for m in drain_outbound(requester))


async def test_wall_steps_do_not_remove_a_silent_part_early_or_late() -> None:
    async with manual_coordinator(heartbeat_timeout_ms=5_000) as rig:
        c = rig.coordinator
        silent, beating = rig.register("silent"), rig.register("beating")
        rig.clock.step_wall(-HOUR_MS)
        await rig.advance(4_000, beating)  # silent for 4 s of a 5 s timeout
        assert c.registry.get("silent") is not None
        rig.clock.step_wall(2 * HOUR_MS)
        await rig.advance(1_000, beating)  # 5 s: due now, at the latest at the next pass
        await rig.advance(1_000, beating)
        assert c.registry.get("silent") is None
        assert silent.ended and not beating.ended


async def test_wall_steps_do_not_end_a_waiting_handoff_begin_early() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        prefill, decode = rig.register("prefill"), rig.register("decode")
        begin = asyncio.ensure_future(
            c.leases.begin_handoff(BeginHandoffRequest("h1", "prefill", "decode", 3_000))
        )
        await settle()
        rig.clock.step_wall(HOUR_MS)
        await rig.advance(2_999, prefill, decode)
        assert not begin.done()
        await rig.advance(1, prefill, decode)
        with pytest.raises(KvrcError) as info:
            await begin
        assert info.value.code is ErrorCode.DEADLINE_EXCEEDED
        assert "was not READY within 3000 ms" in info.value.message
