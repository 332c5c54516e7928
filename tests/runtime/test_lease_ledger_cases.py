"""The lease ledger's writer in the cases a random walk rarely reaches, in a real Redis.

- An adopted lease (re-announced after its owner fell silent) keeps the blocks its
  record names through a later re-sync of its new owner.
- A silent owner's prune queued before a re-sync still runs; one decided before that
  owner's own re-sync (it came back) is refused.
- An adoption whose lease ended before a re-sync is not brought back by it.
- One write Redis fails alone (here a key of the wrong type) refuses that open only;
  the others of the same pipeline are recorded, and the writer goes on.
- Closing with an open still waiting (Redis hung) answers it refused, and raises nothing
  (the refusal's own end of the lease queues nothing into the queue being emptied).
- Which replica a lease's record names (a report's forwarding reads it): the adopter
  once adopted; UNAVAILABLE, with what to do, while Redis hangs.
A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis
from redis_env import RedisServer, start_redis

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.runtime.lease_ledger import (
    LeaseLedger,
    lease_key,
    owned_key,
    pins_key,
    resyncs_key,
)
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.store_keys import EPOCH_KEY

BLOCKS = (b"x" * 8, b"y" * 8, b"z" * 8)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        yield server


@pytest.fixture
def sync(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=redis_server.port)
    client.set(EPOCH_KEY, b"e1")
    yield client
    client.close()


@pytest.fixture
async def conn(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(
        host="127.0.0.1", port=redis_server.port, socket_connect_timeout=0.5, socket_timeout=1
    )
    yield client
    await client.aclose()


@pytest.fixture
async def ab(conn: aioredis.Redis) -> AsyncIterator[tuple[LeaseLedger, LeaseLedger]]:
    """The ledgers of two replicas, "A" and "B", on one Redis."""
    a, b = ledger(conn, "A"), ledger(conn, "B")
    yield a, b
    await a.close()
    await b.close()


def ledger(conn: aioredis.Redis, owner: str) -> LeaseLedger:
    made = LeaseLedger(conn, owner, lambda: b"e1", Metrics())
    made.start()
    return made


class Answers:
    def __init__(self) -> None:
        self.got: dict[str, tuple[bool, str]] = {}

    def to(self, lease_id: str):  # type: ignore[no-untyped-def]
        def done(ok: bool, why: str) -> None:
            self.got[lease_id] = (ok, why)

        return done


def pins(sync: redis.Redis, holder: str) -> dict[object, int]:
    return {b: int(n) for b, n in sync.hgetall(pins_key(holder)).items()}


def resyncs(sync: redis.Redis, owner: str) -> str:
    value = sync.get(resyncs_key(owner))
    return "0" if value is None else bytes(value).decode()  # type: ignore[arg-type]


async def test_an_adopted_lease_keeps_its_blocks_through_a_resync(
    ab: tuple[LeaseLedger, LeaseLedger], sync: redis.Redis
) -> None:
    a, b = ab
    answers = Answers()
    a.open("L1", "h", "r", BLOCKS[:2], answers.to("L1"))
    await a.flushed()
    assert answers.got["L1"] == (True, "")
    # A fell silent; the holder re-announced L1 to B, which rebuilt it quarantined.
    assert await b.owner_of("L1") == "A"
    b.quarantined("L1", "h", "r")
    await b.flushed()
    assert sync.hget(lease_key("L1"), "o") == b"B"
    # What a replica reads to forward a report on L1, whose id names the silent A.
    assert await a.owner_of("L1") == "B" and await a.owner_of("L9") is None
    assert sync.smembers(owned_key("A")) == set() and sync.smembers(owned_key("B")) == {b"L1"}
    b.store_lost()  # a re-sync writes what B knows of L1: not its blocks
    await b.flushed()
    assert sync.hget(lease_key("L1"), "st") == b"quarantined"
    assert pins(sync, "h") == {BLOCKS[0]: 1, BLOCKS[1]: 1}, "the re-sync dropped L1's pins"
    b.ended("L1")
    await b.flushed()
    assert pins(sync, "h") == {} and not sync.exists(lease_key("L1"))


async def test_a_prune_queued_before_a_resync_still_runs(
    ab: tuple[LeaseLedger, LeaseLedger], sync: redis.Redis
) -> None:
    a, b = ab
    answers = Answers()
    a.open("L1", "h", "r", BLOCKS, answers.to("L1"))
    await a.flushed()
    b.forget_owner("A", "0")
    b.store_lost()  # in one go: the re-sync runs first, the prune after it
    await b.flushed()
    assert pins(sync, "h") == {} and not sync.exists(lease_key("L1"))
    assert not sync.exists(owned_key("A"))


async def test_a_write_redis_fails_alone_refuses_that_open_only(
    conn: aioredis.Redis, sync: redis.Redis
) -> None:
    sync.set(lease_key("bad"), b"not a hash")  # HMGET on it fails: WRONGTYPE
    a = ledger(conn, "A")
    answers = Answers()
    for lease_id in ("ok1", "bad", "ok2"):
        a.open(lease_id, "h", "r", BLOCKS[:1], answers.to(lease_id))
    await a.flushed()
    assert answers.got["ok1"] == (True, "") and answers.got["ok2"] == (True, "")
    ok, why = answers.got["bad"]
    assert not ok and "WRONGTYPE" in why, why
    assert pins(sync, "h") == {BLOCKS[0]: 2}
    a.open("ok3", "h", "r", BLOCKS[:1], answers.to("ok3"))  # the writer goes on
    await a.flushed()
    assert answers.got["ok3"] == (True, "")
    await a.close()


async def test_closing_with_an_open_waiting_on_a_hung_redis_refuses_it(
    conn: aioredis.Redis, redis_server: RedisServer
) -> None:
    a = ledger(conn, "A")
    await a.flushed()
    process = redis_server.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)  # hung: the open's pipeline waits on it
    answers = Answers()
    refused_inside: list[str] = []

    def ends_its_lease(ok: bool, why: str) -> None:
        answers.got["L1"] = (ok, why)
        a.ended("L1")  # what the lease flow does: the refused lease ends
        refused_inside.append(why)

    a.open("L1", "h", "r", BLOCKS, ends_its_lease)
    a.open("L2", "h", "r", BLOCKS, answers.to("L2"))
    try:
        await asyncio.sleep(0.1)  # the writer is now waiting for Redis's answer
        await asyncio.wait_for(a.close(0.2), 10)
    finally:
        process.send_signal(signal.SIGCONT)
    assert answers.got["L1"] == (False, "the coordinator is shutting down")
    assert answers.got["L2"] == (False, "the coordinator is shutting down")
    assert refused_inside


async def test_reading_a_lease_s_owner_from_a_hung_redis_is_unavailable(
    conn: aioredis.Redis, redis_server: RedisServer
) -> None:
    a = ledger(conn, "A")
    process = redis_server.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(KvrcError) as refused:
            await asyncio.wait_for(a.owner_of("L1"), 10)
    finally:
        process.send_signal(signal.SIGCONT)
    assert refused.value.code is ErrorCode.UNAVAILABLE
    assert "'L1' is not on this replica" in refused.value.message
    assert refused.value.message.endswith("try again")
    await a.close()


async def test_a_prune_decided_before_the_owner_re_synced_is_refused(
    ab: tuple[LeaseLedger, LeaseLedger], sync: redis.Redis
) -> None:
    a, b = ab
    answers = Answers()
    a.open("L1", "h", "r", BLOCKS, answers.to("L1"))
    await a.flushed()
    seen = resyncs(sync, "A")  # what B's sweep read
    a.store_lost()  # A was stalled and came back: it re-syncs (its count moves on)
    await a.flushed()
    b.forget_owner("A", seen)
    await b.flushed()
    assert sync.exists(lease_key("L1")) and pins(sync, "h") == {x: 1 for x in BLOCKS}
    b.forget_owner("A", resyncs(sync, "A"))  # the control: read after the re-sync
    await b.flushed()
    assert not sync.exists(lease_key("L1")) and pins(sync, "h") == {}


async def test_an_adoption_whose_lease_ended_is_not_brought_back_by_a_resync(
    ab: tuple[LeaseLedger, LeaseLedger], sync: redis.Redis
) -> None:
    a, b = ab
    a.open("L1", "h", "r", BLOCKS, Answers().to("L1"))
    await a.flushed()
    # Queued together, before B's writer runs: adopted, ended, then a re-sync.
    b.quarantined("L1", "h", "r")
    b.ended("L1")
    b.store_lost()
    await b.flushed()
    assert sync.smembers(owned_key("B")) == set(), "an ended lease came back to B"
