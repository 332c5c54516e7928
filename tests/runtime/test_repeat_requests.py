"""A repeated RequestPrefixLoad (same requester, same request id), through the runtime.

While the lease is open a repeat answers with it (a retry after a lost answer).
Once a granted lease ended its pins are released: a repeat must not hand its
blocks out again (docs/invariants.md, I6-quiescence) and is refused, changing
nothing.
"""

from __future__ import annotations

import pytest
from manual_rig import CHAIN, drain_outbound, manual_coordinator, settle
from test_cost_gate import load, register

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.grants import PrefixLoadRequest
from coordinator.core.leases import LeaseState, SendPin


async def test_a_repeat_of_an_ended_grant_is_refused_and_pins_nothing() -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder)
        first = await load(rig, holder, "q1")  # granted, reported SUCCEEDED
        assert first.view is not None and first.view.prefix_load_grant is not None
        lease_id = first.view.lease_id
        assert c.leases.table.get(lease_id).state is LeaseState.COMPLETED
        drain_outbound(holder)
        before = c.status().leases
        request = PrefixLoadRequest("q1", "r", CHAIN, "", 1, 0, 2_000, 10_000)
        with pytest.raises(KvrcError) as refused:
            await c.leases.request_prefix_load(request)
        assert refused.value.code is ErrorCode.FAILED_PRECONDITION
        assert lease_id in refused.value.message and "new request id" in refused.value.message
        await settle()
        assert not [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
        assert c.status().leases == before
        # A new request id loads again.
        again = await load(rig, holder, "q2")
        assert again.view is not None and again.view.prefix_load_grant is not None


async def test_a_repeat_while_the_lease_is_open_answers_with_that_lease() -> None:
    # The control: before the report, the repeat is a retry and gets the same grant.
    async with manual_coordinator() as rig:
        c = rig.coordinator
        register(rig, "r")
        holder = register(rig, "h")
        rig.store(holder)
        request = PrefixLoadRequest("q1", "r", CHAIN, "", 1, 0, 2_000, 10_000)
        answer = await load(rig, holder, "q1", report=False)
        repeat = await c.leases.request_prefix_load(request)
        assert answer.view is not None and repeat.view is not None
        assert repeat.view.lease_id == answer.view.lease_id
        assert repeat.view.prefix_load_grant == answer.view.prefix_load_grant
