"""A target part that re-registers on another replica is asked again for the aborts it
owes the lease's owner (a real redis-server).

Each replica is what `kvrc serve --store redis://` wires (coordinator/edges/server.py):
a `Coordinator` with its `ReplicatedInventory`, `PeerLink`, `RedisStore` and lease
ledger, in this process, minus gRPC. A prefix load's lease lives on its requester's
replica (A). An abort sent while the requester was between sessions is dropped, and an
ack may be lost with a broken stream, so a part that re-registers is asked again for
every ack it owes (I6-quiescence, tests/runtime/test_lease_rejoin.py on one replica).
Here it re-registers on B: A learns of it from B's `OP_PART` in the log and routes the
abort to B, which delivers it to the new session; the ack travels back to A, which ends
the quarantine and releases the holder. Without this, the quarantine waited for an
operator although the requester was alive and could prove its reads quiet.

A holder part that re-registers on another replica (B) while the lease's owner (A) is
live leaves the lease to A. If A then falls silent without having released it, B
rebuilds the lease QUARANTINED, as if the part had registered again then
(`Coordinator.owner_silent`); once A has released it, or the part's session on B has
ended, B rebuilds nothing, nor when it was left longer ago than a holder keeps an
unreleased pin, unless A had quarantined it (the holder keeps that one for good).

A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import replace

import pytest
from manual_rig import drain_outbound
from redis_env import RedisServer, start_redis
from waiting import wait_until

from coordinator.core.events import BlockStored, EventBatch
from coordinator.core.grants import PrefixLoadRequest, TransferReport
from coordinator.core.leases import (
    LeaseState,
    Outcome,
    SendAbort,
    SendPin,
    SendQuarantine,
    SendRelease,
)
from coordinator.core.profiles import DeploymentProfile, declared_profile
from coordinator.core.registry import HeldLease, RankPartRegistration
from coordinator.edges.server import coordinator_with_store
from coordinator.runtime import coordinator as coordinator_module
from coordinator.runtime.config import CoordinatorConfig, StoreConfig
from coordinator.runtime.coordinator import Session
from coordinator.runtime.redis_store import stream_id

RANK = (0, 0, 0)
CHAIN = tuple(bytes([0xD0, i]) * 8 for i in range(8))
PROFILE = DeploymentProfile(model="m", block_size=16, reuse_opt_in=True)
# A session grace far above this test: the requester stays "alive" on A throughout, so
# only the abort it owes (never a proof that it is gone) can end the quarantine.
CONFIG = CoordinatorConfig(
    reuse=True,
    declared_profiles=(declared_profile("t", {"model": "m"}),),
    metrics_port=-1,
    session_grace_ms=60_000,
)


class Node:
    """One replica as `kvrc serve` wires it (`coordinator_with_store`), without gRPC."""

    def __init__(self, server: RedisServer, config: CoordinatorConfig = CONFIG) -> None:
        store = StoreConfig(
            kind="redis", host="127.0.0.1", port=server.port, snapshot_every_entries=0
        )
        coordinator, redis_store = coordinator_with_store(replace(config, store=store))
        assert redis_store is not None
        self.coordinator, self.store = coordinator, redis_store

    def register(self, engine: str) -> Session:
        reg = RankPartRegistration(engine, 0, engine, RANK, PROFILE)
        return self.coordinator.open_session(reg)

    def store_chain(self, session: Session) -> None:
        self.coordinator.inventory.ingest(
            session.registration.child_engine_id,
            RANK,
            session.session_id,
            session.incarnation,
            EventBatch(session.incarnation, 0, (BlockStored(CHAIN, None, 16 * len(CHAIN)),)),
        )

    def part(self, engine: str) -> str | None:
        return self.coordinator.registry.session_of(engine, RANK)


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


@pytest.fixture
async def nodes(server: RedisServer) -> AsyncIterator[Callable[..., Awaitable[Node]]]:
    started: list[Node] = []

    async def start(config: CoordinatorConfig = CONFIG, reading: bool = True) -> Node:
        node = Node(server, config)
        await node.coordinator.start()
        if not reading:  # it has read nothing of the log yet
            node.store.pause_reading()
        await node.store.start()
        started.append(node)
        return node

    yield start
    for node in started:
        await node.coordinator.shutdown()
        await node.store.close(0.2)


class Outbox:
    """What one session was sent so far (the engine's side of its stream), kept."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.seen: list[object] = []

    def of(self, kind: type[SendPin | SendAbort | SendRelease | SendQuarantine]) -> list[str]:
        self.seen += drain_outbound(self.session)
        return [m.lease_id for m in self.seen if isinstance(m, kind)]


async def eventually(cond: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    await wait_until(cond, timeout_s, interval_s=0.01, what=what)


async def granted_load(a: Node, holder: Outbox) -> tuple[str, Session]:
    """A load from holder h to requester r, both on A, granted (ACTIVE); its lease id
    and r's session."""
    requester = a.register("r")
    return await granted_on(a, holder), requester


async def granted_on(a: Node, holder: Outbox) -> str:
    """A load from holder h to requester r (registered on A or known to it), granted on
    A (ACTIVE); its lease id."""
    c = a.coordinator
    task = asyncio.ensure_future(
        c.leases.request_prefix_load(PrefixLoadRequest("g1", "r", CHAIN, "", 1, 0, 10_000, 60_000))
    )
    await eventually(lambda: bool(holder.of(SendPin)), "the holder is asked to pin")
    lease_id = holder.of(SendPin)[0]
    c.leases.on_pin_result("h", RANK, lease_id, len(CHAIN), b"d", "")
    answer = await asyncio.wait_for(task, 10)
    assert answer.view is not None and answer.view.state is LeaseState.ACTIVE
    return lease_id


async def quarantined_load(a: Node, holder: Outbox) -> str:
    """`granted_load`; then r's session breaks and its report is UNKNOWN: QUARANTINED,
    the abort it owes went nowhere."""
    lease_id, requester = await granted_load(a, holder)
    a.coordinator.close_session(requester, "closed")  # the requester's stream breaks
    report = TransferReport(lease_id, "r", RANK, Outcome.UNKNOWN, 0, 0, "read timed out")
    assert a.coordinator.leases.complete_prefix_load(report).state is LeaseState.QUARANTINED
    return lease_id


async def test_a_requester_back_on_another_replica_is_asked_again_for_the_abort_it_owes(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    a, b = await nodes(), await nodes()  # replicas A and B
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    lease_id = await quarantined_load(a, holder)
    # Back on B, whose lease table knows nothing of A's lease: only A can ask it.
    moved = Outbox(b.register("r"))
    await eventually(lambda: a.part("r") == moved.session.session_id, "A hears of r on B")
    await eventually(lambda: moved.of(SendAbort) == [lease_id], "the abort reaches r on B")
    # Its stream on B breaks too and it registers there again: asked once more.
    b.coordinator.close_session(moved.session, "closed")
    again = Outbox(b.register("r"))
    await eventually(lambda: again.of(SendAbort) == [lease_id], "asked again on B")
    assert holder.of(SendRelease) == []  # quarantined: the holder keeps its blocks
    # The ack, on B, reaches the owner: the reads are proven quiet, the holder released.
    b.coordinator.on_abort_ack(again.session.ref, lease_id)
    await eventually(lambda: holder.of(SendRelease) == [lease_id], "the holder's release")
    assert a.coordinator.leases.table.get(lease_id).state is LeaseState.FAILED


def reannounced_on(node: Node, lease_id: str) -> Outbox:
    """h registers on `node`, naming the lease it holds (read by r)."""
    reg = RankPartRegistration("h", 0, "h", RANK, PROFILE, held_leases=(HeldLease(lease_id, "r"),))
    return Outbox(node.coordinator.open_session(reg))


async def reported_while_away(a: Node, outcome: Outcome) -> tuple[str, Outbox]:
    """A load from h to r granted on A; h's stream breaks, then r reports `outcome`: what
    A decides finds h without a session. The lease id and h's old outbox."""
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    lease_id, _ = await granted_load(a, holder)
    a.coordinator.close_session(holder.session, "closed")  # between sessions
    why = "" if outcome is Outcome.SUCCEEDED else "read timed out"
    report = TransferReport(lease_id, "r", RANK, outcome, 0, 0, why)
    a.coordinator.leases.complete_prefix_load(report)
    return lease_id, holder


async def holder_moved_to_b(a: Node, b: Node) -> tuple[str, Outbox]:
    """The holder's stream on A breaks and it registers on B naming the lease it holds,
    while A is live to B: B leaves the lease to A."""
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    lease_id, _ = await granted_load(a, holder)
    peers_b = b.coordinator.peers
    assert peers_b is not None
    await eventually(lambda: peers_b.owner_of(lease_id) is not None, "B hears A")
    a.coordinator.close_session(holder.session, "closed")
    moved = reannounced_on(b, lease_id)
    assert not b.coordinator.leases.table.knows(lease_id), "rebuilt although A is live"
    return lease_id, moved


def releases_waiting(node: Node) -> float | None:
    return node.coordinator.metrics.registry.get_sample_value("kvrc_lease_releases_waiting")


def origin(node: Node) -> str:
    peers = node.coordinator.peers
    assert peers is not None
    return peers.origin


async def test_a_lease_left_to_its_live_owner_is_rebuilt_once_the_owner_falls_silent(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    b.coordinator.owner_silent("some-other-replica")  # not the owner: nothing
    assert not b.coordinator.leases.table.knows(lease_id)
    b.coordinator.owner_silent(origin(a))
    assert b.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED
    assert moved.of(SendQuarantine) == [lease_id]
    assert moved.of(SendRelease) == []  # quarantined: the holder keeps its blocks
    # Rebuilt once: a second silence of A changes nothing.
    b.coordinator.owner_silent(origin(a))
    assert moved.of(SendQuarantine) == [lease_id]


async def test_a_lease_its_owner_released_is_not_rebuilt_when_the_owner_falls_silent(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    # The requester reports to A, which releases the holder on B through the log.
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    await eventually(lambda: moved.of(SendRelease) == [lease_id], "the release reaches B")
    b.coordinator.owner_silent(origin(a))
    assert not b.coordinator.leases.table.knows(lease_id), "an ended lease was rebuilt"
    assert moved.of(SendQuarantine) == []


async def test_a_lease_left_by_a_session_that_ended_is_not_rebuilt(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    b.coordinator.close_session(moved.session, "closed")
    b.coordinator.owner_silent(origin(a))
    assert not b.coordinator.leases.table.knows(lease_id)


async def test_a_lease_left_longer_ago_than_a_holder_keeps_a_pin_is_not_rebuilt(
    nodes: Callable[[], Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Left longer ago than a holder keeps an unreleased pin (here: any time ago), the
    holder has freed it by itself, unless its owner quarantined it (the next test)."""
    monkeypatch.setattr(coordinator_module, "HOLDER_GRACE_MS", -(10**10))
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    b.coordinator.owner_silent(origin(a))
    assert not b.coordinator.leases.table.knows(lease_id), "a freed lease was rebuilt"
    assert moved.of(SendQuarantine) == []


async def test_a_lease_its_owner_quarantined_is_rebuilt_however_long_ago_it_was_left(
    nodes: Callable[[], Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(coordinator_module, "HOLDER_GRACE_MS", -(10**10))
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    # The requester's outcome is unknown: A quarantines it and tells the holder on B.
    report = TransferReport(lease_id, "r", RANK, Outcome.UNKNOWN, 0, 0, "read timed out")
    assert a.coordinator.leases.complete_prefix_load(report).state is LeaseState.QUARANTINED
    await eventually(lambda: moved.of(SendQuarantine) == [lease_id], "the notice reaches B")
    b.coordinator.owner_silent(origin(a))
    assert b.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED


async def test_a_release_decided_while_the_holder_was_between_sessions_reaches_it_on_b(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    """The requester's report ends the lease while the holder has no session anywhere:
    the release finds nobody. A keeps it and sends it once the holder registers again,
    here on B (A hears of it through the log). Before: lost, the holder's pins waited
    for its own safety net."""
    a, b = await nodes(), await nodes()
    lease_id, holder = await reported_while_away(a, Outcome.SUCCEEDED)
    assert a.coordinator.leases.table.get(lease_id).state is LeaseState.COMPLETED
    assert holder.of(SendRelease) == []
    moved = reannounced_on(b, lease_id)
    await eventually(lambda: moved.of(SendRelease) == [lease_id], "the release reaches h on B")
    # B had left the lease to A: the release also ends that, nothing is rebuilt on B.
    b.coordinator.owner_silent(origin(a))
    assert not b.coordinator.leases.table.knows(lease_id)


async def test_a_quarantine_decided_while_the_holder_was_between_sessions_reaches_it_on_b(
    nodes: Callable[[], Awaitable[Node]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease is quarantined while its holder has no session: the notice finds nobody.
    A tells the holder again once it registers on B (before: never, and the holder's
    safety net would have freed pins whose reads were never proven quiet). B, told,
    rebuilds it when A falls silent however long ago it was left."""
    monkeypatch.setattr(coordinator_module, "HOLDER_GRACE_MS", -(10**10))
    a, b = await nodes(), await nodes()
    lease_id, holder = await reported_while_away(a, Outcome.UNKNOWN)
    assert a.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED
    assert holder.of(SendQuarantine) == []
    moved = reannounced_on(b, lease_id)
    assert not b.coordinator.leases.table.knows(lease_id)  # left to the live A
    await eventually(lambda: moved.of(SendQuarantine) == [lease_id], "the notice reaches B")
    assert moved.of(SendRelease) == []
    b.coordinator.owner_silent(origin(a))
    assert b.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED


async def test_a_release_for_a_session_that_ended_on_b_reaches_the_holders_next_session_there(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    """A decides the release while its view still names h's session on B, which has
    just ended, and h has registered on B again: B sends the release on to the new
    session (before: dropped, the pins waited for the holder's safety net). The new
    session had left the lease to A: the release ends that too, nothing is rebuilt."""
    a, b = await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    # No await between these: A has not heard of the new session when it decides.
    b.coordinator.close_session(moved.session, "closed")
    again = reannounced_on(b, lease_id)
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    await eventually(lambda: again.of(SendRelease) == [lease_id], "the release reaches h")
    assert moved.of(SendRelease) == []
    b.coordinator.owner_silent(origin(a))
    assert not b.coordinator.leases.table.knows(lease_id), "a released lease was rebuilt"


async def test_a_release_that_found_the_holder_nowhere_on_b_is_kept_there_for_its_next_session(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    """As above, but h has no session anywhere when the release reaches B: B keeps it
    (the gauge shows it) and sends it once h registers again, here on a third replica C
    (B hears of it through the log)."""
    a, b, c = await nodes(), await nodes(), await nodes()
    lease_id, moved = await holder_moved_to_b(a, b)
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    b.coordinator.close_session(moved.session, "closed")
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    await eventually(lambda: releases_waiting(b) == 1, "B keeps the release")
    assert releases_waiting(a) == 0  # sent, as A saw it
    back = Outbox(c.register("h"))
    await eventually(lambda: back.of(SendRelease) == [lease_id], "the release reaches h on C")
    await eventually(lambda: releases_waiting(b) == 0, "B forgets it once sent")
    assert moved.of(SendRelease) == []


async def test_more_notices_than_the_queue_holds_reach_a_holder_back_on_another_replica(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """Six leases are quarantined while their holder is between sessions; it registers
    again on B, whose session queue holds 4 messages. A sends the six notices again
    through the log, marked as its registration's answers, and B queues them past the
    cap as it does a local registration's (before: B closed the session
    RESOURCE_EXHAUSTED, and on every return it would again)."""
    a, b = await nodes(), await nodes(replace(CONFIG, session_queue_size=4))
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    a.register("r")
    c = a.coordinator
    leases: list[str] = []
    for i in range(6):
        load = PrefixLoadRequest(f"g{i}", "r", CHAIN, "", 1, 0, 10_000, 60_000)
        task = asyncio.ensure_future(c.leases.request_prefix_load(load))
        await eventually(lambda: len(holder.of(SendPin)) > len(leases), "the holder is asked")
        leases.append(holder.of(SendPin)[-1])
        c.leases.on_pin_result("h", RANK, leases[-1], len(CHAIN), b"d", "")
        assert (await asyncio.wait_for(task, 10)).view is not None
    c.close_session(holder.session, "closed")  # between sessions
    for lease_id in leases:
        report = TransferReport(lease_id, "r", RANK, Outcome.UNKNOWN, 0, 0, "read timed out")
        assert c.leases.complete_prefix_load(report).state is LeaseState.QUARANTINED
    moved = Outbox(b.register("h"))
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    # A wrote the notices when it heard of h; an op it writes later reaches B after them.
    a.register("x")
    await eventually(lambda: b.part("x") is not None, "B reads past A's notices")
    assert not moved.session.ended, "the registration's answers closed the session"
    assert sorted(moved.of(SendQuarantine)) == sorted(leases)
    # Only those: a message sent later (unmarked) finds the cap again.
    for _ in range(5):
        b.coordinator.heartbeat(moved.session)
    assert moved.session.ended, "the cap was lifted for good"


async def test_a_release_that_overflows_the_holders_queue_on_b_is_kept_for_its_next_session(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """h's session on B (queue: 1 message) is not reading: A's release overflows it, and
    B closes the session. The release is kept (before: counted as sent, and lost) and
    reaches h's next session."""
    a, b = await nodes(), await nodes(replace(CONFIG, session_queue_size=1))
    lease_id, moved = await holder_moved_to_b(a, b)
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    await eventually(lambda: moved.session.ended, "the release overflows h's queue on B")
    await eventually(lambda: releases_waiting(b) == 1, "B keeps the release")
    back = reannounced_on(b, lease_id)
    await eventually(lambda: back.of(SendRelease) == [lease_id], "the release reaches h")
    assert releases_waiting(b) == 0


GRACE = replace(CONFIG, session_grace_ms=300)


async def reloaded_while_b_is_deaf(a: Node, b: Node) -> tuple[str, Outbox, Outbox]:
    """A load from h (on A) to r (on B), granted on A (its owner). Then A loses track of
    the log (its read position is trimmed away: it reloads B's snapshot, which holds no
    parts) while B does not read: B is alive (its heartbeats reach A) but does not
    answer A's hello. The lease id, h's and r's outboxes."""
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    requester = Outbox(b.register("r"))
    await eventually(lambda: a.part("r") == requester.session.session_id, "A hears of r")
    lease_id = await granted_on(a, holder)
    await parked(a)
    # B reads on (heartbeats) and snapshots twice past A's position: a snapshot cuts the
    # log at the one before it, so A's position is gone.
    for _ in range(2):
        last = max(stream_id(a.store.read_position or "0-0"), read_by(b))
        await eventually(lambda: read_by(b) > last, "B reads on")  # noqa: B023 (awaited here)
        assert await b.store.write_snapshot()
    await parked(b)
    a.store.resume_reading()
    await eventually(lambda: loaded_snapshots(a) == 1, "A loads B's snapshot")
    assert a.part("r") is None, "r stayed registered on A across the reload"
    return lease_id, holder, requester


def read_by(node: Node) -> tuple[int, int]:
    return stream_id(node.store.read_position or "0-0")


async def parked(node: Node) -> None:
    """Pauses the node's reading, and waits out the read in flight: after it, the node
    reads nothing more."""
    node.store.pause_reading()
    await asyncio.wait_for(node.store.reading_stopped(), 10)


def loaded_snapshots(node: Node) -> float | None:
    return node.coordinator.metrics.registry.get_sample_value(
        "kvrc_store_snapshots_total", {"action": "loaded"}
    )


async def test_a_target_is_not_taken_for_gone_while_its_replica_has_not_announced_again(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """A replica that reloads a snapshot has lost track of the other replicas' parts. It
    asks them to announce again, but a part not announced yet has not left its replica:
    its engine must not be proven gone when its grace period ends, or A releases the
    holder while r still reads (I6-quiescence). Before: released after 300 ms."""
    a, b = await nodes(GRACE), await nodes(GRACE)
    lease_id, holder, requester = await reloaded_while_b_is_deaf(a, b)
    await asyncio.sleep(1.5)  # five grace periods
    assert holder.of(SendRelease) == [], "released while its reader was alive"
    view = a.coordinator.leases.table.get(lease_id)
    # Not proven gone either (a target proven gone is released at the lease's deadline,
    # and says so until then).
    assert view.state is LeaseState.ACTIVE and "gone" not in view.reason
    b.store.resume_reading()  # B answers A's hello: r is back on A
    await eventually(lambda: a.part("r") == requester.session.session_id, "r is back on A")
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    assert holder.of(SendRelease) == [lease_id]


async def test_a_target_that_left_while_its_replica_was_unaccounted_for_is_proven_gone(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """The control: r's session on B ends while A has lost track of it. A reads its
    departure (B writes while it does not read) and proves r gone a grace period
    later, as for any target that left (its holder is then released at the lease's
    deadline, 60 s here: tests/core/test_leases.py); B never answered."""
    a, b = await nodes(GRACE), await nodes(GRACE)
    lease_id, holder, requester = await reloaded_while_b_is_deaf(a, b)
    b.coordinator.close_session(requester.session, "closed")
    table = a.coordinator.leases.table
    await eventually(
        lambda: "requester engine gone" in table.get(lease_id).reason, "r is proven gone"
    )
    assert holder.of(SendRelease) == []  # held to the lease's deadline
    assert a.part("r") is None


async def test_a_replica_that_has_not_read_the_log_yet_leaves_a_lease_to_its_unheard_owner(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """B just started and has read nothing yet: it has not heard A, which may well be
    alive (it is). A holder re-announcing A's lease there leaves it to A, as to any
    owner heard alive; before, B rebuilt it as its own, QUARANTINED (two owners, and
    the holder told to keep its blocks for an operator). Once B has read the log, A is
    alive: nothing is rebuilt, and A's release reaches the holder on B."""
    a = await nodes()
    holder = Outbox(a.register("h"))
    a.store_chain(holder.session)
    lease_id, _ = await granted_load(a, holder)
    b = await nodes(CONFIG, reading=False)
    a.coordinator.close_session(holder.session, "closed")
    moved = reannounced_on(b, lease_id)
    assert not b.coordinator.leases.table.knows(lease_id), "rebuilt by a replica that knew nobody"
    assert moved.of(SendQuarantine) == []
    b.store.resume_reading()
    await eventually(lambda: a.part("h") == moved.session.session_id, "A hears of h on B")
    await eventually(
        lambda: (
            b.coordinator.peers is not None and b.coordinator.peers.owner_of(lease_id) is not None
        ),
        "B hears A",
    )
    assert not b.coordinator.leases.table.knows(lease_id)
    report = TransferReport(lease_id, "r", RANK, Outcome.SUCCEEDED, 0, 0, "")
    assert a.coordinator.leases.complete_prefix_load(report).quiescent
    await eventually(lambda: moved.of(SendRelease) == [lease_id], "A's release reaches h on B")
    assert moved.of(SendQuarantine) == []


@pytest.mark.parametrize("flow", ["pl", "ho"])
async def test_a_lease_left_to_an_unheard_owner_is_rebuilt_once_the_log_shows_it_is_not_alive(
    nodes: Callable[..., Awaitable[Node]], flow: str
) -> None:
    """The control: the lease's owner is a replica nobody hears (gone before B started,
    its entries trimmed away). B leaves the lease while it knows nobody; once it has
    read the log through, B watches that owner, and rebuilds the lease QUARANTINED once
    it has been silent for the silence timeout, as for any owner that fell silent. A
    handoff (`ho`) too: before 0c5ca2e a handoff left so was not kept, and nothing
    ended it before the holder's own hold deadline."""
    # The holder's session outlives the wait (it sends no heartbeats here).
    b = await nodes(replace(CONFIG, heartbeat_timeout_ms=60_000), reading=False)
    lease_id = f"{flow}-0123456789abcdef@gone-replica"
    moved = reannounced_on(b, lease_id)
    assert not b.coordinator.leases.table.knows(lease_id)
    b.store.resume_reading()
    # Not at once: an owner not heard yet may only have had nothing to write. It is
    # rebuilt once that owner has been silent for the silence timeout (5 s).
    await asyncio.sleep(1)
    assert not b.coordinator.leases.table.knows(lease_id)
    await eventually(
        lambda: b.coordinator.leases.table.knows(lease_id), "rebuilt on B", timeout_s=20
    )
    assert b.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED
    assert moved.of(SendQuarantine) == [lease_id]


async def test_a_handoff_left_to_an_unheard_owner_is_not_rebuilt_while_that_owner_is_alive(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """As for a prefix load: B, which has read nothing yet, leaves a handoff that a
    holder re-announces to its owner A, which it has not heard (A is alive). Before, B
    rebuilt it as its own at once, QUARANTINED: two owners of one handoff."""
    a = await nodes()
    lease_id = f"ho-0123456789abcdef@{origin(a)}"
    b = await nodes(CONFIG, reading=False)
    moved = reannounced_on(b, lease_id)
    assert not b.coordinator.leases.table.knows(lease_id), "rebuilt by a replica that knew nobody"
    b.store.resume_reading()
    await eventually(
        lambda: (
            b.coordinator.peers is not None and b.coordinator.peers.owner_of(lease_id) is not None
        ),
        "B hears A",
    )
    assert not b.coordinator.leases.table.knows(lease_id)
    assert moved.of(SendQuarantine) == []


async def test_a_reader_paused_again_before_it_ran_is_waited_for_until_it_stops(
    nodes: Callable[..., Awaitable[Node]],
) -> None:
    """A pause right after a resume, before the reader has run: the reader still reads
    once more, and `reading_stopped` waits for that read. Before, it returned at once
    (the last pause's stop), and the 'parked' node read on."""
    a = await nodes()
    b = await nodes()
    await parked(b)
    a.register("e")  # something for B to read
    await eventually(lambda: read_by(a) > read_by(b), "A's entries are in the log")
    b.store.resume_reading()
    b.store.pause_reading()  # before the reader has run
    await b.store.reading_stopped()
    position = read_by(b)
    await asyncio.sleep(0.2)
    assert read_by(b) == position, "read after reading_stopped returned"


async def test_a_quarantine_sent_while_the_holders_replica_read_behind_a_trim_is_sent_again(
    nodes: Callable[[], Awaitable[Node]],
) -> None:
    """h holds a load of r's on B; A owns the lease. B stops reading (its heartbeats still
    reach A), A quarantines the lease, and two snapshots trim the log past B's position:
    B reloads and never reads the notice, and h's safety net would free the pins while
    r's read was never proven quiet (I6; a review's finding). B's announcement round
    after the reload says it lost track, and A sends its parts' lease messages again."""
    a, b = await nodes(), await nodes()
    holder = Outbox(b.register("h"))
    b.store_chain(holder.session)
    await eventually(lambda: a.part("h") == holder.session.session_id, "A hears of h")
    requester = a.register("r")
    lease_id = await granted_on(a, holder)
    await parked(b)
    a.coordinator.close_session(requester, "closed")  # r's stream breaks
    report = TransferReport(lease_id, "r", RANK, Outcome.UNKNOWN, 0, 0, "read timed out")
    assert a.coordinator.leases.complete_prefix_load(report).state is LeaseState.QUARANTINED
    for _ in range(2):  # a snapshot cuts the log at the one before it
        last = max(read_by(b), read_by(a))
        await eventually(lambda: read_by(a) > last, "A reads on")  # noqa: B023 (awaited here)
        assert await a.store.write_snapshot()
    assert holder.of(SendQuarantine) == []
    b.store.resume_reading()
    await eventually(lambda: loaded_snapshots(b) == 1, "B loads A's snapshot")
    await eventually(lambda: holder.of(SendQuarantine) == [lease_id], "the notice, again")
    assert a.coordinator.leases.table.get(lease_id).state is LeaseState.QUARANTINED


async def test_a_store_whose_fence_counter_went_back_never_hands_out_a_token_again(
    nodes: Callable[[], Awaitable[Node]], server: RedisServer
) -> None:
    """A Redis that comes back older (an AOF tail lost, a failover to a lagging replica)
    keeps its epoch but not its fencing counter: x moved from B to A took B's token
    again, the tie fenced nobody, and B kept its zombie session of x as the part's
    owner (a review's finding, by kill -9 and a restart from an RDB). A claim is now
    answered above every token its replica has seen: B fences its zombie."""
    import redis

    from coordinator.runtime.store_keys import FENCE_KEY

    a, b = await nodes(), await nodes()
    on_b = b.register("x")
    await eventually(lambda: a.part("x") == on_b.session_id, "A hears of x on B")
    redis.Redis(host="127.0.0.1", port=server.port).set(FENCE_KEY, 0)  # the rollback
    on_a = a.register("x")  # the engine moved while B's stream has not timed out
    await eventually(lambda: b.part("x") == on_a.session_id, "B takes A's session of x")
    assert on_b.ended  # fenced: a zombie
