"""A prefix load across two kvrc replicas, with real engines and real Mooncake bytes.

Two `kvrc serve --store redis://` processes over one real redis-server
(tests/support/redis_env.py). The holder (reference engine p0, tp=1) registers with
replica A, the requester (p1, tp=1) with replica B. B grants the load from A's
holder: the pin, its answer and the release travel through the shared log
(coordinator/runtime/peers.py), the bytes move engine to engine through Mooncake
(tcp, loopback), and the test recomputes the expected blocks itself and compares
digests. The negative control is the memory store: the same two processes without
a shared store never lend across (the requester recomputes).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import child_engine_status, get_status, wait_until
from redis_env import RedisServer, start_redis
from refengine_blocks import assert_blocks_exact, call, connect, tokens

from clients.refengine.channel import Channel
from clients.refengine.demo import BLOCK_SIZE, Cluster, EngineGroup

pytestmark = pytest.mark.timeout(180)

MOONCAKE_PORTS = "29500-29999"


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with start_redis() as server:
        yield server


class TwoReplicas:
    def __init__(self, cluster: Cluster, target_a: str, target_b: str) -> None:
        self.cluster = cluster
        self.target_a = target_a
        self.target_b = target_b


def start_two(workdir: Path, store: str) -> tuple[TwoReplicas, dict[str, EngineGroup]]:
    cluster = Cluster(workdir)
    cluster.start_coordinator("--store", store)
    target_a = cluster.target
    extra = ["--mooncake-ports", MOONCAKE_PORTS]
    on_a = [("p0", "prefill", 1, extra), ("d0", "decode", 1, extra)]
    groups = {g.engine_id: g for g in cluster.start_engines(on_a)}
    cluster.start_coordinator("--store", store)  # replica B; the engines below use it
    target_b = cluster.target
    groups.update({g.engine_id: g for g in cluster.start_engines([("p1", "prefill", 1, extra)])})
    return TwoReplicas(cluster, target_a, target_b), groups


@pytest.fixture(scope="module")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer
) -> Iterator[tuple[TwoReplicas, dict[str, EngineGroup]]]:
    two, groups = start_two(Path(tmp_path_factory.mktemp("replicas")), redis_server.url)
    try:
        yield two, groups
    finally:
        two.cluster.stop()
    for child in two.cluster.children:
        if child.name.startswith("kvrc"):
            assert "Traceback" not in child.stderr_path.read_text(errors="replace")


@pytest.fixture
async def engines(
    replicas: tuple[TwoReplicas, dict[str, EngineGroup]],
) -> AsyncIterator[dict[str, Channel]]:
    channels = await connect(replicas[1])
    yield channels
    for channel in channels.values():
        await channel.close()


async def _holder_seen(target: str, holder: str) -> bool:
    status = await child_engine_status(target, holder)
    return status is not None and status.state.ready


async def _no_open_leases(target: str) -> bool:
    return not (await get_status(target)).leases


async def test_a_load_granted_on_b_from_a_holder_on_a_is_bit_exact(
    replicas: tuple[TwoReplicas, dict[str, EngineGroup]], engines: dict[str, Channel]
) -> None:
    two, _ = replicas
    prompt = tokens(11, 96)
    first = await call(engines["p0"], "prefill", request_id="r-1", tokens=prompt, decode="")
    assert first["blocks_recomputed"] == 96 // BLOCK_SIZE
    # B knows p0 (a remote part, READY) and its blocks, both from the log.
    await wait_until(lambda: _holder_seen(two.target_b, "p0"), timeout_s=15)
    turn2 = prompt + tokens(12, 32)
    loaded: dict[str, Any] = {}
    # The inventory reaches B a moment after the holder's ready: retry until it does.
    for attempt in range(20):
        loaded = await call(engines["p1"], "prefill", request_id=f"r-2-{attempt}", tokens=turn2)
        if loaded["load"] == "loaded":
            break
        await asyncio.sleep(0.25)
    assert loaded["load"] == "loaded", loaded
    assert loaded["source"] == "p0"
    assert loaded["blocks_loaded"] == 96 // BLOCK_SIZE
    assert loaded["mismatches"] == 0
    await assert_blocks_exact(engines["p1"], turn2, tp_size=1)
    # Quiescence on both replicas: B ended the lease, A's holder got its release.
    await wait_until(lambda: _no_open_leases(two.target_b), timeout_s=15)
    await wait_until(lambda: _pinned_is(engines["p0"], 0), timeout_s=15)


async def test_a_handoff_published_on_b_for_a_decode_on_a_is_bit_exact(
    replicas: tuple[TwoReplicas, dict[str, EngineGroup]], engines: dict[str, Channel]
) -> None:
    """p1 (on B) prefills for d0 (on A): B forwards the publish to A, which owns the
    handoff; d0 begins it there and pulls p1's blocks; A's release reaches p1 via B."""
    two, _ = replicas
    prompt, output = tokens(31, 70), tokens(32, 30)
    await wait_until(lambda: _holder_seen(two.target_b, "d0"), timeout_s=15)
    pre = await call(engines["p1"], "prefill", request_id="h-1", tokens=prompt, decode="d0")
    dec = await call(
        engines["d0"], "decode", request_id="h-1", prefill="p1", prompt=prompt, output=output
    )
    await call(engines["p1"], "bind_handoff", request_id="h-1", lease_id=dec["lease_id"])
    assert pre["blocks_recomputed"] > 0
    assert dec["handoff"] == "pulled", dec
    assert dec["mismatches"] == 0
    await assert_blocks_exact(engines["d0"], prompt + output, tp_size=1)
    await wait_until(lambda: _no_open_leases(two.target_a), timeout_s=15)
    await wait_until(lambda: _stat_is(engines["p1"], "handoffs_held", 0), timeout_s=15)


async def _stat_is(engine: Channel, key: str, value: int) -> bool:
    return bool((await call(engine, "stats"))[key] == value)


async def _pinned_is(engine: Channel, value: int) -> bool:
    return bool((await call(engine, "stats"))["pinned_leases"] == value)


async def test_without_a_shared_store_nothing_is_lent_across(
    tmp_path: Path,
) -> None:
    """Negative control: the memory store keeps each replica's engines to itself."""
    two, groups = start_two(tmp_path, "memory")
    try:
        channels = await connect(groups)
        prompt = tokens(21, 96)
        await call(channels["p0"], "prefill", request_id="m-1", tokens=prompt, decode="")
        second = await call(channels["p1"], "prefill", request_id="m-2", tokens=prompt)
        assert second["load"] != "loaded", second
        assert second["blocks_recomputed"] == 96 // BLOCK_SIZE
        assert not await _holder_seen(two.target_b, "p0")
        for channel in channels.values():
            await channel.close()
    finally:
        two.cluster.stop()
