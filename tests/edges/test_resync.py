"""Resync retries, stale-state pushes and KV-event endpoint checks, over the real service.

A real `kvrc serve` subprocess (tests/harness.py) with a short resync retry
(`--resync-retry-ms 200 --resync-retry-max-ms 400`); engines are real
`EngineSession`s publishing with `clients.inventory.InventoryPublisher`, and
raw `EventBatch`es where a test needs a gap.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
    without_heartbeat_times,
)

from clients.inventory import InventoryPublisher, StoredBlocks
from clients.session import (
    ChildEngineState,
    EngineProfile,
    EngineSession,
    NullHandler,
    RankPartRegistration,
    RegisterAck,
)
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import PROTOCOL_VERSION

RETRY_MS = 200
RETRY_MAX_MS = 400
CHAIN = tuple(bytes([0xB0, i]) * 4 for i in range(8))


@pytest.fixture(scope="module")
def kvrc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorProcess]:
    profiles: Path = tmp_path_factory.mktemp("profiles") / "profiles.toml"
    profiles.write_text('[[profile]]\nname = "test"\nmodel = "test-model"\n')
    with start_coordinator(
        "--reuse",
        "on",
        "--profiles",
        str(profiles),
        "--resync-retry-ms",
        str(RETRY_MS),
        "--resync-retry-max-ms",
        str(RETRY_MAX_MS),
    ) as coordinator:
        yield coordinator


class Deaf(NullHandler):
    """Records every ResyncRequest and every pushed state; answers resyncs only when told."""

    def __init__(self) -> None:
        self.resyncs: list[tuple[float, pb.ResyncRequest]] = []
        self.states: list[ChildEngineState] = []
        self.ignore_first = 0  # how many ResyncRequests to drop (the "lost" ones)
        self.publisher: InventoryPublisher | None = None

    async def on_registered(self, ack: RegisterAck) -> None:
        if self.publisher is not None:
            await self.publisher.on_registered(ack)

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        self.resyncs.append((time.monotonic(), request))
        if len(self.resyncs) > self.ignore_first and self.publisher is not None:
            await self.publisher.on_resync_request(request.expected_sequence, request.reason)

    async def on_state(self, state: ChildEngineState) -> None:
        self.states.append(state)


async def open_engine(
    sessions: list[EngineSession],
    target: str,
    engine_id: str,
    retained: list[StoredBlocks],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    wait_ready: bool = True,
) -> tuple[EngineSession, InventoryPublisher, Deaf]:
    registration = RankPartRegistration(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        profile=EngineProfile(
            model="test-model", block_size=16, kv_dtype="bfloat16", reuse_opt_in=True
        ),
    )
    session = EngineSession(target, registration, reconnect=False)
    publisher = InventoryPublisher(session, dump=lambda: list(retained))
    deaf = Deaf()
    deaf.publisher = publisher
    session.handler = deaf
    await session.start()
    sessions.append(session)
    if wait_ready:
        await session.wait_ready(10)
    return session, publisher, deaf


def incarnation(session: EngineSession) -> int:
    assert session.ack is not None
    return session.ack.incarnation


def gap_batch(session: EngineSession, sequence: int) -> pb.EventBatch:
    return pb.EventBatch(
        incarnation=incarnation(session),
        sequence=sequence,
        events=[
            pb.InventoryEvent(stored=pb.BlockStored(block_hashes=list(CHAIN[4:]), tier=pb.TIER_GPU))
        ],
    )


def resync_metric(kvrc: CoordinatorProcess) -> float:
    return metric_value(kvrc, "kvrc_resync_requests_total", source="grpc")


async def is_stale(target: str, child_engine_id: str) -> bool:
    status = await child_engine_status(target, child_engine_id)
    assert status is not None
    return bool(status.state.stale)


# --- a malformed KV-event endpoint is refused at registration (first: nothing else registered)


def register_with(engine_id: str, **endpoints: str) -> pb.Register:
    register = pb.Register(
        engine_id=engine_id,
        child_engine_id=engine_id,
        rank=pb.RankCoordinates(),
        profile=pb.DeploymentProfile(
            model="m",
            block_size=16,
            kv_dtype="bfloat16",
            parallel=pb.ParallelSizes(tp_size=1, pp_size=1, pcp_size=1, dp_size=1, dcp_size=1),
        ),
        endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
        protocol_version=PROTOCOL_VERSION,
    )
    for field, value in endpoints.items():
        setattr(register, field, value)
    return register


async def register_raw(target: str, register: pb.Register) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(target) as channel:
        call: Any = pb_grpc.EngineServiceStub(channel).Session()  # type: ignore[call-arg]
        try:
            await call.write(pb.EngineMessage(register=register))
            reply = await call.read()
            if reply.WhichOneof("message") == "register_ack":
                call.cancel()
                return grpc.StatusCode.OK, ""
            return await call.code(), await call.details()
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("kv_events_endpoint", "ipc:///tmp/kv", "kv_events_endpoint: KV-event endpoint must be"),
        ("kv_events_endpoint", "tcp://*:0", "kv_events_endpoint: KV-event endpoint 'tcp://*:0'"),
        ("kv_events_endpoint", "tcp://h:99999", "kv_events_endpoint: KV-event endpoint"),
        ("kv_events_endpoint", "tcp://a b:5557", "kv_events_endpoint: KV-event endpoint must"),
        ("kv_events_replay_endpoint", "http://x:1", "kv_events_replay_endpoint: KV-event"),
        ("kv_events_replay_endpoint", "tcp://*", "kv_events_replay_endpoint: KV-event"),
    ],
)
async def test_a_malformed_kv_events_endpoint_is_refused_and_changes_nothing(
    kvrc: CoordinatorProcess, field: str, value: str, needle: str
) -> None:
    before = without_heartbeat_times(await get_status(kvrc.grpc_target))
    code, details = await register_raw(kvrc.grpc_target, register_with("zmq-bad", **{field: value}))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details
    assert without_heartbeat_times(await get_status(kvrc.grpc_target)) == before


async def test_a_well_formed_kv_events_endpoint_is_accepted(kvrc: CoordinatorProcess) -> None:
    code, details = await register_raw(
        kvrc.grpc_target,
        register_with(
            "zmq-good",
            kv_events_endpoint="tcp://*:45557",
            kv_events_replay_endpoint="tcp://*:45558",
        ),
    )
    assert code == grpc.StatusCode.OK, details


# --- 1. a lost ResyncRequest is sent again --------------------------------------------


async def test_an_engine_that_loses_the_first_resync_request_gets_another_and_recovers(
    kvrc: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc.grpc_target
    retained = [StoredBlocks(CHAIN[:6])]
    session, publisher, deaf = await open_engine(sessions, t, "resync-lost", retained)
    deaf.ignore_first = 3  # the first three requests are "lost": no dump starts
    await publisher.stored(CHAIN[:2])  # sequence 0
    before = resync_metric(kvrc)
    await session.send_event_batch(gap_batch(session, 5))  # 1..4 lost

    async def answered() -> bool:
        return publisher.dumps_sent >= 1 and not await is_stale(t, "resync-lost")

    await wait_until(answered, 15)
    await publisher.wait_dump()
    times = [at for at, _ in deaf.resyncs]
    # Four: three lost, the fourth answered. A fifth comes only if the dump reached kvrc
    # more than a retry interval after the fourth (a loaded host): not a failure.
    asked = len(times)
    assert asked in (4, 5), deaf.resyncs
    assert all(r.expected_sequence == 1 for _, r in deaf.resyncs)
    # Bounded backoff: 200 ms, 400 ms (doubled), 400 ms (capped; 800 uncapped), as each
    # retry names the wait it followed; no retry came before its wait was over (the
    # gaps are measured where the engine received them, so with some slack).
    waits = [f"no full dump began within {ms} ms of the previous" for ms in (200, 400, 400)]
    for (_, request), wait in zip(deaf.resyncs[1:4], waits, strict=True):
        assert wait in request.reason, deaf.resyncs
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert gaps[0] >= 0.1 and gaps[1] >= 0.25 and gaps[2] >= 0.25, gaps
    assert resync_metric(kvrc) - before == asked
    status = await child_engine_status(t, "resync-lost")
    assert status is not None and status.inventory_entries == 6
    # Once the dump began, no further request: the retry was cancelled. Kept sleep: an
    # absence is shown by waiting out three retry intervals in which a live timer would fire.
    await asyncio.sleep(3 * RETRY_MAX_MS / 1000)
    assert len(deaf.resyncs) == asked
    assert resync_metric(kvrc) - before == asked


async def test_retries_stop_when_the_stale_engine_leaves(
    kvrc: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc.grpc_target
    session, publisher, deaf = await open_engine(sessions, t, "resync-leaves", [])
    deaf.ignore_first = 1_000  # never answers
    await publisher.stored(CHAIN[:2])
    await session.send_event_batch(gap_batch(session, 3))

    async def asked_twice() -> bool:
        return len(deaf.resyncs) >= 2

    await wait_until(asked_twice, 10)
    await session.close()
    sessions.remove(session)

    async def gone() -> bool:
        return await child_engine_status(t, "resync-leaves") is None

    await wait_until(gone, 10)
    before = resync_metric(kvrc)
    # Kept sleep: three retry intervals in which a timer left behind would have sent again.
    await asyncio.sleep(3 * RETRY_MAX_MS / 1000)
    assert resync_metric(kvrc) == before  # no timer left sending for a gone stream


# --- 2. stale / fresh is pushed on the session ---------------------------------------------


async def test_stale_and_fresh_are_pushed_to_the_engine_parts(
    kvrc: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc.grpc_target
    retained = [StoredBlocks(CHAIN[:3])]
    session, publisher, deaf = await open_engine(sessions, t, "stale-push", retained)
    deaf.ignore_first = 1  # keep it stale long enough to see the push
    await publisher.stored(CHAIN[:2])
    await session.send_event_batch(gap_batch(session, 2))

    async def pushed_stale() -> bool:
        return any(s.stale for s in deaf.states)

    await wait_until(pushed_stale, 10)
    stale_state = next(s for s in deaf.states if s.stale)
    assert stale_state.child_engine_id == "stale-push" and stale_state.ready
    assert session.state is not None and session.state.stale

    async def pushed_fresh() -> bool:
        return bool(deaf.states) and not deaf.states[-1].stale and publisher.dumps_sent == 1

    await wait_until(pushed_fresh, 10)
    assert [s.stale for s in deaf.states] == [True, False]  # once each way, no noise
    assert session.state is not None and not session.state.stale


async def test_every_part_of_the_child_engine_gets_the_stale_state(
    kvrc: CoordinatorProcess, sessions: list[EngineSession]
) -> None:
    t = kvrc.grpc_target
    _, _, other = await open_engine(sessions, t, "stale-tp2", [], tp_size=2, wait_ready=False)
    session, publisher, deaf = await open_engine(sessions, t, "stale-tp2", [], tp_rank=1, tp_size=2)
    deaf.ignore_first = 1_000  # stays stale
    await publisher.stored(CHAIN[:2])
    await session.send_event_batch(gap_batch(session, 4))  # part 1 publishes for the engine

    async def both_told() -> bool:
        return any(s.stale for s in deaf.states) and any(s.stale for s in other.states)

    await wait_until(both_told, 10)
    assert other.resyncs == []  # the resync goes to the publishing part only
