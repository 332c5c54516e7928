"""The lease ledger's gate in the live lease flow, against a real redis-server.

A prefix load's pin requests leave only once the ledger in Redis recorded the lease
(`LeaseFlow._pins_recorded`): the holder's session sees a PinRequest only for a lease
Redis already holds. When the ledger cannot record it (the store's epoch is not the
one this replica knows, or Redis is down), the load misses `store_refused`, the holder
is never asked to pin (no PinRequest, no ReleaseRequest) and nothing stays in Redis.
A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis
from manual_rig import CHAIN, Rig, drain_outbound, manual_coordinator
from redis_env import RedisServer, start_redis

from coordinator.core.grants import PrefixLoadAnswer, PrefixLoadRequest, TransferReport
from coordinator.core.leases import LeaseState, MissReason, Outcome, SendPin, SendRelease
from coordinator.runtime.coordinator import Session
from coordinator.runtime.lease_ledger import LeaseLedger, lease_key, pins_key
from coordinator.runtime.store_keys import EPOCH_KEY


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        yield server


class Epoch:
    def __init__(self, value: bytes) -> None:
        self.value = value


@pytest.fixture
async def gated(redis_server: RedisServer) -> AsyncIterator[tuple[Rig, LeaseLedger, Epoch]]:
    sync = redis.Redis(host="127.0.0.1", port=redis_server.port)
    sync.set(EPOCH_KEY, b"e1")
    sync.close()
    epoch = Epoch(b"e1")
    conn = aioredis.Redis(
        host="127.0.0.1", port=redis_server.port, socket_connect_timeout=0.5, socket_timeout=1
    )
    async with manual_coordinator() as rig:
        ledger = LeaseLedger(conn, "A", lambda: epoch.value, rig.coordinator.metrics)
        ledger.start()
        rig.coordinator.leases.ledger = ledger
        try:
            yield rig, ledger, epoch
        finally:
            await ledger.close(0.5)
            await conn.aclose()


def engines(rig: Rig) -> Session:
    """A holder "h" that stores CHAIN and a requester "r"; returns the holder's session."""
    holder = rig.register("h")
    rig.register("r")
    rig.store(holder)
    drain_outbound(holder)
    return holder


async def pins_for(holder: Session, timeout_s: float = 5.0) -> list[SendPin]:
    async with asyncio.timeout(timeout_s):
        while True:
            pins = [m for m in drain_outbound(holder) if isinstance(m, SendPin)]
            if pins:
                return pins
            await asyncio.sleep(0.005)


def request(request_id: str) -> PrefixLoadRequest:
    return PrefixLoadRequest(request_id, "r", CHAIN, "", 1, 0, 2_000, 10_000)


async def test_the_pin_request_leaves_only_for_a_lease_redis_holds(
    gated: tuple[Rig, LeaseLedger, Epoch], redis_server: RedisServer
) -> None:
    rig, ledger, _ = gated
    c = rig.coordinator
    holder = engines(rig)
    task = asyncio.ensure_future(c.leases.request_prefix_load(request("q1")))
    pin = (await pins_for(holder))[0]
    sync = redis.Redis(host="127.0.0.1", port=redis_server.port)
    # At the moment the holder is asked, the lease and its pins are in Redis.
    assert sync.hget(lease_key(pin.lease_id), "st") == b"pinning"
    assert sync.hgetall(pins_key("h")) == {b: b"1" for b in CHAIN}
    c.leases.on_pin_result("h", (0, 0, 0), pin.lease_id, 3, b"d", "")
    answer = await task
    assert answer.view is not None and answer.view.prefix_load_grant is not None
    await ledger.flushed()
    assert sync.hget(lease_key(pin.lease_id), "st") == b"granted"
    assert sync.hgetall(pins_key("h")) == {b: b"1" for b in CHAIN[:3]}  # the granted prefix
    c.leases.complete_prefix_load(
        TransferReport(pin.lease_id, "r", (0, 0, 0), Outcome.SUCCEEDED, 0, 0, "")
    )
    await ledger.flushed()
    assert not sync.exists(lease_key(pin.lease_id)) and not sync.exists(pins_key("h"))
    sync.close()


async def refused_load(rig: Rig, holder: Session, request_id: str) -> PrefixLoadAnswer:
    drain_outbound(holder)
    answer = await asyncio.wait_for(
        rig.coordinator.leases.request_prefix_load(request(request_id)), 10
    )
    sent = drain_outbound(holder)
    assert not [m for m in sent if isinstance(m, SendPin | SendRelease)], sent
    assert answer.view is not None and answer.view.state is LeaseState.MISSED
    assert answer.view.miss_reason is MissReason.STORE_REFUSED
    return answer


async def test_a_store_that_is_not_the_one_known_or_is_down_refuses_and_nobody_pins(
    gated: tuple[Rig, LeaseLedger, Epoch], redis_server: RedisServer
) -> None:
    rig, ledger, epoch = gated
    holder = engines(rig)
    epoch.value = b"e0"  # this replica has not seen the store's new epoch yet
    await refused_load(rig, holder, "q1")
    sync = redis.Redis(host="127.0.0.1", port=redis_server.port)
    assert sync.keys("{kvrc}:lease:*") == [] and sync.keys("{kvrc}:pins:*") == []
    sync.close()
    misses = rig.coordinator.metrics.registry.get_sample_value(
        "kvrc_prefix_load_misses_total", {"reason": "store_refused"}
    )
    assert misses == 1
    epoch.value = b"e1"  # seen: the ledger re-syncs (it was refused), then grants go on
    await asyncio.wait_for(ledger.flushed(), 10)
    drain_outbound(holder)
    task = asyncio.ensure_future(rig.coordinator.leases.request_prefix_load(request("q2")))
    pin = (await pins_for(holder))[0]
    rig.coordinator.leases.on_pin_result("h", (0, 0, 0), pin.lease_id, 8, b"d", "")
    assert (await task).view.prefix_load_grant is not None  # type: ignore[union-attr]
    redis_server.kill()
    await refused_load(rig, holder, "q3")
