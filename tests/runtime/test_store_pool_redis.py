"""The store's Redis connections stay bounded under a burst (coordinator/runtime/redis_store.py).

Against a real `redis-server` (tests/support/redis_env.py): 64 fencing claims at
once, as when every engine of a killed replica registers here together, all get
their tokens over at most `WRITER_CONNECTIONS` connections (counted by Redis's own
CLIENT LIST). The negative control: with the bound lifted to 64, the same burst
opens more than that, and they stay open after it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis import Redis as SyncRedis
from redis_env import RedisServer, start_redis
from waiting import wait_until

from coordinator.runtime import redis_store
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import StoreConfig
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.redis_store import RedisStore
from coordinator.runtime.replication import ReplicatedInventory

BURST = 64


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with start_redis() as s:
        yield s


def writer_connections(server: RedisServer, origin: str) -> int:
    clients = SyncRedis(host="127.0.0.1", port=server.port, protocol=2).client_list()
    return sum(1 for c in clients if c["name"] == f"kvrc-{origin}-w")


async def burst_of_claims(server: RedisServer, origin: str) -> tuple[set[int], int]:
    inventory = ReplicatedInventory(origin, max_entries_total=1000, max_entries_per_engine=1000)
    config = StoreConfig(kind="redis", host="127.0.0.1", port=server.port)
    store = RedisStore(config, inventory, SystemClock(), Metrics())
    await store.start()
    try:
        tokens: set[int] = set()
        for i in range(BURST):
            store.claim(f"part-{i}", f"session-{i}", tokens.add)
        await wait_until(lambda: len(tokens) == BURST, 30, what="every claim's token")
        return tokens, writer_connections(server, origin)
    finally:
        await store.close(0.2)


async def test_a_burst_of_claims_uses_at_most_the_writer_pool(server: RedisServer) -> None:
    tokens, connections = await burst_of_claims(server, "a")
    assert len(tokens) == BURST  # every claim got its own fencing token
    assert 1 <= connections <= redis_store.WRITER_CONNECTIONS


async def test_without_the_bound_the_same_burst_keeps_more_connections(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(redis_store, "WRITER_CONNECTIONS", BURST)
    tokens, connections = await burst_of_claims(server, "b")
    assert len(tokens) == BURST
    assert connections > 8  # what the default bound would have kept it to


async def test_a_claim_cancelled_while_failing_does_not_keep_the_store_down(
    server: RedisServer,
) -> None:
    """Only a claim's own success cleared its failure: a part that left while Redis was
    unreachable left the replica refusing every prefix load after Redis was back."""
    import signal

    inventory = ReplicatedInventory("c", max_entries_total=1000, max_entries_per_engine=1000)
    config = StoreConfig(kind="redis", host="127.0.0.1", port=server.port)
    store = RedisStore(config, inventory, SystemClock(), Metrics())
    await store.start()
    try:
        await wait_until(lambda: store.unavailable_reason() is None, 10, what="healthy")
        assert server.process is not None
        server.process.send_signal(signal.SIGSTOP)
        try:
            cancel = store.claim("part-x", "session-x", lambda _token: None)
            await wait_until(lambda: "claim" in store._failures, 15, what="the claim fails")
            cancel()  # the part's session closed before Redis answered
        finally:
            server.process.send_signal(signal.SIGCONT)
        await wait_until(lambda: store.unavailable_reason() is None, 30, what="healthy again")
    finally:
        await store.close(0.2)
