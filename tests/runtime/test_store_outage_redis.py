"""Replicas through store outages, silences and losses (a real redis-server).

Each replica here is what `kvrc serve --store redis://` wires (coordinator/edges/
server.py): a `Coordinator` with its `ReplicatedInventory`, `PeerLink` and
`RedisStore`, in this process, minus gRPC, with a 2 s origin timeout (5 s in
production) and a 300 ms session grace. What is proved:

- Redis unreachable past the origin timeout (SIGSTOP: nothing lost): no replica
  calls another silent, so no engine, rank part or holder is dropped (a holder
  proven gone would end its leases FAILED with no release, I6-quiescence), and the
  view follows on afterwards;
- a replica the others did call silent (its appends failed while they read on)
  announces its engines and parts again, and asks its engines for full dumps;
- a release queued while Redis was down reaches its holder after Redis came back
  empty (a store loss resets the outbox);
- after a store loss the parts take new fencing tokens, so a later failover wins
  on every replica;
- Redis restarted from an older save (its epoch kept, what was written since lost)
  is a store loss for every replica, found by the replica whose last entry is gone;
- an outbox overflow asks for full dumps; a failing store logs one snapshot
  warning per outage, not one per tick.

A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import redis
from redis_env import RedisServer, start_redis
from waiting import wait_until

from coordinator.core.events import BlockStored
from coordinator.core.leases import Flow, SendRelease
from coordinator.core.profiles import DeploymentProfile
from coordinator.core.registry import RankPartRegistration
from coordinator.edges.grpc_wire import part_codec
from coordinator.runtime.config import CoordinatorConfig, StoreConfig
from coordinator.runtime.coordinator import Coordinator, Session
from coordinator.runtime.peers import PeerLink
from coordinator.runtime.redis_store import RedisStore, stream_id
from coordinator.runtime.replication import ReplicatedInventory
from coordinator.runtime.store_keys import EPOCH_KEY, STREAM_KEY

TIMEOUT_MS = 2_000  # the origin timeout: above the 500 ms heartbeat, as in production
CONFIG = CoordinatorConfig(session_grace_ms=300)
RANK = (0, 0, 0)


def block(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def registration(engine: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine,
        dp_rank=0,
        child_engine_id=engine,
        rank=RANK,
        profile=DeploymentProfile(model="m", block_size=16),
    )


class Node:
    """One replica as server.py wires it, without gRPC."""

    def __init__(self, server: RedisServer, origin: str, **store: Any) -> None:
        self.origin = origin
        self.inventory = ReplicatedInventory(
            origin,
            max_entries_total=100_000,
            max_entries_per_engine=100_000,
            **store.pop("inventory", {}),
        )
        self.coordinator = Coordinator(CONFIG, inventory=self.inventory, lease_id_owner=origin)
        self.dumps: list[str] = []  # the reasons full dumps were asked for
        config = StoreConfig(
            kind="redis",
            host="127.0.0.1",
            port=server.port,
            snapshot_every_entries=store.pop("snapshot_every_entries", 0),
            snapshot_interval_ms=store.pop("snapshot_interval_ms", 60_000),
            origin_timeout_ms=TIMEOUT_MS,
        )
        self.store = RedisStore(
            config,
            self.inventory,
            self.coordinator.clock,
            self.coordinator.metrics,
            request_full_dumps=self.dumps.append,
            load_snapshots=False,
        )
        self.peers = PeerLink(
            origin,
            self.inventory.record,
            part_codec(CONFIG.bounds),
            self.coordinator.clock.monotonic_ms,
            self.inventory.origin_alive,
            claim=self.store.claim,
            epoch_tag=self.store.epoch_tag,
        )
        self.inventory.peers = self.peers
        self.coordinator.attach_peers(self.peers)

    def store_blocks(self, engine: str, start: int, count: int) -> None:
        hashes = tuple(block(i) for i in range(start, start + count))
        now = self.coordinator.clock.monotonic_ms()
        self.inventory.apply(engine, [BlockStored(hashes, None, 16 * count)], now_ms=now)

    def holds(self, engine: str) -> int:
        """Blocks of `engine` in this replica's view (0: not there at all)."""
        return self.inventory.engine_entries(engine) if self.inventory.has_engine(engine) else 0

    def part(self, engine: str) -> str | None:
        return self.coordinator.registry.session_of(engine, RANK)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


@pytest.fixture
async def nodes(server: RedisServer) -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    started: list[Node] = []

    async def start(origin: str, **store: Any) -> Node:
        node = Node(server, origin, **store)
        await node.store.start()
        started.append(node)
        return node

    yield start
    for node in started:
        await node.store.close(0.2)


async def eventually(cond: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    await wait_until(cond, timeout_s, interval_s=0.02, what=what)


async def holder_seen(a: Node, b: Node, engine: str, blocks: int) -> Session:
    session = a.coordinator.open_session(registration(engine))
    a.store_blocks(engine, 0, blocks)
    await eventually(
        lambda: b.holds(engine) == blocks and b.part(engine) == session.session_id,
        f"{b.origin} sees {engine} of {a.origin}",
    )
    return session


def losses(node: Node) -> float:
    return float(node.coordinator.metrics.store_losses._value.get())


def queued(session: Session) -> list[Any]:
    return list(session._queue._queue)  # type: ignore[attr-defined]


async def test_an_outage_past_the_origin_timeout_drops_no_engine_part_or_holder(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b = await nodes("A"), await nodes("B")
    await holder_seen(a, b, "h", 8)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)  # unreachable, nothing lost
    try:
        # Past the origin timeout plus the session grace, and past the 2.5 s socket
        # timeout that delays the first failure: B's health ticks ran meanwhile.
        for _ in range(int(2.5 * TIMEOUT_MS / 100)):
            await asyncio.sleep(0.1)
            assert b.holds("h") == 8, "B dropped A's engine while it could read nothing"
            assert b.part("h") is not None, "B dropped A's rank part while it could read nothing"
        assert b.store.unavailable_reason() is not None
    finally:
        server.process.send_signal(signal.SIGCONT)
    await eventually(lambda: b.store.unavailable_reason() is None, "B healthy again")
    # Another origin timeout after the recovery: nobody was called silent meanwhile.
    for _ in range(int(1.5 * TIMEOUT_MS / 100)):
        await asyncio.sleep(0.1)
        assert b.holds("h") == 8 and b.part("h") is not None
    assert not b.coordinator.proven_gone("h")
    a.store_blocks("h", 8, 2)  # the view follows on
    await eventually(lambda: b.holds("h") == 10, "B sees A's new blocks")


async def test_a_replica_called_silent_announces_its_engines_and_parts_again(
    nodes: Callable[..., Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await nodes("A"), await nodes("B")
    session = await holder_seen(a, b, "h", 8)

    async def partitioned(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("partitioned (test)")

    # A's appends fail (a partition of A alone, or A stalled) while B reads on: B calls
    # A silent and drops its engine and part, as it should.
    with monkeypatch.context() as patch:
        patch.setattr(a.store, "_append", partitioned)
        await eventually(lambda: b.holds("h") == 0 and b.part("h") is None, "B calls A silent")
    # A's queue is appended again: A notices its own silence and announces again.
    await eventually(
        lambda: b.part("h") == session.session_id and b.inventory.has_engine("h"),
        "B hears of A's engine and part again",
    )
    assert [why for why in a.dumps if "had called this replica silent" in why], a.dumps
    a.store_blocks("h", 8, 2)  # later ops apply (an unknown engine's were ignored)
    await eventually(lambda: b.holds("h") == 2, "B sees A's new blocks")


async def test_a_release_queued_while_the_store_was_lost_reaches_its_holder(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = await nodes("A"), await nodes("B")
    session = await holder_seen(a, b, "h", 4)
    server.kill()
    # The lease's owner (B) ends it while Redis is down: the release waits in B's outbox.
    release = SendRelease("h", RANK, "pl-1@B", Flow.PREFIX_LOAD, "succeeded")
    assert b.peers.send(session.session_id, release)
    await asyncio.sleep(0.3)
    # B's epoch check (every 500 ms) notices the loss before its writer's next retry
    # (backing off up to 1 s) appends the release: made certain here.
    real_append = b.store._append

    async def after_the_loss(*args: Any, **kwargs: Any) -> Any:
        if not losses(b):
            raise ConnectionError("not yet (test)")
        return await real_append(*args, **kwargs)

    monkeypatch.setattr(b.store, "_append", after_the_loss)
    server.restart()  # empty: a store loss, B's outbox is reset and re-announced
    await eventually(lambda: release in queued(session), "the holder got its release")


async def test_after_a_store_loss_parts_take_new_tokens_and_a_later_failover_wins(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a, b, c = await nodes("A"), await nodes("B"), await nodes("C")
    for engine in ("x", "y", "z"):  # tokens 1-3: the holder's is higher than a new store's
        await holder_seen(a, c, engine, 1)
    old = await holder_seen(a, c, "h", 1)
    server.restart()  # empty: the fencing counter starts again
    await eventually(
        lambda: all(losses(n) and n.store.unavailable_reason() is None for n in (a, b, c)),
        "every replica counted the loss and is healthy again",
    )
    await eventually(lambda: c.part("h") == old.session_id, "C hears of the holder again")
    # A dies (kill -9: no departures) and the holder fails over to B. C takes B's
    # registration at once: its token is above the one A re-announced after the loss.
    await a.store.close(0)
    moved = b.coordinator.open_session(registration("h"))
    # Within the origin timeout: not merely once A's silence dropped its parts on C.
    await eventually(
        lambda: c.part("h") == moved.session_id,
        "C follows the failover",
        timeout_s=0.75 * TIMEOUT_MS / 1000,
    )


@pytest.mark.parametrize("writing", [False, True], ids=["heartbeats-only", "writing"])
async def test_a_store_restarted_from_an_older_save_is_a_store_loss_for_every_replica(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]], writing: bool
) -> None:
    """Redis restarted from its last RDB save (as after a crash with RDB persistence, or
    a failover to a lagging Redis replica) keeps its epoch, but the log lost what was
    appended since: here A's blocks 4-7, which B had read and a replica started later
    would never see. The first append after it finds its replica's last entry gone and
    turns the rollback into a store loss, which every replica then sees. `writing`:
    both replicas append every 10 ms across the restart (a check between appends was
    hidden by the next append, whose id the old log may have)."""
    a, b = await nodes("A"), await nodes("B")
    session = await holder_seen(a, b, "h", 4)
    b.coordinator.open_session(registration("g"))
    stop = asyncio.Event()

    async def keep_storing(node: Node, engine: str) -> None:
        block_index = 1_000
        while not stop.is_set():
            node.store_blocks(engine, block_index, 1)
            block_index += 1
            await asyncio.sleep(0.01)

    writers = (
        [asyncio.ensure_future(keep_storing(a, "h")), asyncio.ensure_future(keep_storing(b, "g"))]
        if writing
        else []
    )
    with redis.Redis(port=server.port) as r:
        epoch = r.get(EPOCH_KEY)
        assert epoch is not None and r.save()
    a.store_blocks("h", 4, 4)
    await eventually(lambda: b.holds("h") >= 8, "B reads the blocks stored after the save")
    server.restart()  # loads the save: the same epoch, an older log
    with redis.Redis(port=server.port) as r:
        assert r.get(EPOCH_KEY) == epoch  # nothing but the lost entries says what happened
    try:
        await eventually(
            lambda: all(losses(n) == 1 and n.store.unavailable_reason() is None for n in (a, b)),
            "both replicas counted one store loss and are healthy again",
        )
        with redis.Redis(port=server.port) as r:
            assert r.get(EPOCH_KEY) != epoch
        assert any("rolled back" in why for why in a.dumps + b.dumps), a.dumps + b.dumps
        await eventually(lambda: b.part("h") == session.session_id, "B hears of the holder again")
        await asyncio.sleep(1.0)  # two epoch checks and dozens of appends more: no second loss
        assert losses(a) == losses(b) == 1
    finally:
        stop.set()
        await asyncio.gather(*writers)


def _epoch_checked_once_told(node: Node, monkeypatch: pytest.MonkeyPatch) -> asyncio.Event:
    """Holds back each of `node`'s epoch checks until the returned event is set: a
    replica that has not noticed a store loss yet."""
    notice = asyncio.Event()
    check = node.store._check_epoch

    async def later() -> None:
        await notice.wait()
        await check()

    monkeypatch.setattr(node.store, "_check_epoch", later)
    return notice


async def test_a_replica_slow_to_notice_a_store_loss_does_not_leave_its_tokens_behind(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """B notices a store loss first; A, not yet, announces its holder with the old
    store's token (6) into the new log (as its answer to B's hello would: A's reader
    no longer reads the new log before the epoch, so the answer is made here). Once A
    notices and claims again (token 1 from the new counter), B registers the holder.
    Before, B took token 6 from the old store and refused the holder's own new token as
    stale."""
    a, b = await nodes("A"), await nodes("B")
    for _ in range(5):  # tokens 1-5: the holder's is above what the new store gives it
        a.coordinator.close_session(a.coordinator.open_session(registration("burn")), "closed")
    old = await holder_seen(a, b, "h", 1)
    notice = _epoch_checked_once_told(a, monkeypatch)
    sent = a.peers.sent
    server.restart()  # empty: a store loss that only B notices
    await eventually(lambda: losses(b) == 1, "B noticed the loss")
    # A announces the holder with its old token into the new log.
    a.peers.announce_local()
    await eventually(lambda: a.peers.sent > sent and not a.inventory.outbox, "A answered")
    entries = redis.Redis(port=server.port).xrevrange(STREAM_KEY, count=1)
    assert entries and isinstance(entries[0][0], bytes)
    newest = entries[0][0].decode()
    await eventually(
        lambda: stream_id(b.store.read_position or "0-0") >= stream_id(newest),
        "B read A's answer",
    )
    assert losses(a) == 0
    assert b.part("h") is None  # not on the old store's token
    notice.set()
    await eventually(lambda: losses(a) == 1, "A noticed the loss")
    await eventually(lambda: b.part("h") == old.session_id, "B registers the holder again")


async def test_a_replica_reads_nothing_before_it_knows_the_stores_epoch(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]]
) -> None:
    """B's first epoch checks fail (made certain here): its reader waits for one to pass
    before it applies anything, so that every fencing token it reads is judged against
    the store it came from. Before, it read on and judged them against nothing."""
    a = await nodes("A")
    session = a.coordinator.open_session(registration("h"))
    a.store_blocks("h", 0, 1)
    b = Node(server, "B")
    known = asyncio.Event()
    check = b.store._check_epoch

    async def failing_until_known() -> None:
        if known.is_set():
            await check()

    b.store._check_epoch = failing_until_known  # type: ignore[method-assign]
    await b.store.start()
    try:
        await eventually(lambda: not a.inventory.outbox, "A wrote its holder")
        await asyncio.sleep(1.0)  # a reader that read on would have applied it by now
        assert b.part("h") is None and b.store.read_position is None
        known.set()
        await eventually(lambda: b.part("h") == session.session_id, "B reads, the epoch known")
    finally:
        await b.store.close(0.2)


async def test_an_outbox_overflow_asks_for_full_dumps_and_the_view_is_rebuilt(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]]
) -> None:
    a = await nodes("A", inventory={"outbox_max_bytes": 64 * 1024})
    b = await nodes("B")
    await holder_seen(a, b, "h", 8)
    assert server.process is not None
    server.process.send_signal(signal.SIGSTOP)
    try:
        await eventually(lambda: a.store.unavailable_reason() is not None, "A sees the outage")
        for i in range(40):  # ~140 KB of ops: past the bound
            a.store_blocks("h", 1_000 + 100 * i, 100)
        assert a.inventory.outbox_overflowed
    finally:
        server.process.send_signal(signal.SIGCONT)
    await eventually(lambda: any("overflowed" in why for why in a.dumps), "full dumps asked")
    # The reset drops A's engine on B; the re-announcement brings it back (blocks: the dumps).
    await eventually(lambda: b.part("h") is not None and b.inventory.has_engine("h"), "back")


async def test_a_failing_store_logs_one_snapshot_warning_per_outage(
    server: RedisServer,
    nodes: Callable[..., Awaitable[Node]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    a = await nodes("A", snapshot_every_entries=1, snapshot_interval_ms=50)
    a.inventory.heartbeat()
    await eventually(lambda: a.store.read_position not in (None, "0-0"), "A reads")
    caplog.set_level(logging.INFO, logger="kvrc.store")
    server.kill()
    await asyncio.sleep(1.5)  # 30 snapshot ticks
    lines = [r for r in caplog.records if "snapshot not written" in r.getMessage()]
    assert len(lines) <= 1, [r.getMessage() for r in lines]


async def test_a_reader_that_meets_a_store_come_back_empty_applies_nothing_before_the_epoch(
    server: RedisServer, nodes: Callable[..., Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis restarts empty while A runs, and A's health check has not seen it yet. A's
    reader found entries newer than the last it read (B's re-announcements), took it for
    a trimmed log, and applied the new log; once the loss was noticed it read it again
    from its start: every op twice (pins, releases, calls). Now the reader asks the
    epoch first and reads the new log once, from its start, as a store loss."""
    a, b = await nodes("A"), await nodes("B")
    await holder_seen(b, a, "h", 1)
    applied: list[str] = []
    apply = a.inventory.apply_remote

    def recording(origin: str, ops: Any, now_ms: int) -> int:
        applied.append(origin)
        return apply(origin, ops, now_ms)

    monkeypatch.setattr(a.inventory, "apply_remote", recording)
    notice = _epoch_checked_once_told(a, monkeypatch)
    server.restart()  # empty: a store loss that B notices first
    await eventually(lambda: losses(b) == 1, "B noticed the loss")
    await eventually(lambda: not b.inventory.outbox, "B re-announced into the new log")
    await asyncio.sleep(1.0)  # a reader that read on would have applied it by now
    assert "B" not in applied and losses(a) == 0
    notice.set()
    await eventually(lambda: losses(a) == 1, "A noticed the loss")
    await eventually(lambda: a.part("h") is not None, "A registers B's holder again")
