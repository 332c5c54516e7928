"""Who drops a silent replica's lease-ledger records, and when (a real redis-server).

Two `RedisStore`s (the runtime's, with its ledger) on one Redis, with a 2 s origin
timeout. A's lease is in the ledger. While B's reader is paused (as a stalled or
partitioned replica's would be), A looks silent to B, yet B drops nothing: only a
replica that has followed the log for a whole timeout may call another one silent.
Once A has really stopped and B reads again, B drops A's records and pin counts. A
replica that was itself stalled writes its live leases again when it resumes.
A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
from redis_env import RedisServer, start_redis
from waiting import wait_until

from coordinator.runtime import redis_store
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import StoreConfig
from coordinator.runtime.lease_ledger import RESYNCS_KEPT_S, lease_key, pins_key, resyncs_key
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.redis_store import RedisStore
from coordinator.runtime.replication import ReplicatedInventory, pack_ops
from coordinator.runtime.store_keys import OWNERS_KEY, STREAM_KEY

TIMEOUT_MS = 2_000  # above the 500 ms heartbeat, as in production (5 s)
BLOCKS = (b"p" * 8, b"q" * 8)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


def _store(server: RedisServer, origin: str) -> RedisStore:
    inventory = ReplicatedInventory(origin, max_entries_total=1000, max_entries_per_engine=1000)
    config = StoreConfig(
        kind="redis", host="127.0.0.1", port=server.port, origin_timeout_ms=TIMEOUT_MS
    )
    return RedisStore(config, inventory, SystemClock(), Metrics())


@pytest.fixture
async def stores(server: RedisServer) -> AsyncIterator[dict[str, RedisStore]]:
    made: dict[str, RedisStore] = {}
    for origin in ("A", "B"):
        made[origin] = _store(server, origin)
        await made[origin].start()
    yield made
    for store in made.values():
        await store.close(0.2)


def recorded(server: RedisServer, lease_id: str) -> bool:
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        return bool(r.exists(lease_key(lease_id))) and bool(r.hlen(pins_key("h")))


async def test_a_paused_reader_drops_nothing_and_a_stopped_owner_is_dropped(
    server: RedisServer, stores: dict[str, RedisStore]
) -> None:
    a, b = stores["A"], stores["B"]
    opened: list[bool] = []
    a.ledger.open("L1", "h", "r", BLOCKS, lambda ok, why: opened.append(ok))
    await a.ledger.flushed()
    assert opened == [True] and recorded(server, "L1")
    b.pause_reading()
    # Long enough for A to look silent to B several times over (B reads nothing).
    await asyncio.sleep(2.5 * TIMEOUT_MS / 1000)
    assert recorded(server, "L1"), "a replica that follows no log dropped a live owner"
    await a.close(0.2)  # A really stops: its heartbeats end
    b.resume_reading()
    await wait_until(
        lambda: not recorded(server, "L1"), 10, interval_s=0.05, what="A's records dropped"
    )
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        assert r.smembers(OWNERS_KEY) == set(), "the silent owner is still listed"


async def test_a_replica_that_was_stalled_writes_its_leases_again(
    server: RedisServer, stores: dict[str, RedisStore]
) -> None:
    a, b = stores["A"], stores["B"]
    a.ledger.open("L1", "h", "r", BLOCKS, lambda ok, why: None)
    await a.ledger.flushed()
    # B calls A silent while A is stalled (its health loop does not run), drops L1...
    b.ledger.forget_owner("A", "0")
    await b.ledger.flushed()
    assert not recorded(server, "L1")
    # ...and A's first health tick after the stall, 10 timeouts late, notices the gap
    # and writes L1 again (a tick on time would not: the control).
    now = SystemClock().monotonic_ms()
    a._resync_after_silence(now)
    await a.ledger.flushed()
    assert not recorded(server, "L1")
    a._resync_after_silence(now + 10 * TIMEOUT_MS)
    await a.ledger.flushed()
    assert recorded(server, "L1")


async def test_a_dropped_owners_resync_counter_expires_unless_it_resyncs(
    server: RedisServer, stores: dict[str, RedisStore]
) -> None:
    """Replica ids are new per process: the re-sync mark of one that others dropped
    expires (else one key per replica ever run stays in Redis); a re-sync keeps it."""
    a, b = stores["A"], stores["B"]
    a.ledger.open("L1", "h", "r", BLOCKS, lambda ok, why: None)
    await a.ledger.flushed()
    b.ledger.forget_owner("A", "0")
    await b.ledger.flushed()
    now = SystemClock().monotonic_ms()
    a._resync_after_silence(now)
    a._resync_after_silence(now + 10 * TIMEOUT_MS)  # a stall noticed: re-synced, counted
    await a.ledger.flushed()
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        mark = r.get(resyncs_key("A"))
        assert mark is not None and r.ttl(resyncs_key("A")) == -1
        b.ledger.forget_owner("A", mark.decode())  # A stopped for good: dropped again
        await b.ledger.flushed()
        assert not recorded(server, "L1") and r.smembers(OWNERS_KEY) == set()
        assert 0 < r.ttl(resyncs_key("A")) <= RESYNCS_KEPT_S
        a._resync_after_silence(now + 20 * TIMEOUT_MS)  # it had only stalled again
        await a.ledger.flushed()
        again = r.get(resyncs_key("A"))
        assert again not in (None, mark) and r.ttl(resyncs_key("A")) == -1
        assert recorded(server, "L1")
        # A mark never repeats, even once the key expired: a prune decided on the old
        # one is refused after A's next re-sync.
        r.delete(resyncs_key("A"))
        a._resync_after_silence(now + 30 * TIMEOUT_MS)
        await a.ledger.flushed()
        assert r.get(resyncs_key("A")) not in (None, mark, again)


async def test_the_resync_mark_of_a_replica_that_never_opened_a_lease_expires_too(
    server: RedisServer, stores: dict[str, RedisStore]
) -> None:
    """With reuse off (the default) a replica opens no prefix load: its re-sync marked
    it without listing it as an owner, so no sweep ever dropped it and its mark's key
    stayed in Redis for good, one per process after each stall or store loss."""
    a, b = stores["A"], stores["B"]
    now = SystemClock().monotonic_ms()
    a._resync_after_silence(now)
    a._resync_after_silence(now + 10 * TIMEOUT_MS)  # a stall noticed: re-synced
    await a.ledger.flushed()
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        mark = r.get(resyncs_key("A"))
        assert mark is not None and r.ttl(resyncs_key("A")) == -1
        assert r.smembers(OWNERS_KEY) == {b"A"}  # a sweep finds it once it is silent
        b.ledger.forget_owner("A", mark.decode())
        await b.ledger.flushed()
        assert r.smembers(OWNERS_KEY) == set()
        assert 0 < r.ttl(resyncs_key("A")) <= RESYNCS_KEPT_S


async def test_a_replica_replaying_a_backlog_calls_no_live_replica_silent(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica reading the log slower than it was written (a backlog at its start, or
    after a reload) hears each replica only as late as it reads its entries: here 3 s of
    replay lie between two of A's heartbeats, past the 2 s timeout. A was called silent
    while it lived (its engines dropped, its ledger records pruned, its leases rebuilt
    elsewhere); now nobody is, until the replica has read to the log's end."""
    monkeypatch.setattr(redis_store, "READ_COUNT", 2)
    a = _store(server, "A")
    await a.start()
    b = _store(server, "B")
    try:
        with redis.Redis(host="127.0.0.1", port=server.port) as r:

            def a_wrote() -> bool:
                return any(f.get(b"o") == b"A" for _, f in r.xrange(STREAM_KEY, "-", "+"))

            await wait_until(a_wrote, 10, what="A's first heartbeat in the log")
            for _ in range(120):  # another replica's entries, each read in its turn
                r.xadd(STREAM_KEY, {"o": b"Z", "d": pack_ops([])})
        read_after = b._read_after

        async def slowly(last_id: str) -> Any:
            await asyncio.sleep(0.05)  # 2 entries per 50 ms: 3 s for the backlog
            return await read_after(last_id)

        b._read_after = slowly  # type: ignore[method-assign]
        called_silent: list[str] = []
        expire = b._inventory.expire_silent_origins

        def recording(now_ms: int, timeout_ms: int, following_since_ms: int = 0) -> int:
            heard = set(b._inventory._origin_seen)
            dropped = expire(now_ms, timeout_ms, following_since_ms)
            called_silent.extend(heard - set(b._inventory._origin_seen))
            return dropped

        b._inventory.expire_silent_origins = recording  # type: ignore[method-assign]
        await b.start()
        await wait_until(lambda: b._at_log_end, 30, what="B read to the log's end")
        # Control: Z, never heard again, is called silent once B follows the log's end.
        await wait_until(lambda: "Z" in called_silent, 10, what="Z called silent")
        assert "A" not in called_silent, "a live replica was called silent"
    finally:
        await b.close(0.2)
        await a.close(0.2)


async def test_a_reader_whose_every_read_is_full_still_reaches_the_log_end(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's end was a read shorter than READ_COUNT: under writes as fast as the
    reader reads, every read was full, so the replica never called anybody silent (a dead
    replica's leases never rebuilt, its records never pruned) for as long as the load
    lasted. Now the end is also the log's newest entry when the catch-up began."""
    monkeypatch.setattr(redis_store, "READ_COUNT", 2)
    b = _store(server, "B")
    writes = 0
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        for _ in range(20):  # a backlog of another replica's entries
            r.xadd(STREAM_KEY, {"o": b"Z", "d": pack_ops([])})
        read_after = b._read_after

        async def behind_a_writer(last_id: str) -> Any:
            nonlocal writes
            if writes < 400:  # two more entries before each read: every read is full
                for _ in range(2):
                    r.xadd(STREAM_KEY, {"o": b"Z", "d": pack_ops([])})
                writes += 2
            return await read_after(last_id)

        b._read_after = behind_a_writer  # type: ignore[method-assign]
        try:
            await b.start()
            await wait_until(lambda: b._at_log_end, 30, what="B read to the log's end")
            # Before the writer stopped: reached while every read was still full.
            assert writes < 400, writes
        finally:
            await b.close(0.2)


async def test_a_pause_during_the_catch_up_start_leaves_no_stale_log_end(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log's newest entry is asked when a catch-up begins. A pause while that was
    asked kept the answer: after the resume the reader took the pre-pause end for the
    log's end, with what was written during the pause still unread (a review found it)."""
    monkeypatch.setattr(redis_store, "READ_COUNT", 2)
    b = _store(server, "B")
    paused_ids: list[str] = []
    with redis.Redis(host="127.0.0.1", port=server.port) as r:
        for _ in range(4):
            r.xadd(STREAM_KEY, {"o": b"Z", "d": pack_ops([])})
        last_id, read_after = b._last_id, b._read_after

        async def paused_meanwhile() -> str | None:
            newest = await last_id()
            if not paused_ids:
                b.pause_reading()
                for _ in range(40):  # written while B is paused
                    paused_ids.append(r.xadd(STREAM_KEY, {"o": b"Z", "d": pack_ops([])}).decode())
            return newest

        async def slowly(last: str) -> Any:
            await asyncio.sleep(0.02)
            return await read_after(last)

        b._last_id = paused_meanwhile  # type: ignore[method-assign]
        b._read_after = slowly  # type: ignore[method-assign,assignment]
        try:
            await b.start()
            await wait_until(lambda: bool(paused_ids), 10, what="the pause")
            await b.reading_stopped()
            b.resume_reading()
            await wait_until(lambda: b._at_log_end, 30, interval_s=0.005, what="the log's end")
            assert b._read_id is not None
            assert redis_store.stream_id(b._read_id) >= redis_store.stream_id(paused_ids[-1])
        finally:
            await b.close(0.2)
