"""A Redis outage through `kvrc serve` itself, with a short origin timeout.

Three real `kvrc serve --store redis://` replicas over one real redis-server
(tests/support/redis_env.py): A and B run `--store-origin-timeout-ms 3000`, C runs
60000 (the control). The holder engine registers on B with 8 blocks; requesters
register on A and C. Engines are real `EngineSession`s publishing with
`InventoryPublisher`; lookups go through `LookupClient`.

What is proved (docs/operations.md, "Redis unreachable"; the same at runtime level:
tests/runtime/test_store_outage_redis.py):

- Redis stopped (SIGSTOP: unreachable, nothing lost) for well past the 3 s origin
  timeout: every replica keeps answering (Status names the store unavailable, lookups
  answer from the last view) and A drops neither B's engine, its rank part nor its
  blocks, during the outage nor for another origin timeout after Redis is back;
- the flag took effect, which makes the outage longer than the timeout in force:
  replica B itself stopped is dropped from A's view (3 s) while C (60 s) keeps it for
  two more of A's timeouts. Had the flag not reached the store, both would run the
  5 s default and drop it within a heartbeat of each other. When B resumes, A asks
  it to announce again and sees its engine and blocks again.

A machine without redis-server fails here (it does not skip).
"""

from __future__ import annotations

import asyncio
import functools
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from harness import (
    CoordinatorProcess,
    child_engine_status,
    get_status,
    metric_value,
    start_coordinator,
    wait_until,
)
from redis_env import RedisServer, start_redis

from clients.inventory import InventoryPublisher, LookupClient, PublishingHandler, StoredBlocks
from clients.session import EngineProfile, EngineSession, NullHandler, RankPartRegistration

pytestmark = pytest.mark.timeout(150)

TIMEOUT_MS = 3_000  # A's and B's origin timeout; a 2 s stall of a loaded host is not silence
CONTROL_TIMEOUT_MS = 60_000  # C's: far beyond anything this test waits
PROFILES = '[[profile]]\nname = "test"\nmodel = "test-model"\n'
CHAIN = tuple(bytes([0xC0, i]) * 4 for i in range(8))
HOLDER = "holder-b"


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        yield server


async def open_engine(
    sessions: list[EngineSession], target: str, engine_id: str
) -> InventoryPublisher:
    """One rank part; its dump (asked for after a re-announcement) resends CHAIN."""
    registration = RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(
            model="test-model", block_size=16, kv_dtype="bfloat16", reuse_opt_in=True
        ),
    )
    session = EngineSession(target, registration, backoff_initial_s=0.05, backoff_max_s=0.5)
    publisher = InventoryPublisher(session, dump=lambda: [StoredBlocks(CHAIN)])
    session.handler = PublishingHandler(publisher, NullHandler())
    await session.start()
    sessions.append(session)
    await session.wait_ready(10)
    return publisher


async def matched(kvrc: CoordinatorProcess, requester: str) -> int:
    async with LookupClient(kvrc.grpc_target) as client:
        result = await client.lookup(requester, CHAIN, max_candidates=64)
    return max(
        (c.matched_blocks for c in result.candidates if c.child_engine_id == HOLDER), default=0
    )


async def holder_seen(kvrc: CoordinatorProcess, requester: str) -> str | None:
    """The holder's session id in `kvrc`'s view when it is there whole (READY, its 8
    blocks in Status and in a lookup); None when any of it is missing."""
    child = await child_engine_status(kvrc.grpc_target, HOLDER)
    if child is None or not child.state.ready or child.inventory_entries != len(CHAIN):
        return None
    if await matched(kvrc, requester) != len(CHAIN):
        return None
    return str(child.parts[0].session_id)


async def holder_whole(kvrc: CoordinatorProcess, requester: str) -> bool:
    return await holder_seen(kvrc, requester) is not None


async def holder_gone(kvrc: CoordinatorProcess) -> bool:
    return await child_engine_status(kvrc.grpc_target, HOLDER) is None


async def store_down(kvrc: CoordinatorProcess) -> bool:
    status = await get_status(kvrc.grpc_target)
    return bool(status.store_unavailable_reason) and metric_value(kvrc, "kvrc_store_up") == 0


async def store_up(kvrc: CoordinatorProcess) -> bool:
    status = await get_status(kvrc.grpc_target)
    return not status.store_unavailable_reason and metric_value(kvrc, "kvrc_store_up") == 1


async def holds_for(seconds: float, check: Callable[[], Awaitable[None]]) -> None:
    """Runs `check` (it asserts) again and again for `seconds` at least: what must not
    happen within a window has no event to wait for."""
    end = time.monotonic() + seconds
    while True:
        await check()
        if time.monotonic() >= end:
            return
        await asyncio.sleep(0.1)


async def test_a_redis_outage_past_the_origin_timeout_drops_nothing(
    tmp_path: Path, redis_server: RedisServer, sessions: list[EngineSession]
) -> None:
    profiles = tmp_path / "profiles.toml"
    profiles.write_text(PROFILES)
    # A heartbeat timeout above B's stop below: its own part stays registered.
    flags = (
        *("--reuse", "on", "--profiles", str(profiles), "--store", redis_server.url),
        *("--heartbeat-timeout-ms", "30000"),
    )
    short = ("--store-origin-timeout-ms", str(TIMEOUT_MS))
    control = ("--store-origin-timeout-ms", str(CONTROL_TIMEOUT_MS))
    redis_process = redis_server.process
    assert redis_process is not None
    with (
        start_coordinator(*flags, *short) as a,
        start_coordinator(*flags, *short) as b,
        start_coordinator(*flags, *control) as c,
    ):
        holder = await open_engine(sessions, b.grpc_target, HOLDER)
        await open_engine(sessions, a.grpc_target, "req-a")
        await open_engine(sessions, c.grpc_target, "req-c")
        await holder.stored(CHAIN)
        await wait_until(lambda: holder_whole(a, "req-a"), 15, what="A sees B's holder")
        await wait_until(lambda: holder_whole(c, "req-c"), 15, what="C sees B's holder")
        session_id = await holder_seen(a, "req-a")
        assert session_id is not None

        async def a_keeps_the_holder() -> None:
            seen = await holder_seen(a, "req-a")
            assert seen == session_id, f"A dropped or replaced B's holder ({seen!r})"

        # --- Redis unreachable for more than twice the origin timeout -----------------
        redis_process.send_signal(signal.SIGSTOP)
        try:
            # The first failure waits out the client's 2.5 s socket timeout.
            await wait_until(lambda: store_down(a), 20, what="A fails closed")
            await wait_until(lambda: store_down(b), 20, what="B fails closed")

            async def answering_without_a_store() -> None:
                await a_keeps_the_holder()
                # Still the outage: each replica answers and says so.
                for kvrc in (a, b):
                    assert (await get_status(kvrc.grpc_target)).store_unavailable_reason

            await holds_for(2.5 * TIMEOUT_MS / 1000, answering_without_a_store)
        finally:
            redis_process.send_signal(signal.SIGCONT)
        for kvrc in (a, b, c):
            await wait_until(functools.partial(store_up, kvrc), 30, what="the store back")
        # Another origin timeout and a half once everyone reads again: nobody was called
        # silent meanwhile.
        await holds_for(1.5 * TIMEOUT_MS / 1000, a_keeps_the_holder)
        assert metric_value(a, "kvrc_store_losses_total") == 0  # stopped, not lost
        # Not even for a moment (the holder's session id would survive a quick return).
        assert "silent replicas left the view" not in a.stderr_text()

        # --- the flag took effect: B silent, A (3 s) drops it, C (60 s) does not --------
        b.process.send_signal(signal.SIGSTOP)
        try:
            await wait_until(lambda: holder_gone(a), 30, what="A calls B silent")
            assert "silent replicas left the view" in a.stderr_text()  # the log line's control

            async def c_keeps_the_holder() -> None:
                seen = await holder_seen(c, "req-c")
                assert seen == session_id, "C dropped B's holder: its timeout is not 60 s"

            await holds_for(2 * TIMEOUT_MS / 1000, c_keeps_the_holder)
        finally:
            b.process.send_signal(signal.SIGCONT)
        # A hears B again, asks it to announce, and the holder's dump refills its blocks.
        await wait_until(lambda: holder_whole(a, "req-a"), 30, what="A sees B's holder again")
