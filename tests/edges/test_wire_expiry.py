"""An engine's expiry at the top of uint64 must not break other engines' Lookups (I8-bad-input).

The wire conversion (coordinator/edges/grpc_wire.py) on the manual clock: the wall
clock steps after the expiry was taken in, as NTP moves it under a running kvrc.
"""

from __future__ import annotations

import pytest
from manual_rig import CHAIN, manual_coordinator

from coordinator.edges import grpc_wire as wire
from coordinator.runtime.inventory_flow import LookupQuery
from kvrc.v1 import kvrc_pb2 as pb

U64_MAX = (1 << 64) - 1


@pytest.mark.parametrize("expiry_unix_ms", [U64_MAX, 1 << 63, 2_000_000_000_000])
async def test_an_expiry_at_the_top_of_uint64_leaves_lookups_answering(
    expiry_unix_ms: int,
) -> None:
    async with manual_coordinator() as rig:
        c = rig.coordinator
        holder = rig.register("holder")
        rig.register("req")
        stored = pb.BlockStored(
            block_hashes=list(CHAIN), expiry_unix_ms=expiry_unix_ms, tier=pb.Tier.ValueType(1)
        )
        message = pb.EventBatch(
            incarnation=holder.incarnation, sequence=0, events=[pb.InventoryEvent(stored=stored)]
        )
        batch = wire.event_batch_from_proto(message, rig.clock)
        c.inventory.ingest("holder", (0, 0, 0), holder.session_id, holder.incarnation, batch)
        for step_ms in (0, 5, -7):  # the wall clock steps both ways
            rig.clock.step_wall(step_ms)
            results = c.inventory.lookup_many("req", (LookupQuery(CHAIN),))
            answer = wire.lookup_response_to_proto(results, rig.clock)
            [candidate] = answer.results[0].candidates
            assert candidate.child_engine_id == "holder"
            assert candidate.matched_blocks == len(CHAIN)
            # Kept as sent where it fits; else the latest expiry kept, give or take a step.
            want = min(expiry_unix_ms, wire.MAX_EXPIRY_UNIX_MS)
            assert abs(candidate.expiry_unix_ms - want) <= 12
