"""kvrc replicas over a real Redis (issue 23): visibility, lookups, grants, Redis commands.

    python -m benchmarks.bench_cluster [--seconds 4] [--rates 25000,50000,100000,200000]
        [--window-s 2.5] [--rounds 3]

Everything runs against one real `redis-server` started here on a free port
(no persistence), in one run, so the figures share the machine's load.

**Visibility.** Two replica processes, each with the runtime's own
`ReplicatedInventory` and `RedisStore` (the code `kvrc serve --store redis://`
runs). Replica A ingests block stores locally (the inventory core's `apply`, what
a gRPC or ZMQ batch ends in) at a paced rate, 64 blocks a batch; its store
appends them to the log. Replica B follows the log and applies every op to its
own index. Visibility is the time from A's apply to the end of B's apply of the
same batch (the first block hash carries A's `time.time_ns()`; both processes
share this host's clock), so it includes A's writer, Redis, B's reader, the codec
and B's core apply. Per rate: achieved block events/s, visibility p50/p99.
`ingest_events_per_s` is the highest achieved rate whose p99 is <= 10 ms (the
issue's target: >= 100,000). Also measured: Redis bytes of the log per membership
(the log is trimmed, so this bounds its memory per retained membership) and
replica B's resident memory per membership (what a replica, or a sidecar with the
whole index, needs).

**Real `kvrc serve` processes.** Then four of them: M with `--store memory` and
replicas A, B, C with `--store redis://` on the same Redis. Four holder engines
(`EngineSession` + `InventoryPublisher`) retain 16 chains of 32 blocks each, once
on M and once on A (B and C see them through the log); each kvrc has one
requester engine. The holders' `LeaseSessionHandler` pins whatever it is asked at
once and answers a fake descriptor: no bytes move in this benchmark, a grant is
the coordinator's work and the pin round trip only. Windows of `--window-s`
seconds, `--rounds` of each, a different configuration first each round:

* `lookup_rps_1`, `lookup_rps_3`: aggregate Lookup RPCs/s (raw request bytes, 64
  distinct queries, half a whole chain, half only its first 8 blocks) from
  `LOOKUP_CLIENTS` client processes with `LOOKUP_CONCURRENCY` calls in flight in
  all, against A alone vs spread over A, B and C (the same clients and
  concurrency). `lookup_rps_3_vs_1` is the scaling on this machine's `cores`: the
  replicas, the clients and Redis share them, so 3x is not expected here.
  `lookup_rps_memory` is M's, beside them.
* `lookup_cpu_us_redis`, `lookup_cpu_us_memory`: CPU time (utime + stime from
  /proc/<pid>/stat) of A resp. M per Lookup, same inventory, same requests, from
  windows that drive both at once (half the workers each), so that other load
  on this shared machine weighs on both alike (`*_alone`: from the windows of one
  kvrc at a time). Lookups never touch Redis (target: redis <= 1.1 x memory);
  `redis_calls_per_s_during_lookups` beside `redis_calls_per_s_idle` shows it.
* `grant_ms_p99_redis`, `grant_ms_p99_memory`: p99 of RequestPrefixLoad (16
  blocks) from the requester's call to its granted answer, one load at a time,
  each then completed SUCCEEDED (so leases do not pile up): on M (holder and
  requester on one kvrc) vs requested on B from the holder on A, where the pin
  and its answer travel through the log (coordinator/runtime/peers.py). Target:
  redis <= 3 x memory (`grant_redis_vs_memory`).
* `redis_ops_per_prefix_load`: Redis commands (`INFO commandstats` deltas, INFO
  itself left out) over the cross-replica loads, minus those over an idle window
  of the same length just before (heartbeats every 500 ms, blocked XREADs),
  per load; by command beside it. All three replicas follow the log, so each
  entry costs every replica its XREAD (and the XRANGE that checks for trimming,
  pipelined behind it: one round trip).

`target` and `target_met` say which targets held. On this shared 2-core machine
the load average before and after is kept: it explains noisy figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import multiprocessing.connection
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from benchmarks.common import (
    RESULTS_DIR,
    KvrcServe,
    percentile,
    process_cpu_seconds,
    start_kvrc,
    write_result,
)
from coordinator.core.events import BlockStored
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import StoreConfig
from coordinator.runtime.gc_policy import freeze_startup_heap
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.redis_store import RedisStore
from coordinator.runtime.replication import OP_APPLY, Op, ReplicatedInventory
from coordinator.runtime.store_keys import STREAM_KEY

BLOCKS_PER_BATCH = 64
TARGET_P99_MS = 10.0
TARGET_INGEST = 100_000  # block events/s within TARGET_P99_MS
DEFAULT_RATES = (25_000, 50_000, 100_000, 200_000, 300_000)
CAPS = {"max_entries_total": 100_000_000, "max_entries_per_engine": 100_000_000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class _TimedInventory(ReplicatedInventory):
    """Replica B: records when each of A's batches became visible here."""

    def __init__(self, origin: str, expect: int) -> None:
        super().__init__(origin, **CAPS)
        self.latencies_ms: list[float] = []
        self.memberships = 0
        self.expect = expect
        self.all_seen = asyncio.Event()

    def apply_remote(self, origin: str, ops: Sequence[Op], now_ms: int) -> int:
        applied = super().apply_remote(origin, ops, now_ms)
        done = time.time_ns()
        for op in ops:
            if op[0] == OP_APPLY:
                for event in op[3]:
                    sent = struct.unpack_from(">Q", event[1][0])[0]
                    self.latencies_ms.append((done - sent) / 1e6)
                    self.memberships += len(event[1])
        if self.memberships >= self.expect:
            self.all_seen.set()
        return applied


async def _consumer(port: int, expect: int, conn: multiprocessing.connection.Connection) -> None:
    inv = _TimedInventory("bench-b", expect)
    store = RedisStore(
        StoreConfig(kind="redis", host="127.0.0.1", port=port), inv, SystemClock(), Metrics()
    )
    freeze_startup_heap()  # as `kvrc serve` does before it starts
    rss_before = _rss_bytes()
    await store.start()
    conn.send("ready")
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(inv.all_seen.wait(), 120)
    rss_after = _rss_bytes()
    await store.close()
    conn.send(
        {
            "latencies_ms": inv.latencies_ms,
            "memberships": inv.memberships,
            "rss_delta_bytes": rss_after - rss_before,
        }
    )


async def _producer(port: int, rate: int, seconds: float) -> dict[str, Any]:
    inv = ReplicatedInventory("bench-a", **CAPS)
    clock = SystemClock()
    store = RedisStore(
        StoreConfig(kind="redis", host="127.0.0.1", port=port), inv, clock, Metrics()
    )
    freeze_startup_heap()
    await store.start()
    inv.add_engine("engine-a", "compat")
    inv.set_ready("engine-a", True)
    batches = int(rate * seconds / BLOCKS_PER_BATCH)
    interval = BLOCKS_PER_BATCH / rate
    started = time.perf_counter()
    for i in range(batches):
        due = started + i * interval
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            await asyncio.sleep(0)  # let the writer run when behind
        sent = time.time_ns()
        hashes = tuple(struct.pack(">QII", sent, i, j) for j in range(BLOCKS_PER_BATCH))
        inv.apply(
            "engine-a",
            [BlockStored(hashes, None, 16 * BLOCKS_PER_BATCH)],
            now_ms=clock.monotonic_ms(),
        )
    elapsed = time.perf_counter() - started
    await store.close(flush_timeout_s=60)  # flushes what is still queued
    return {"batches": batches, "achieved_events_per_s": batches * BLOCKS_PER_BATCH / elapsed}


def _consumer_main(port: int, expect: int, conn: multiprocessing.connection.Connection) -> None:
    import uvloop

    uvloop.run(_consumer(port, expect, conn))


def _one_rate(port: int, rate: int, seconds: float) -> dict[str, Any]:
    redis.Redis(port=port).flushall()
    expect = int(rate * seconds / BLOCKS_PER_BATCH) * BLOCKS_PER_BATCH
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    consumer = ctx.Process(target=_consumer_main, args=(port, expect, child))
    consumer.start()
    assert parent.recv() == "ready"
    import uvloop

    produced = uvloop.run(_producer(port, rate, seconds))
    result = parent.recv()
    consumer.join(30)
    lat = result["latencies_ms"]
    log_bytes = redis.Redis(port=port).memory_usage(STREAM_KEY) or 0
    return {
        "target_events_per_s": rate,
        "achieved_events_per_s": round(produced["achieved_events_per_s"]),
        "visibility_ms_p50": round(percentile(lat, 50), 3),
        "visibility_ms_p99": round(percentile(lat, 99), 3),
        "visibility_ms_max": round(max(lat), 3),
        "memberships": result["memberships"],
        "redis_log_bytes_per_membership": round(log_bytes / max(result["memberships"], 1), 2),
        "replica_rss_bytes_per_membership": round(
            result["rss_delta_bytes"] / max(result["memberships"], 1), 1
        ),
    }


# --- real `kvrc serve` replicas: lookups, grants, Redis commands ---------------------------

PROFILES = '[[profile]]\nname = "cluster"\nmodel = "cluster-model"\n'
HOLDERS = 4  # holder engines, on the memory kvrc and on replica A alike
CHAINS_PER_HOLDER = 16
CHAIN_BLOCKS = 32
LOOKUP_REQUESTS = 64  # distinct Lookup requests, cycled
LOAD_BLOCKS = 16  # blocks per prefix load
LOOKUP_CLIENTS = 2  # client processes, the same for 1 and 3 replicas
LOOKUP_CONCURRENCY = 24  # Lookups in flight over all clients, the same for 1 and 3 replicas
LOOKUP_METHOD = "/kvrc.v1.EngineService/Lookup"
TARGET_LOOKUP_CPU_RATIO = 1.1  # redis <= 1.1 x memory: lookups stay local
TARGET_GRANT_RATIO = 3.0  # cross-replica grant p99 <= 3 x the memory store's


def _log(message: str) -> None:
    print(f"bench-cluster: {message}", file=sys.stderr, flush=True)


def _chain(holder: int, chain: int) -> tuple[bytes, ...]:
    return tuple(struct.pack(">IIII", 0xC1, holder, chain, j) for j in range(CHAIN_BLOCKS))


def _lookup_requests(requester: str) -> list[bytes]:
    """Half the queries match a whole held chain, half only its first 8 blocks."""
    from kvrc.v1 import kvrc_pb2 as pb

    requests = []
    for i in range(LOOKUP_REQUESTS):
        chain = _chain(i % HOLDERS, i // HOLDERS % CHAINS_PER_HOLDER)
        if i % 2:
            chain = chain[:8] + tuple(struct.pack(">IIII", 0xF0, i, 0, j) for j in range(24))
        requests.append(
            pb.LookupRequest(
                requester_child_engine_id=requester,
                queries=[pb.LookupQuery(block_hashes=list(chain))],
            ).SerializeToString()
        )
    return requests


async def _lookup_calls(
    channels: dict[str, Any], by_target: dict[str, list[bytes]], concurrency: int, seconds: float
) -> tuple[dict[str, int], float]:
    """`concurrency` workers spread over the targets (worker i on target i mod n) call
    Lookup with raw bytes until `seconds` pass: (calls by target, elapsed s)."""
    targets = list(by_target)
    done = dict.fromkeys(targets, 0)
    deadline = time.perf_counter() + seconds

    async def worker(w: int) -> None:
        target = targets[w % len(targets)]
        call = channels[target].unary_unary(LOOKUP_METHOD, None, None)  # bytes in, bytes out
        requests = by_target[target]
        i = w
        while time.perf_counter() < deadline:
            await call(requests[i % len(requests)])
            i += 1
            done[target] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return done, time.perf_counter() - started


async def _lookup_client(conn: multiprocessing.connection.Connection) -> None:
    """A client process: one Lookup window per message, its channels kept between them."""
    import grpc

    channels: dict[str, Any] = {}
    while True:
        message = conn.recv()  # blocks the loop, but nothing runs here between windows
        if message[0] == "stop":
            break
        _, by_target, concurrency, seconds = message
        for target in by_target:
            if target not in channels:
                channels[target] = grpc.aio.insecure_channel(target)
        conn.send(await _lookup_calls(channels, by_target, concurrency, seconds))
    for channel in channels.values():
        await channel.close(None)


def _lookup_client_main(conn: multiprocessing.connection.Connection) -> None:
    import uvloop

    uvloop.run(_lookup_client(conn))


def _redis_calls(port: int) -> dict[str, int]:
    """Calls per command so far (`INFO commandstats`), without the INFO calls themselves."""
    stats = redis.Redis(port=port).info("commandstats")
    return {
        name.removeprefix("cmdstat_"): int(value["calls"])
        for name, value in stats.items()
        if name != "cmdstat_info"
    }


def _calls_delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


class _Replicas:
    """The kvrc processes of this phase, their engines and the lookup client processes."""

    def __init__(self, servers: dict[str, KvrcServe], redis_port: int) -> None:
        self.servers = servers
        self.redis_port = redis_port
        self.sessions: list[Any] = []
        self.requesters: dict[str, str] = {}  # server name -> its requester's child engine id
        self.clients: list[multiprocessing.connection.Connection] = []
        self.client_procs: list[multiprocessing.process.BaseProcess] = []
        self.lease_clients: dict[str, Any] = {}  # server name -> its requester's LeaseClient

    async def open_engine(self, server: str, engine_id: str, *, holder: bool) -> Any:
        from clients.inventory import InventoryPublisher, PublishingHandler
        from clients.leases import LeaseSessionHandler
        from clients.session import EngineProfile, EngineSession, NullHandler, RankPartRegistration

        profile = EngineProfile(model="cluster-model", block_size=16, reuse_opt_in=True)
        session = EngineSession(
            self.servers[server].target,
            RankPartRegistration(engine_id=engine_id, profile=profile),
            reconnect=False,
        )
        publisher = InventoryPublisher(session)
        if holder:
            leases = LeaseSessionHandler(
                pin=_pin_at_once, inner=PublishingHandler(publisher, NullHandler())
            )
            session.handler = leases
            leases.attach(session)
        await session.start()
        await session.wait_ready(10)
        self.sessions.append(session)
        return publisher

    async def start(self) -> None:
        for server in ("memory", "a"):
            for h in range(HOLDERS):
                publisher = await self.open_engine(server, f"holder-{h}", holder=True)
                for c in range(CHAINS_PER_HOLDER):
                    await publisher.stored(list(_chain(h, c)), num_tokens=16 * CHAIN_BLOCKS)
        for server in self.servers:
            engine_id = f"req-{server[0]}"  # same length everywhere: same request bytes
            await self.open_engine(server, engine_id, holder=False)
            self.requesters[server] = self.sessions[-1].registration.resolved_child_engine_id
        await self._wait_visible()
        ctx = multiprocessing.get_context("spawn")
        for _ in range(LOOKUP_CLIENTS):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_lookup_client_main, args=(child,), daemon=True)
            proc.start()
            self.clients.append(parent)
            self.client_procs.append(proc)

    async def _wait_visible(self) -> None:
        """Every replica sees every holder's last chain whole (B and C through the log)."""
        from clients.inventory import LookupClient

        for server, requester in self.requesters.items():
            async with LookupClient(self.servers[server].target) as client:
                for h in range(HOLDERS):
                    chain = _chain(h, CHAINS_PER_HOLDER - 1)
                    for _ in range(200):
                        result = await client.lookup(requester, chain, max_candidates=64)
                        if any(c.matched_blocks == CHAIN_BLOCKS for c in result.candidates):
                            break
                        await asyncio.sleep(0.05)
                    else:
                        raise RuntimeError(f"{server} never saw holder-{h}'s chains")

    async def lookup_window(self, servers: Sequence[str], seconds: float) -> dict[str, float]:
        """Aggregate Lookups/s over `servers`, their CPU µs per Lookup all together
        (`cpu_us`) and each one's (`cpu_us_<name>`), and Redis calls/s meanwhile."""
        by_target = {self.servers[s].target: _lookup_requests(self.requesters[s]) for s in servers}
        cpu_before = {s: process_cpu_seconds(self.servers[s].process.pid) for s in servers}
        redis_before = _redis_calls(self.redis_port)
        for conn in self.clients:
            conn.send(("window", by_target, LOOKUP_CONCURRENCY // LOOKUP_CLIENTS, seconds))
        answers = [await asyncio.to_thread(conn.recv) for conn in self.clients]
        cpu = {s: process_cpu_seconds(self.servers[s].process.pid) - cpu_before[s] for s in servers}
        redis_calls = sum(_calls_delta(_redis_calls(self.redis_port), redis_before).values())
        done = {s: sum(calls[self.servers[s].target] for calls, _ in answers) for s in servers}
        elapsed = max(t for _, t in answers)
        window = {
            "rps": sum(done.values()) / elapsed,
            "cpu_us": sum(cpu.values()) / sum(done.values()) * 1e6,
            "redis_calls_per_s": redis_calls / elapsed,
        }
        window.update({f"cpu_us_{s}": cpu[s] / done[s] * 1e6 for s in servers})
        return window

    async def grant_window(
        self, server: str, seconds: float, tag: str
    ) -> tuple[list[float], dict[str, int]]:
        """Sequential prefix loads of holder-0's first chain from `server`'s requester,
        each completed SUCCEEDED: the client-side ms to each grant, and Redis calls."""
        from clients.leases import LeaseClient, PrefixLoadGrant
        from kvrc.v1 import kvrc_pb2 as pb

        requester = self.requesters[server]
        # One client (channel) per replica for the whole run: no connect inside a window.
        client = self.lease_clients.get(server)
        if client is None:
            client = LeaseClient(self.servers[server].target, requester, timeout_s=10)
            self.lease_clients[server] = client
        chain = _chain(0, 0)[:LOAD_BLOCKS]
        latencies: list[float] = []
        redis_before = _redis_calls(self.redis_port)
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            issued = time.perf_counter()
            answer = await client.request_prefix_load(
                f"{tag}-{len(latencies)}", chain, transfer_timeout_ms=5000
            )
            latencies.append((time.perf_counter() - issued) * 1000)
            if not isinstance(answer, PrefixLoadGrant):
                raise RuntimeError(f"{server}: no grant: {answer.reason} {answer.detail}")
            await client.complete_prefix_load(
                pb.TransferReport(
                    lease_id=answer.lease_id,
                    reporter_child_engine_id=requester,
                    rank=pb.RankCoordinates(),
                    outcome=pb.TRANSFER_OUTCOME_SUCCEEDED,
                    bytes_moved=LOAD_BLOCKS * 65536,
                )
            )
        return latencies, _calls_delta(_redis_calls(self.redis_port), redis_before)

    async def idle_window(self, seconds: float) -> dict[str, int]:
        """Redis calls over `seconds` of nothing: heartbeats, blocked XREADs, snapshots."""
        before = _redis_calls(self.redis_port)
        await asyncio.sleep(seconds)
        return _calls_delta(_redis_calls(self.redis_port), before)

    async def close(self) -> None:
        for conn in self.clients:
            conn.send(("stop",))
        for proc in self.client_procs:
            await asyncio.to_thread(proc.join, 10)
            if proc.is_alive():
                proc.kill()
        for client in self.lease_clients.values():
            await client.close()
        await asyncio.sleep(0.3)  # let the last releases reach the holders before they close
        for session in self.sessions:
            await session.close()


def _pin_at_once(info: Any) -> Any:
    """A holder that pins whatever it is asked, with a fake descriptor: no bytes move here."""
    from clients.leases import PinAnswer
    from kvrc.v1 import kvrc_pb2 as pb

    return PinAnswer(
        len(info.block_hashes),
        pb.RankPartDescriptor(
            rank=pb.RankCoordinates(),
            endpoint=pb.TransferEndpoint(backend="mooncake", session_name="127.0.0.1:15000"),
            block_ids=list(range(len(info.block_hashes))),
        ),
    )


async def _measure_replicas_async(
    servers: dict[str, KvrcServe], redis_port: int, window_s: float, rounds: int
) -> dict[str, Any]:
    replicas = _Replicas(servers, redis_port)
    await replicas.start()
    try:
        # "paired": M and A at once, half the workers each, so that both CPU figures
        # come from the same moments of this shared machine's load.
        configs = {
            "memory": ["memory"],
            "redis_1": ["a"],
            "redis_3": ["a", "b", "c"],
            "paired": ["memory", "a"],
        }
        for servers_of in configs.values():  # warm-up: connections, first-call paths
            await replicas.lookup_window(servers_of, 0.5)
        lookups: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for r in range(rounds):
            names = list(configs)
            names = names[r % len(names) :] + names[: r % len(names)]  # a new one first
            for name in names:
                window = await replicas.lookup_window(configs[name], window_s)
                lookups[name].append(window)
                _log(
                    f"lookups round {r + 1}/{rounds} {name}: {window['rps']:.0f}/s, "
                    f"{window['cpu_us']:.0f} µs CPU each"
                )
        await replicas.grant_window("memory", 0.3, "warm-m")
        await replicas.grant_window("b", 0.3, "warm-b")
        grant_ms: dict[str, list[float]] = {"memory": [], "redis": []}
        load_calls: dict[str, int] = {}
        idle_calls: dict[str, int] = {}
        redis_loads = 0
        for r in range(rounds):
            latencies, _ = await replicas.grant_window("memory", window_s, f"m{r}")
            grant_ms["memory"] += latencies
            # The idle window right before the loads, as long: the background to subtract.
            for k, v in (await replicas.idle_window(window_s)).items():
                idle_calls[k] = idle_calls.get(k, 0) + v
            latencies, calls = await replicas.grant_window("b", window_s, f"b{r}")
            grant_ms["redis"] += latencies
            redis_loads += len(latencies)
            for k, v in calls.items():
                load_calls[k] = load_calls.get(k, 0) + v
            _log(
                f"grants round {r + 1}/{rounds}: memory p99 "
                f"{percentile(grant_ms['memory'], 99):.2f} ms, cross-replica p99 "
                f"{percentile(grant_ms['redis'], 99):.2f} ms so far"
            )
    finally:
        await replicas.close()

    def median(name: str, key: str) -> float:
        return statistics.median(w[key] for w in lookups[name])

    per_load = {
        k: round((load_calls.get(k, 0) - idle_calls.get(k, 0)) / redis_loads, 2)
        for k in sorted(set(load_calls) | set(idle_calls))
    }
    rps_1, rps_3 = median("redis_1", "rps"), median("redis_3", "rps")
    cpu_redis, cpu_memory = median("paired", "cpu_us_a"), median("paired", "cpu_us_memory")
    p99_redis = percentile(grant_ms["redis"], 99)
    p99_memory = percentile(grant_ms["memory"], 99)
    idle_per_s = sum(idle_calls.values()) / (rounds * window_s)
    return {
        "lookup_rps_1": round(rps_1),
        "lookup_rps_3": round(rps_3),
        "lookup_rps_3_vs_1": round(rps_3 / rps_1, 3),
        "lookup_rps_memory": round(median("memory", "rps")),
        "lookup_rps_rounds": {
            name: [round(w["rps"]) for w in windows] for name, windows in lookups.items()
        },
        "lookup_clients": LOOKUP_CLIENTS,
        "lookup_concurrency": LOOKUP_CONCURRENCY,
        "lookup_cpu_us_redis": round(cpu_redis, 1),
        "lookup_cpu_us_memory": round(cpu_memory, 1),
        "lookup_cpu_redis_vs_memory": round(cpu_redis / cpu_memory, 3),
        # The same from the windows of one kvrc at a time, and the three replicas' sum.
        "lookup_cpu_us_redis_alone": round(median("redis_1", "cpu_us"), 1),
        "lookup_cpu_us_memory_alone": round(median("memory", "cpu_us"), 1),
        "lookup_cpu_us_redis_3": round(median("redis_3", "cpu_us"), 1),
        # Lookups never touch Redis: during them it sees only the background.
        "redis_calls_per_s_during_lookups": round(median("redis_3", "redis_calls_per_s"), 1),
        "redis_calls_per_s_idle": round(idle_per_s, 1),
        "grant_ms_p99_redis": round(p99_redis, 3),
        "grant_ms_p99_memory": round(p99_memory, 3),
        "grant_ms_p50_redis": round(percentile(grant_ms["redis"], 50), 3),
        "grant_ms_p50_memory": round(percentile(grant_ms["memory"], 50), 3),
        "grant_redis_vs_memory": round(p99_redis / p99_memory, 3),
        "grants_redis": len(grant_ms["redis"]),
        "grants_memory": len(grant_ms["memory"]),
        "redis_ops_per_prefix_load": round(sum(per_load.values()), 2),
        "redis_ops_per_prefix_load_by_command": {k: v for k, v in per_load.items() if v},
        "replica_window_s": window_s,
        "replica_rounds": rounds,
    }


def _measure_replicas(redis_port: int, window_s: float, rounds: int) -> dict[str, Any]:
    """A `kvrc serve --store memory` and three `--store redis://` replicas (A, B, C)."""
    import uvloop

    redis.Redis(port=redis_port).flushall()
    store = f"redis://127.0.0.1:{redis_port}/0"
    servers: dict[str, KvrcServe] = {}
    with tempfile.TemporaryDirectory(prefix="kvrc-bench-replicas-") as tmp:
        try:
            for name in ("memory", "a", "b", "c"):
                workdir = Path(tmp) / name
                workdir.mkdir()
                flag = "memory" if name == "memory" else store
                servers[name] = start_kvrc(
                    workdir, PROFILES, metrics=False, extra_args=("--store", flag)
                )
            return uvloop.run(_measure_replicas_async(servers, redis_port, window_s, rounds))
        finally:
            for name, server in servers.items():
                server.stop()
                if "Traceback" in server.log_tail(100_000):  # a figure from a failing kvrc
                    _log(f"kvrc {name} logged a traceback:\n{server.log_tail()}")


def run(
    rates: Sequence[int], seconds: float, window_s: float = 2.5, rounds: int = 3
) -> dict[str, Any]:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed: make sysdeps")
    port = _free_port()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvrc-bench-redis-") as tmp:
        proc = subprocess.Popen(
            [
                server,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--dir",
                tmp,
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                try:
                    redis.Redis(port=port).ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            runs = []
            for rate in rates:
                runs.append(_one_rate(port, rate, seconds))
                _log(
                    f"visibility at {rate}/s: p99 {runs[-1]['visibility_ms_p99']:.2f} ms "
                    f"({runs[-1]['achieved_events_per_s']}/s achieved)"
                )
            replicas = _measure_replicas(port, window_s, rounds)
            version = redis.Redis(port=port).info()["redis_version"]
        finally:
            proc.terminate()
            proc.wait(10)
    within = [r for r in runs if r["visibility_ms_p99"] <= TARGET_P99_MS]
    best = max(within, key=lambda r: r["achieved_events_per_s"]) if within else None
    ingest = best["achieved_events_per_s"] if best else 0
    return {
        "replicas": 2,
        "ingest_events_per_s": ingest,
        "visibility_ms_p50": best["visibility_ms_p50"] if best else None,
        "visibility_ms_p99": best["visibility_ms_p99"] if best else None,
        "target": {
            "visibility_ms_p99": TARGET_P99_MS,
            "ingest_events_per_s": TARGET_INGEST,
            "lookup_cpu_redis_vs_memory": TARGET_LOOKUP_CPU_RATIO,
            "grant_redis_vs_memory": TARGET_GRANT_RATIO,
        },
        "target_met": {
            "ingest_events_per_s": ingest >= TARGET_INGEST,
            "lookup_cpu_redis_vs_memory": (
                replicas["lookup_cpu_redis_vs_memory"] <= TARGET_LOOKUP_CPU_RATIO
            ),
            "grant_redis_vs_memory": replicas["grant_redis_vs_memory"] <= TARGET_GRANT_RATIO,
        },
        "redis_bytes_per_membership": runs[-1]["redis_log_bytes_per_membership"],
        "replica_bytes_per_membership": runs[-1]["replica_rss_bytes_per_membership"],
        "runs": runs,
        **replicas,
        "seconds_per_rate": seconds,
        "blocks_per_batch": BLOCKS_PER_BATCH,
        "redis_version": version,
        "cores": os.cpu_count(),
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rates", default=",".join(str(r) for r in DEFAULT_RATES))
    parser.add_argument(
        "--window-s", type=float, default=2.5, help="each lookup, grant and idle window"
    )
    parser.add_argument("--rounds", type=int, default=3, help="windows per configuration")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    report = run([int(x) for x in args.rates.split(",")], args.seconds, args.window_s, args.rounds)
    path = write_result("cluster", report, results_dir=args.results_dir)
    print(path)
    for r in report["runs"]:
        print(
            f"{r['target_events_per_s']:>8} target  {r['achieved_events_per_s']:>8} achieved  "
            f"p50 {r['visibility_ms_p50']:.2f} ms  p99 {r['visibility_ms_p99']:.2f} ms"
        )
    print(
        f"lookups/s 1 replica {report['lookup_rps_1']}, 3 replicas {report['lookup_rps_3']} "
        f"(x{report['lookup_rps_3_vs_1']} on {report['cores']} cores); CPU per lookup "
        f"{report['lookup_cpu_us_redis']} µs redis vs {report['lookup_cpu_us_memory']} µs memory"
    )
    print(
        f"grant p99 {report['grant_ms_p99_redis']} ms cross-replica vs "
        f"{report['grant_ms_p99_memory']} ms memory (x{report['grant_redis_vs_memory']}); "
        f"{report['redis_ops_per_prefix_load']} Redis commands per prefix load"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
