"""Snapshot plus tail over a real redis-server (coordinator/runtime/redis_store.py).

Replicas here are `RedisStore`s in this process around their own
`ReplicatedInventory` (one process: their block keys agree, as with one
PYTHONHASHSEED across replicas), against a real `redis-server` on a free port
(tests/support/redis_env.py). What is proved:

- a replica started after the log was trimmed past its start loads the newest
  snapshot and tails the log: its whole state equals that of a replica that read
  every entry; one with snapshot loading off (the negative control) misses the
  trimmed part;
- the trim check, pipelined behind each blocked read, reads the stream's first id
  after that read answered;
- a replica whose read position was trimmed away while its reading was paused
  notices (the entry it read last is older than the stream's first) and recovers
  from the snapshot; with loading off it does not;
- two writers: an older id never replaces a newer snapshot, nor one of another epoch;
- Redis bytes per membership for the snapshot and the stream (MEMORY USAGE).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import Redis as SyncRedis
from redis_env import RedisServer, start_redis
from waiting import wait_until

from coordinator.core.events import BlockRemoved, BlockStored, Tier
from coordinator.core.inventory import Scope
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import StoreConfig
from coordinator.runtime.lease_ledger import LeaseLedger
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.redis_store import RedisStore, put_snapshot, stream_id
from coordinator.runtime.replication import ReplicatedInventory
from coordinator.runtime.store_keys import EPOCH_KEY, SNAPSHOT_KEY, STREAM_KEY

COMPAT = "compat-1"


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8  # 32 bytes, like a real block hash


class Replica:
    def __init__(
        self, server: RedisServer, origin: str, *, load_snapshots: bool = True, every: int = 0
    ) -> None:
        self.inventory = ReplicatedInventory(
            origin, max_entries_total=10_000_000, max_entries_per_engine=10_000_000
        )
        self.metrics = Metrics()
        config = StoreConfig(
            kind="redis", host="127.0.0.1", port=server.port, snapshot_every_entries=every
        )
        self.store = RedisStore(
            config, self.inventory, SystemClock(), self.metrics, load_snapshots=load_snapshots
        )

    def snapshots(self, action: str) -> float:
        return float(self.metrics.store_snapshots.labels(action=action)._value.get())


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


@pytest.fixture
async def redis(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    conn = aioredis.Redis(host="127.0.0.1", port=server.port, protocol=2)
    yield conn
    await conn.aclose()


@pytest.fixture
async def replicas(server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    started: list[Replica] = []

    async def start(origin: str, **kw: Any) -> Replica:
        r = Replica(server, origin, **kw)
        await r.store.start()
        started.append(r)
        return r

    yield start
    for r in started:
        await r.store.close(0.2)


async def wait_for(cond: Callable[[], bool], what: str) -> None:
    await wait_until(cond, 10, interval_s=0.01, what=what)


async def settle(redis: aioredis.Redis, writer: Replica, *readers: Replica) -> str:
    """Until the writer's outbox is in the log and every reader has read the log's end."""
    await wait_for(lambda: not writer.inventory.outbox, "outbox drained")
    rows: Any = await redis.xrevrange(STREAM_KEY, "+", "-", count=1)
    last: str = rows[0][0].decode()
    for r in (writer, *readers):
        await wait_for(
            lambda r=r: (
                r.store.read_position is not None  # type: ignore[misc]
                and stream_id(r.store.read_position) >= stream_id(last)
            ),
            f"{r.inventory.origin} read {last}",
        )
    return last


async def snapshot(redis: aioredis.Redis, a: Replica, *readers: Replica) -> None:
    """A snapshot by `a` at an entry after everything it recorded (trimming keeps that one)."""
    await settle(redis, a, *readers)
    a.inventory.heartbeat()
    await settle(redis, a, *readers)
    assert await a.store.write_snapshot()


def ingest(inv: ReplicatedInventory, cid: str, start: int, count: int, batch: int = 64) -> None:
    for i in range(start, start + count, batch):
        hashes = tuple(block(j) for j in range(i, min(i + batch, start + count)))
        inv.apply(cid, [BlockStored(hashes, None, 16 * len(hashes))], now_ms=0)


def state(inv: ReplicatedInventory) -> list[tuple[Any, ...]]:
    """Every engine's whole state (who the origin is left out), orders dropped."""
    out = []
    for cid in sorted(inv.engine_ids()):
        im = inv.export_engine(cid, 0)
        index = sorted((g, t, k) for g, t, keys in im.index for k in keys)
        out.append((cid, im.compatibility_hash, im.ready, im.serving, im.stale, index))
    return out


async def first_id(redis: aioredis.Redis) -> str:
    rows: Any = await redis.xrange(STREAM_KEY, "-", "+", count=1)
    entry_id: bytes = rows[0][0]
    return entry_id.decode()


async def test_a_replica_started_after_trimming_loads_the_snapshot_and_tails_the_log(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    a = await replicas("a")
    whole = await replicas("whole")  # reads every entry: the view to match
    a.inventory.add_engine("e", COMPAT)
    a.inventory.set_ready("e", True)
    a.inventory.add_engine("gone", COMPAT)
    ingest(a.inventory, "e", 0, 2_000)
    await snapshot(redis, a, whole)
    a.inventory.remove_engine("gone")
    a.inventory.apply("e", [BlockRemoved(tuple(block(j) for j in range(100)))], now_ms=0)
    ingest(a.inventory, "e", 2_000, 500)
    await snapshot(redis, a, whole)  # trims the log to the first snapshot
    rest: Any = await redis.xrange(STREAM_KEY, "-", "+")
    assert not any(b"E" in fields[b"d"][:8] and b"gone" in fields[b"d"] for _, fields in rest)
    # The tail after the newest snapshot: a new replica reads it from the log.
    a.inventory.add_engine("late", COMPAT)
    ingest(a.inventory, "e", 2_500, 300)
    a.inventory.apply("e", [BlockRemoved(tuple(block(j) for j in range(100, 150)))], now_ms=0)
    await settle(redis, a, whole)
    c = await replicas("c")
    blind = await replicas("blind", load_snapshots=False)  # the negative control
    await settle(redis, a, whole, c, blind)
    expected = state(a.inventory)
    assert expected[0][0] == "e" and len(expected[0][5]) == 2_800 - 150
    assert state(whole.inventory) == expected
    assert state(c.inventory) == expected
    assert c.snapshots("loaded") == 1 and a.snapshots("written") == 2
    answer = c.inventory.lookup(Scope(COMPAT), [block(j) for j in range(150, 160)], now_ms=0)
    assert answer.candidates[0].matched_blocks == 10
    # Without the snapshot the trimmed part is missing: "e" itself was announced there.
    assert state(blind.inventory) != expected
    assert not blind.inventory.has_engine("e") and blind.inventory.has_engine("late")


async def test_the_trim_check_reads_the_first_id_after_the_blocked_read_answered(
    server: RedisServer, redis: aioredis.Redis
) -> None:
    """The XRANGE pipelined behind a blocked XREAD (one round trip) runs after the XREAD
    answered: a trim while the read blocked shows as a first id past the read position."""
    replica = Replica(server, "r")  # not started: only its reader connection is used
    read_id: Any = await redis.xadd(STREAM_KEY, {"o": "w", "d": b""})
    read = asyncio.create_task(replica.store._read_after(read_id.decode()))
    with SyncRedis(host="127.0.0.1", port=server.port) as probe:
        blocked = lambda: int(probe.info("clients")["blocked_clients"]) >= 1  # noqa: E731
        await wait_for(blocked, "the read blocks")
    await redis.xtrim(STREAM_KEY, maxlen=0)  # the entry read last is gone
    added: Any = await redis.xadd(STREAM_KEY, {"o": "w", "d": b""})  # wakes the read
    reply, first = await read
    assert reply[0][1][0][0] == added
    assert first == added.decode()  # read after the trim, so the trim is seen
    await replica.store.close(0)


async def test_a_replica_whose_position_was_trimmed_while_paused_recovers(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    a = await replicas("a")
    b = await replicas("b")
    blind = await replicas("blind", load_snapshots=False)
    a.inventory.add_engine("e", COMPAT)
    a.inventory.set_ready("e", True)
    ingest(a.inventory, "e", 0, 300)
    await settle(redis, a, b, blind)
    for r in (b, blind):
        r.store.pause_reading()
    a.inventory.add_engine("marker", COMPAT)
    # Once both have read past the marker they are parked (the pause is checked first).
    await settle(redis, a, b, blind)
    paused_at = {r.inventory.origin: r.store.read_position for r in (b, blind)}
    ingest(a.inventory, "e", 300, 700)
    a.inventory.add_engine("meanwhile", COMPAT)
    await snapshot(redis, a)
    ingest(a.inventory, "e", 1_000, 200)
    await snapshot(redis, a)  # trims past where the paused ones stopped
    first = stream_id(await first_id(redis))
    for r in (b, blind):
        assert r.store.read_position == paused_at[r.inventory.origin]
        assert stream_id(paused_at[r.inventory.origin] or "0-0") < first
        r.store.resume_reading()
    await settle(redis, a, b, blind)
    assert b.snapshots("loaded") == 1
    assert state(b.inventory) == state(a.inventory)
    assert b.inventory.engine_entries("e") == 1_200
    # The negative control read on from the first entry left: the middle is missing.
    assert not blind.inventory.has_engine("meanwhile")
    assert state(blind.inventory) != state(a.inventory)


async def test_an_older_snapshot_never_replaces_a_newer_one(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    a = await replicas("a")
    b = await replicas("b")
    a.inventory.add_engine("e", COMPAT)
    ingest(a.inventory, "e", 0, 100)
    await settle(redis, a, b)
    b.store.pause_reading()
    a.inventory.add_engine("newer", COMPAT)
    await settle(redis, a, b)  # b parked at its position
    ingest(a.inventory, "e", 100, 100)
    newest = await settle(redis, a)
    assert stream_id(b.store.read_position or "0-0") < stream_id(newest)
    # Both write at once: whichever script runs last, the newer id stays.
    await asyncio.gather(a.store.write_snapshot(), b.store.write_snapshot())
    kept: Any = await redis.hmget(SNAPSHOT_KEY, ["id", "d"])
    assert stream_id(kept[0].decode()) >= stream_id(newest)
    data = kept[1]
    epoch: Any = await redis.get(EPOCH_KEY)
    # The script itself, in the order that matters: the stale writer last.
    older = b.store.read_position or "0-0"
    assert await put_snapshot(redis, older, 0, b"old", epoch) == 0
    assert await put_snapshot(redis, kept[0].decode(), 0, b"same", epoch) == 0
    assert await put_snapshot(redis, "99999999999999-0", 0, b"other", b"another epoch") == -1
    assert await redis.hmget(SNAPSHOT_KEY, ["id", "d"]) == [kept[0], data]
    assert await put_snapshot(redis, "99999999999999-0", 0, b"new", epoch) == 1
    assert await redis.hget(SNAPSHOT_KEY, "d") == b"new"
    b.store.resume_reading()


async def test_redis_bytes_per_membership(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    n = 20_000
    a = await replicas("a")
    a.inventory.add_engine("e", COMPAT)
    ingest(a.inventory, "e", 0, n)  # 64 hashes an event, as engines batch them
    await settle(redis, a)
    assert await a.store.write_snapshot()
    snapshot_bytes = int(await redis.memory_usage(SNAPSHOT_KEY, samples=0) or 0)
    stream_bytes = int(await redis.memory_usage(STREAM_KEY, samples=0) or 0)
    per_snapshot, per_stream = snapshot_bytes / n, stream_bytes / n
    print(f"bytes per membership: snapshot {per_snapshot:.1f}, stream {per_stream:.1f}")
    # 8 bytes a packed key plus the engine's header; the log carries the 32-byte hashes.
    assert 8 <= per_snapshot <= 9
    assert per_stream >= 32
    assert a.inventory.stats().index_entries_by_tier[Tier.GPU] == n


async def test_a_snapshot_is_written_by_itself_after_n_entries(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    a = await replicas("a", every=20)
    b = await replicas("b", every=20)
    a.inventory.add_engine("e", COMPAT)
    for i in range(30):  # one log entry each: the writer is woken between them
        ingest(a.inventory, "e", 64 * i, 64)
        await wait_for(lambda: not a.inventory.outbox, "appended")
    await wait_for(
        lambda: a.snapshots("written") + b.snapshots("written") >= 1, "a snapshot written"
    )
    kept: Any = await redis.hget(SNAPSHOT_KEY, "id")
    assert kept is not None
    c = await replicas("c")
    await settle(redis, a, c)
    assert c.snapshots("loaded") == 1 and state(c.inventory) == state(a.inventory)


async def test_a_log_entry_that_fails_to_apply_does_not_stop_the_reader(
    redis: aioredis.Redis, replicas: Callable[..., Any]
) -> None:
    """An op that is not a list made the skip handler itself raise (`op[:2]`): the error
    left the reader task, which died with only a log line, and the replica went on
    granting on a view nobody followed any more."""
    from coordinator.runtime.replication import pack_ops

    a = await replicas("a")
    b = await replicas("b")
    bad: list[Any] = [7, ["E"]]  # not an op: a bug in another replica
    await redis.xadd(STREAM_KEY, {"o": "w", "d": pack_ops(bad)})
    a.inventory.add_engine("after-the-bad-entry", COMPAT)
    await settle(redis, a, b)
    assert b.inventory.has_engine("after-the-bad-entry")
    assert b.store.unavailable_reason() is None


async def test_a_store_loop_that_dies_leaves_the_store_down_not_silently_stale(
    replicas: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    b = await replicas("b")
    await wait_for(lambda: b.store.unavailable_reason() is None, "b healthy")

    async def broken(last_id: str) -> Any:
        raise RuntimeError("a bug in the reader")

    monkeypatch.setattr(b.store, "_read_after", broken)
    await wait_for(lambda: b.store.unavailable_reason() is not None, "b down")
    reason = b.store.unavailable_reason()
    assert reason is not None and "a background task failed" in reason
    assert b.store._read_ok_since_ms is None  # calls nobody silent on a dead reader


async def test_a_ledger_writer_or_a_claim_that_dies_leaves_the_store_down(
    replicas: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only logged before: a dead ledger writer left every later prefix load waiting out
    its pin timeout, its queue growing without bound, and a claim that died left its
    part without a token for good; the store looked up throughout."""
    b = await replicas("b")
    await wait_for(lambda: b.store.unavailable_reason() is None, "b healthy")

    def broken(token: int) -> None:
        raise RuntimeError("a bug in a claim's answer")

    b.store.claim("part", "s-1", broken)
    await wait_for(lambda: b.store.unavailable_reason() is not None, "b down after the claim")
    reason = b.store.unavailable_reason()
    assert reason is not None and "a background task failed" in reason

    async def broken_writer(ledger: LeaseLedger) -> None:
        raise RuntimeError("a bug in the ledger's writer")

    monkeypatch.setattr(LeaseLedger, "_writer", broken_writer)
    c = await replicas("c")
    await wait_for(lambda: c.store.unavailable_reason() is not None, "c down after the ledger")
    reason = c.store.unavailable_reason()
    assert reason is not None and "a background task failed" in reason
