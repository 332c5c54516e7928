"""Transfer throughput: raw Mooncake batch reads vs the kvrc client path, same layout.

    python -m benchmarks.bench_transfer [--repeats 15] [--out benchmarks/results/transfer.json]

Two processes on loopback (Mooncake over tcp): this one reads, a peer process
(this module with `--serve-peer`) holds a registered KV cache of 64 KiB blocks
(one layer: 16 tokens x 8 heads x 128 x float16, K and V). For batches of 16,
256 and 1,024 blocks at scattered source positions (so no path gains from
coalescing) it measures, interleaved repetition by repetition:

* `raw`: `batch_transfer_sync_read` called directly, one entry per block;
* `pull`: the client data path without the coordinator: `TransferPlan.build`
  plus `clients.transfer.pull` (executor thread, deadline, outcome);
* `kvrc`: a stream of prefix loads, each RequestPrefixLoad (the coordinator
  picks the peer from the inventory it published, the peer pins over its
  session and answers its descriptor) -> plan from the grant -> `pull` ->
  CompletePrefixLoad (-> release to the peer), through a live `kvrc serve`
  subprocess, run the way an engine runs its load queue: the next load's grant
  is requested while this one's bytes move, and a report does not hold up the
  next pull. Pulls never overlap (one batch on the wire at a time, as in `raw`),
  so only control-plane time that cannot hide behind a pull costs throughput.
  Timed from the first grant request to the last report's answer, per load.
  The grant and the reports travel on the requester's session streams
  (protocol revision 3, `LeaseClient(..., session=...)`);
* `kvrc_unary`: the same stream of loads with the grant and the reports as unary
  RPCs (every client before revision 3; the vLLM scheduler still), measured
  interleaved with `kvrc`: its keys carry the `unary_` prefix;
* `kvrc_serial`: the same three steps for one load with nothing overlapped:
  the latency an isolated request sees (grant + pull + report, end to end).

`cpu_ms_per_batch` tallies the CPU each process spends per batch (raw: reader and
source; kvrc stream: requester, holder, coordinator): on a small host the tcp
transfer itself is CPU-bound, so control-plane CPU shows up as lost throughput.
`coordinator_cpu_ms_per_load` is the coordinator's share of that, and
`coordinator_cpu_vs_echo` divides it by `echo_server_cpu_us_per_call`: the server
CPU of one call of a bare grpc.aio echo measured in the same run (two calls in
flight, as a load stream has), so the coordinator's cost reads in bare RPCs.
`requester_cpu_vs_raw` is the requester's CPU per kvrc load over the raw reader's
per batch.

All of it twice: tp=1 (the keys at the top level), then `tp2`, the same keys
for a tp=2 layout: two rank parts per side, each holding half the KV heads (a
32 KiB shard of each block) with its own Mooncake engine, the holder's parts
registered as ranks 0 and 1 of one child engine, the requester's two parts
reading their shards at once (threads standing in for the two rank processes),
one grant per load and one report per part. `echo_server_cpu_us_per_call` is
measured once, for both.

Throughput is bytes / median seconds per batch, in GB/s (1e9 bytes). Every
batch is checked: a block whose first bytes do not name its source block fails
the run. Writes the JSON report (`benchmarks.common.write_json`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    ECHO_METHOD,
    REPO,
    RESULTS_DIR,
    drive_unary,
    process_cpu_seconds,
    start_echo_server,
    start_kvrc,
    stop_process,
    write_json,
)
from clients.kv_cache import KvCacheLayout, KvEndpointDescription, PagedKvCache
from clients.leases import LeaseClient, LeaseSessionHandler, PinAnswer, PinRequestInfo
from clients.leases import PrefixLoadGrant as LeaseGrant
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from clients.session import EngineProfile, EngineSession, RankPartRegistration
from clients.transfer import (
    TransferOutcome,
    TransferPlan,
    endpoint_to_session,
    plan_rank_part_pull,
    pull,
    rank_part_descriptor,
)
from kvrc.v1 import kvrc_pb2

DEFAULT_OUT = RESULTS_DIR / "transfer.json"
BATCH_SIZES = (16, 256, 1024)
BLOCK_BYTES = 64 * 1024
# 64 KiB per block: 2 (K, V) x 16 tokens x 8 heads x 128 dims x 2 bytes.
SOURCE_LAYOUT = KvCacheLayout(
    num_layers=1, num_blocks=2048, block_size=16, num_kv_heads=8, head_size=128, dtype="float16"
)
LOCAL_LAYOUT = KvCacheLayout(
    num_layers=1,
    num_blocks=max(BATCH_SIZES),
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    dtype="float16",
)
DEADLINE_S = 30.0
STREAM_LOADS = 8  # loads per timed kvrc stream
# Control plane alone (grant + reports, no pull): rounds of loads, the two transports
# alternating round by round.
CONTROL_ROUNDS = 6
CONTROL_LOADS = 50


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch of scattered blocks: local block i <- remote block remote_ids[i]."""

    remote_ids: tuple[int, ...]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(enumerate(self.remote_ids))

    @property
    def total_bytes(self) -> int:
        return len(self.remote_ids) * BLOCK_BYTES


# --- the peer process -------------------------------------------------------------


def rank_layout(layout: KvCacheLayout, tp: int) -> KvCacheLayout:
    """One rank part's shard of `layout` at tensor parallelism `tp` (its KV heads)."""
    return dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads // tp)


def serve_peer(kvrc_target: str | None = None, tp: int = 1) -> int:
    """Allocate, tag and register the source cache of each rank part; print each
    part's description (one JSON line per rank, rank 0 first); wait.

    With `kvrc_target` the peer is also the holder of a kvrc prefix load: each rank
    part registers, rank 0 publishes every block in the inventory, and each part
    answers pins with its own shard of the requested blocks.
    """
    endpoints = []
    caches = []  # registered memory must outlive the wait
    for _ in range(tp):
        engine = MooncakeTransferEngine(MooncakeConfig())
        cache = PagedKvCache(rank_layout(SOURCE_LAYOUT, tp), device="cpu")
        for block_id in range(SOURCE_LAYOUT.num_blocks):
            _tag(cache, block_id, block_id)
        endpoints.append(cache.register(engine))
        caches.append((engine, cache))
    if kvrc_target is not None:
        return asyncio.run(_serve_holder(kvrc_target, endpoints))
    for endpoint in endpoints:
        print(endpoint.to_json(), flush=True)
    for line in sys.stdin:  # end of stdin (our parent died) also ends the peer
        if line.strip() == "exit":
            break
    return 0


def block_hash(block_id: int) -> bytes:
    """The bench's (unchained) key of source block `block_id`."""
    return b"bench-block" + block_id.to_bytes(4, "big")


def _bench_registration(
    engine_id: str, endpoint: KvEndpointDescription, tp_rank: int = 0, tp_size: int = 1
) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=engine_id,
        profile=EngineProfile(model="bench", block_size=16, kv_dtype="float16", reuse_opt_in=True),
        endpoint=endpoint_to_session(endpoint),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


async def _serve_holder(target: str, endpoints: Sequence[KvEndpointDescription]) -> int:
    ids = {block_hash(b): b for b in range(SOURCE_LAYOUT.num_blocks)}
    tp = len(endpoints)

    def pin_of(endpoint: KvEndpointDescription, tp_rank: int) -> Callable[..., PinAnswer]:
        def pin(info: PinRequestInfo) -> PinAnswer:
            block_ids = [ids[h] for h in info.block_hashes if h in ids]
            if len(block_ids) != len(info.block_hashes):
                return PinAnswer(0, error_message="unknown block")
            descriptor = rank_part_descriptor(endpoint, block_ids, tp_rank=tp_rank)
            return PinAnswer(len(block_ids), descriptor)

        return pin

    sessions = []
    for tp_rank, endpoint in enumerate(endpoints):
        handler = LeaseSessionHandler(pin=pin_of(endpoint, tp_rank))
        registration = _bench_registration("bench-holder", endpoint, tp_rank, tp)
        session = EngineSession(target, registration, handler)
        handler.attach(session)
        ack = await session.start()
        sessions.append(session)
        if tp_rank == 0:  # one inventory per child engine
            await session.send_event_batch(
                kvrc_pb2.EventBatch(
                    incarnation=ack.incarnation,
                    sequence=0,
                    events=[
                        kvrc_pb2.InventoryEvent(
                            stored=kvrc_pb2.BlockStored(
                                block_hashes=list(ids), tier=kvrc_pb2.TIER_CPU
                            )
                        )
                    ],
                )
            )
    for endpoint in endpoints:
        print(endpoint.to_json(), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    for session in sessions:
        await session.close()
    return 0


def _tag(cache: PagedKvCache, block_id: int, value: int) -> None:
    cache.block_bytes_view(0, block_id)[:8].copy_(
        torch.tensor(list(value.to_bytes(8, "little")), dtype=torch.uint8)
    )


def _tag_of(cache: PagedKvCache, block_id: int) -> int:
    return int.from_bytes(bytes(cache.block_bytes_view(0, block_id)[:8].tolist()), "little")


class PeerProcess:
    def __init__(self, kvrc_target: str | None = None, tp: int = 1) -> None:
        holder = ["--kvrc-target", kvrc_target] if kvrc_target is not None else []
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_transfer",
                "--serve-peer",
                "--tp",
                str(tp),
                *holder,
            ],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Mooncake logs every connection at INFO
        )
        assert self.process.stdout is not None
        self.endpoints: list[KvEndpointDescription] = []
        for _ in range(tp):
            line = self.process.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"benchmark peer exited with {self.process.returncode}")
            self.endpoints.append(KvEndpointDescription.from_json(line))

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.write(b"exit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(timeout=10)


# --- the measured paths -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ranks:
    """This process's rank parts (the requester side): a Mooncake engine and a KV cache
    each. tp=2 stands for two rank processes: their reads run at once, on threads."""

    engines: tuple[MooncakeTransferEngine, ...]
    caches: tuple[PagedKvCache, ...]

    @property
    def tp(self) -> int:
        return len(self.engines)


def measure_raw(
    ranks: Ranks,
    remotes: Sequence[KvEndpointDescription],
    batch: Batch,
    executor: concurrent.futures.Executor,
) -> float:
    """Seconds for one raw batch read per rank part: one entry per block, no plan (tp=1:
    on this thread; tp=2: both ranks' reads at once)."""

    def read(rank: int) -> int:
        remote = remotes[rank]
        block_len = remote.layout.block_bytes
        local_base = ranks.caches[rank].describe().regions[0].base_addr
        remote_base = remote.regions[0].base_addr
        local_addresses = [local_base + i * block_len for i in range(len(batch.remote_ids))]
        remote_addresses = [remote_base + r * block_len for r in batch.remote_ids]
        lengths = [block_len] * len(batch.remote_ids)
        return ranks.engines[rank].read_batch_spinning(
            remote.session_name, local_addresses, remote_addresses, lengths
        )

    started = time.perf_counter()
    codes = [read(0)] if ranks.tp == 1 else list(executor.map(read, range(ranks.tp)))
    elapsed = time.perf_counter() - started
    if any(codes):
        raise RuntimeError(f"raw batch reads returned {codes}")
    return elapsed


def measure_pull(
    ranks: Ranks,
    remotes: Sequence[KvEndpointDescription],
    batch: Batch,
    loop: asyncio.AbstractEventLoop,
    executor: concurrent.futures.Executor,
) -> float:
    """Seconds for plan + `pull` (executor thread, own deadline) of every rank part, as
    engines run it."""

    async def one(rank: int) -> None:
        plan = TransferPlan.build(ranks.caches[rank].describe(), remotes[rank], batch.pairs)
        result = await pull(ranks.engines[rank], plan, deadline_s=DEADLINE_S, executor=executor)
        if result.outcome is not TransferOutcome.SUCCEEDED:
            raise RuntimeError(f"pull failed: {result.error}")

    async def once() -> float:
        started = time.perf_counter()
        await asyncio.gather(*(one(rank) for rank in range(ranks.tp)))
        return time.perf_counter() - started

    return loop.run_until_complete(once())


class KvrcPath:
    """A live `kvrc serve`, the holder peer, and this process as the requester: one
    session per rank part, one grant per load, one report per rank part.

    Grants and reports travel on the rank parts' session streams (protocol revision 3,
    `LeaseClient(..., session=...)`: the grant on rank 0's, each part's report on its
    own) or, with `unary=True`, as the unary RPCs RequestPrefixLoad and
    CompletePrefixLoad (what every client did before revision 3)."""

    def __init__(self, ranks: Ranks, loop: asyncio.AbstractEventLoop) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrc-bench-")
        tmp = Path(self._tmp.name)
        try:
            profiles = '[[profile]]\nname = "bench"\nmodel = "bench"\n'
            self.server = start_kvrc(tmp, profiles, metrics=False)
        except RuntimeError:
            self._tmp.cleanup()
            raise
        self.target = self.server.target
        self.peer = PeerProcess(self.target, ranks.tp)
        self.ranks = ranks
        self.loop = loop
        self.sessions = [
            EngineSession(
                self.target,
                _bench_registration("bench-requester", cache.describe(), rank, ranks.tp),
            )
            for rank, cache in enumerate(ranks.caches)
        ]
        self.requests = 0
        for session in self.sessions:
            loop.run_until_complete(session.start())
        # Their channels bind to `loop`: made inside it.
        self.unary_client = loop.run_until_complete(self._client(None))
        self.stream_clients = [loop.run_until_complete(self._client(s)) for s in self.sessions]

    async def _client(self, session: EngineSession | None) -> LeaseClient:
        return LeaseClient(self.target, "bench-requester", session=session)

    def _clients(self, unary: bool) -> list[LeaseClient]:
        """The client of each rank part (the first one asks for the grants)."""
        return [self.unary_client] * self.ranks.tp if unary else self.stream_clients

    async def _grant(self, batch: Batch, unary: bool) -> LeaseGrant:
        self.requests += 1
        grant = await self._clients(unary)[0].request_prefix_load(
            f"bench-{self.requests}",
            [block_hash(b) for b in batch.remote_ids],
            min_blocks=len(batch.remote_ids),
            pin_timeout_ms=5_000,
            transfer_timeout_ms=int(DEADLINE_S * 1000),
        )
        if not isinstance(grant, LeaseGrant):
            raise RuntimeError(f"kvrc answered a miss: {grant}")
        return grant

    async def _pull(
        self, batch: Batch, grant: LeaseGrant, executor: concurrent.futures.Executor
    ) -> list[kvrc_pb2.TransferReport]:
        async def one(rank: int) -> kvrc_pb2.TransferReport:
            plan = plan_rank_part_pull(
                self.ranks.caches[rank].describe(),
                list(range(len(batch.remote_ids))),
                grant.source_parts,
                tp_rank=rank,
                tp_size=self.ranks.tp,
            )
            result = await pull(
                self.ranks.engines[rank], plan, deadline_s=DEADLINE_S, executor=executor
            )
            if result.outcome is not TransferOutcome.SUCCEEDED:
                raise RuntimeError(f"kvrc path pull failed: {result.error}")
            return result.to_report(
                lease_id=grant.lease_id, reporter_child_engine_id="bench-requester", tp_rank=rank
            )

        return list(await asyncio.gather(*(one(rank) for rank in range(self.ranks.tp))))

    async def _complete(self, reports: Sequence[kvrc_pb2.TransferReport], unary: bool) -> None:
        clients = self._clients(unary)
        done = await asyncio.gather(
            *(client.complete_prefix_load(r) for client, r in zip(clients, reports, strict=True))
        )
        # The last part's report ends the lease, whichever kvrc took last.
        if not any(d.state == "COMPLETED" for d in done):
            raise RuntimeError(f"kvrc path reports answered {[d.state for d in done]}")

    def measure_serial(self, batch: Batch, executor: concurrent.futures.Executor) -> float:
        """Seconds for RequestPrefixLoad -> pull -> CompletePrefixLoad of one batch."""

        async def once() -> float:
            started = time.perf_counter()
            grant = await self._grant(batch, unary=False)
            await self._complete(await self._pull(batch, grant, executor), unary=False)
            return time.perf_counter() - started

        return self.loop.run_until_complete(once())

    def measure_stream(
        self,
        batch: Batch,
        executor: concurrent.futures.Executor,
        loads: int,
        *,
        unary: bool = False,
    ) -> float:
        """Seconds per load over `loads` back-to-back loads of `batch`, pipelined.

        Load i+1's grant is requested when load i's pull starts; load i's reports
        run while load i+1 pulls. Every load's blocks are cleared before and
        checked after its pull, inside the timed window.
        """

        async def stream() -> float:
            started = time.perf_counter()
            next_grant = asyncio.ensure_future(self._grant(batch, unary))
            reports: list[asyncio.Future[None]] = []
            try:
                for i in range(loads):
                    grant = await next_grant
                    if i + 1 < loads:
                        next_grant = asyncio.ensure_future(self._grant(batch, unary))
                    check = _clear_and_check(self.ranks, batch)
                    parts = await self._pull(batch, grant, executor)
                    check()
                    reports.append(asyncio.ensure_future(self._complete(parts, unary)))
                await asyncio.gather(*reports)
            finally:
                pending: list[asyncio.Future[Any]] = [next_grant, *reports]
                for task in pending:
                    if not task.done():
                        task.cancel()
            return (time.perf_counter() - started) / loads

        return self.loop.run_until_complete(stream())

    def measure_control_plane(self, batch: Batch, loads: int, *, unary: bool) -> float:
        """Seconds per load of grant + reports alone, one load at a time, no bytes moved.

        The coordinator's CPU over these is its cost per load without a transfer's
        CPU beside it on the host (what `coordinator_cpu_ms_per_load` carries)."""

        async def run() -> float:
            started = time.perf_counter()
            for _ in range(loads):
                grant = await self._grant(batch, unary)
                reports = [
                    kvrc_pb2.TransferReport(
                        lease_id=grant.lease_id,
                        reporter_child_engine_id="bench-requester",
                        rank=kvrc_pb2.RankCoordinates(tp_rank=rank),
                        outcome=kvrc_pb2.TRANSFER_OUTCOME_SUCCEEDED,
                        bytes_moved=batch.total_bytes // self.ranks.tp,
                        duration_us=1_000,
                    )
                    for rank in range(self.ranks.tp)
                ]
                await self._complete(reports, unary)
            return (time.perf_counter() - started) / loads

        return self.loop.run_until_complete(run())

    def close(self) -> None:
        if hasattr(self, "stream_clients"):
            for client in (self.unary_client, *self.stream_clients):
                self.loop.run_until_complete(client.close())
            for session in self.sessions:
                self.loop.run_until_complete(session.close())
        if hasattr(self, "peer"):
            self.peer.close()
        self.server.stop()
        self._tmp.cleanup()


# --- the run ------------------------------------------------------------------------


class CpuTally:
    """CPU seconds that named processes spend inside measured windows.

    A pid of 0 is this process (all its threads, Mooncake's included). /proc
    counts in clock ticks (10 ms), so a tally is only read over many batches.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self._pids = pids
        self._seconds = dict.fromkeys(pids, 0.0)
        self._batches = 0

    def _now(self) -> dict[str, float]:
        return {
            name: time.process_time() if pid == 0 else process_cpu_seconds(pid)
            for name, pid in self._pids.items()
        }

    @contextlib.contextmanager
    def window(self, batches: int) -> Iterator[None]:
        before = self._now()
        yield
        after = self._now()
        for name in self._pids:
            self._seconds[name] += after[name] - before[name]
        self._batches += batches

    def ms_per_batch(self) -> dict[str, float]:
        return {
            name: round(seconds * 1000 / max(self._batches, 1), 2)
            for name, seconds in self._seconds.items()
        }


# The echo runs as a load's RPCs do: at most two in flight (the next grant overlaps a pull).
ECHO_CONCURRENCY = 2
ECHO_ROUNDS = 3
ECHO_WINDOW_S = 2.0


def echo_server_cpu_us(loop: asyncio.AbstractEventLoop) -> float:
    """Server CPU µs per call of a bare grpc.aio unary echo: this run's unit of RPC cost."""
    import grpc

    process, port = start_echo_server(64)
    request = [bytes(64)]

    async def measure() -> list[float]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            await drive_unary(channel, ECHO_METHOD, request, 0.5, process.pid, ECHO_CONCURRENCY)
            return [
                (
                    await drive_unary(
                        channel, ECHO_METHOD, request, ECHO_WINDOW_S, process.pid, ECHO_CONCURRENCY
                    )
                )[1]
                for _ in range(ECHO_ROUNDS)
            ]

    try:
        return statistics.median(loop.run_until_complete(measure()))
    finally:
        stop_process(process)


def _cost_keys(
    cpu_ms: dict[str, dict[str, dict[str, float]]], echo_us: float | None, path: str = "kvrc"
) -> dict[str, Any]:
    """The coordinator's CPU per load against the echo's per call; the requester's against raw."""
    kvrc_cpu = cpu_ms[path]
    coordinator = {key: tally["coordinator"] for key, tally in kvrc_cpu.items()}
    return {
        "coordinator_cpu_ms_per_load": coordinator,
        "coordinator_cpu_vs_echo": _vs_echo(coordinator, echo_us),
        "requester_cpu_vs_raw": {
            key: round(tally["requester"] / cpu_ms["raw"][key]["requester"], 3)
            for key, tally in kvrc_cpu.items()
        },
    }


def _vs_echo(ms_by_key: Mapping[str, float | None], echo_us: float | None) -> dict[str, Any]:
    """CPU ms per load in units of the echo's server CPU per call (None: not measured)."""
    return {
        key: round(ms * 1000 / echo_us, 3) if echo_us and ms is not None else None
        for key, ms in ms_by_key.items()
    }


def _control_plane(
    path: KvrcPath, batch: Batch, pids: dict[str, int]
) -> dict[str, dict[str, float]]:
    """CPU ms per load (coordinator, requester, holder) and ms per load, per transport."""
    tallies = {"session": CpuTally(pids), "unary": CpuTally(pids)}
    seconds: dict[str, list[float]] = {"session": [], "unary": []}
    path.measure_control_plane(batch, 10, unary=False)  # warm both
    path.measure_control_plane(batch, 10, unary=True)
    for i in range(CONTROL_ROUNDS):
        order = ("session", "unary") if i % 2 == 0 else ("unary", "session")
        for transport in order:
            with tallies[transport].window(CONTROL_LOADS):
                seconds[transport].append(
                    path.measure_control_plane(batch, CONTROL_LOADS, unary=transport == "unary")
                )
    return {
        transport: {
            **tallies[transport].ms_per_batch(),
            "ms_per_load": round(statistics.median(seconds[transport]) * 1000, 3),
        }
        for transport in tallies
    }


def _control_keys(
    control: dict[str, dict[str, dict[str, float]]], echo_us: float | None
) -> dict[str, Any]:
    """The control plane's figures by transport, and the session stream's over the unary."""
    by: dict[str, dict[str, dict[str, float | None]]] = {}
    for key, transports in control.items():
        for transport, figures in transports.items():
            for name, value in figures.items():
                by.setdefault(name, {}).setdefault(transport, {})[key] = value
    coordinator = by.get("coordinator", {})
    return {
        "loads_per_transport": CONTROL_ROUNDS * CONTROL_LOADS,
        "coordinator_cpu_ms_per_load": coordinator,
        "requester_cpu_ms_per_load": by.get("requester", {}),
        "holder_cpu_ms_per_load": by.get("holder", {}),
        "ms_per_load": by.get("ms_per_load", {}),
        "coordinator_cpu_vs_echo": {
            transport: _vs_echo(values, echo_us) for transport, values in coordinator.items()
        },
        "session_vs_unary_coordinator_cpu": {
            key: round(ms / unary, 3) if ms and (unary := coordinator["unary"].get(key)) else None
            for key, ms in coordinator.get("session", {}).items()
        },
    }


def _ratios(measured: dict[str, float | None], raw: dict[str, float]) -> dict[str, float | None]:
    return {
        key: None if value is None else round(value / raw[key], 4)
        for key, value in measured.items()
    }


def _median_gbps(total_bytes: int, seconds: Sequence[float]) -> float:
    return total_bytes / statistics.median(seconds) / 1e9


_CLEARED_TAG = -1  # no source block carries it


def _block_tags(local: PagedKvCache, count: int) -> torch.Tensor:
    """View of the first 8 bytes of local blocks 0..count-1, as int64 tags."""
    layer = local.layers[0]
    return layer.reshape(layer.shape[0], -1).view(torch.uint8)[:count, :8].view(torch.int64)


def _clear_and_check(ranks: Ranks, batch: Batch) -> Callable[[], None]:
    """Mark the batch's local blocks of every rank part as empty; the returned check
    fails unless each then names its source block (vectorised: cheap enough to sit in
    a timed loop)."""
    count = len(batch.remote_ids)
    for local in ranks.caches:
        _block_tags(local, count).fill_(_CLEARED_TAG)
    expected = torch.tensor(batch.remote_ids, dtype=torch.int64).reshape(count, 1)

    def check() -> None:
        for rank, local in enumerate(ranks.caches):
            wrong = (_block_tags(local, count) != expected).nonzero()
            if len(wrong):
                i = int(wrong[0][0])
                raise RuntimeError(
                    f"rank {rank}: local block {i} holds block {_tag_of(local, i)}, "
                    f"expected {batch.remote_ids[i]}"
                )

    return check


def run(
    repeats: int, warmup: int, with_kvrc: bool = True, tp: int = 1, echo_us: float | None = None
) -> dict[str, Any]:
    """Every figure for one layout; `echo_us` measured here when not given."""
    layout = rank_layout(LOCAL_LAYOUT, tp)
    engines = tuple(MooncakeTransferEngine(MooncakeConfig()) for _ in range(tp))
    caches = tuple(PagedKvCache(layout, device="cpu") for _ in range(tp))
    for engine, cache in zip(engines, caches, strict=True):
        cache.register(engine)
    ranks = Ranks(engines, caches)
    peer = PeerProcess(tp=tp)
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=2 * tp)
    kvrc_path = KvrcPath(ranks, loop) if with_kvrc else None
    rng = random.Random(20260)
    raw: dict[str, float] = {}
    pulled: dict[str, float] = {}
    kvrc: dict[str, float | None] = {}
    kvrc_unary: dict[str, float | None] = {}
    serial: dict[str, float | None] = {}
    raw_seconds: dict[str, list[float]] = {}
    cpu_ms: dict[str, dict[str, dict[str, float]]] = {"raw": {}, "kvrc": {}, "kvrc_unary": {}}
    control: dict[str, dict[str, dict[str, float]]] = {}
    remotes = peer.endpoints
    try:
        for size in BATCH_SIZES:
            batch = Batch(tuple(rng.sample(range(SOURCE_LAYOUT.num_blocks), size)))
            for _ in range(warmup):
                measure_raw(ranks, remotes, batch, executor)
                measure_pull(ranks, remotes, batch, loop, executor)
                if kvrc_path is not None:
                    kvrc_path.measure_serial(batch, executor)
                    kvrc_path.measure_stream(batch, executor, STREAM_LOADS)
                    kvrc_path.measure_stream(batch, executor, STREAM_LOADS, unary=True)
            raw_runs: list[float] = []
            pull_runs: list[float] = []
            kvrc_runs: list[float] = []
            unary_runs: list[float] = []
            serial_runs: list[float] = []
            raw_cpu = CpuTally({"requester": 0, "source": peer.process.pid})
            kvrc_pids = (
                {
                    "requester": 0,
                    "holder": kvrc_path.peer.process.pid,
                    "coordinator": kvrc_path.server.process.pid,
                }
                if kvrc_path is not None
                else {}
            )
            kvrc_cpu = CpuTally(kvrc_pids) if kvrc_path is not None else None
            unary_cpu = CpuTally(kvrc_pids)
            for _ in range(repeats):  # interleaved, so drift hits both paths alike
                check = _clear_and_check(ranks, batch)
                with raw_cpu.window(1):
                    raw_runs.append(measure_raw(ranks, remotes, batch, executor))
                check()
                check = _clear_and_check(ranks, batch)
                pull_runs.append(measure_pull(ranks, remotes, batch, loop, executor))
                check()
                if kvrc_path is not None and kvrc_cpu is not None:
                    check = _clear_and_check(ranks, batch)
                    serial_runs.append(kvrc_path.measure_serial(batch, executor))
                    check()
                    with kvrc_cpu.window(STREAM_LOADS):
                        kvrc_runs.append(kvrc_path.measure_stream(batch, executor, STREAM_LOADS))
                    with unary_cpu.window(STREAM_LOADS):
                        unary_runs.append(
                            kvrc_path.measure_stream(batch, executor, STREAM_LOADS, unary=True)
                        )
            key = str(size)
            if kvrc_path is not None:
                control[key] = _control_plane(kvrc_path, batch, kvrc_pids)
            raw[key] = round(_median_gbps(batch.total_bytes, raw_runs), 4)
            pulled[key] = round(_median_gbps(batch.total_bytes, pull_runs), 4)
            kvrc[key] = round(_median_gbps(batch.total_bytes, kvrc_runs), 4) if kvrc_runs else None
            kvrc_unary[key] = (
                round(_median_gbps(batch.total_bytes, unary_runs), 4) if unary_runs else None
            )
            serial[key] = (
                round(_median_gbps(batch.total_bytes, serial_runs), 4) if serial_runs else None
            )
            raw_seconds[key] = [round(s, 6) for s in raw_runs]
            cpu_ms["raw"][key] = raw_cpu.ms_per_batch()
            if kvrc_cpu is not None:
                cpu_ms["kvrc"][key] = kvrc_cpu.ms_per_batch()
                cpu_ms["kvrc_unary"][key] = unary_cpu.ms_per_batch()
            print(
                f"tp={tp} {size:>5} blocks x 64 KiB: raw {raw[key]:.3f} GB/s, "
                f"pull {pulled[key]:.3f} GB/s ({pulled[key] / raw[key]:.2f} of raw), "
                f"kvrc {kvrc[key]} GB/s (unary RPCs: {kvrc_unary[key]} GB/s; "
                f"one load alone: {serial[key]} GB/s)",
                flush=True,
            )
        if echo_us is None and kvrc_path is not None:
            echo_us = echo_server_cpu_us(loop)
    finally:
        if kvrc_path is not None:
            kvrc_path.close()
        peer.close()
        executor.shutdown(wait=True)
        loop.close()
        for cache in caches:
            cache.unregister()
    return {
        "tp": tp,
        "raw_gbps": raw,
        "pull_gbps": pulled,
        "pull_vs_raw": {key: round(pulled[key] / raw[key], 4) for key in raw},
        "kvrc_gbps": kvrc,
        "kvrc_vs_raw": _ratios(kvrc, raw),
        "cpu_ms_per_batch": cpu_ms,
        "echo_server_cpu_us_per_call": round(echo_us, 1) if echo_us else None,
        **_cost_keys(cpu_ms, echo_us),
        # The same loads with grant and reports as unary RPCs (before revision 3).
        "kvrc_unary_gbps": kvrc_unary,
        "kvrc_unary_vs_raw": _ratios(kvrc_unary, raw),
        **{f"unary_{k}": v for k, v in _cost_keys(cpu_ms, echo_us, "kvrc_unary").items()},
        "control_plane": _control_keys(control, echo_us),
        "kvrc_serial_gbps": serial,
        "kvrc_serial_vs_raw": _ratios(serial, raw),
        "raw_seconds": raw_seconds,
    }


def report(repeats: int, warmup: int, with_kvrc: bool = True) -> dict[str, Any]:
    """tp=1, then the same under `tp2` (two rank parts per side), one echo for both."""
    tp1 = run(repeats, warmup, with_kvrc, tp=1)
    tp2 = run(repeats, warmup, with_kvrc, tp=2, echo_us=tp1["echo_server_cpu_us_per_call"])
    return {
        "benchmark": "transfer",
        "transport": "mooncake tcp, loopback, two processes, CPU memory",
        "block_bytes": BLOCK_BYTES,
        "batch_sizes": list(BATCH_SIZES),
        "layout": "scattered source blocks, one entry per block (per rank part)",
        "repeats": repeats,
        "kvrc_loads_per_stream": STREAM_LOADS,
        **{k: v for k, v in tp1.items() if k != "tp"},
        "tp2": {k: v for k, v in tp2.items() if k not in ("tp", "echo_server_cpu_us_per_call")},
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "finished_unix_s": int(time.time()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-kvrc", action="store_true", help="skip the kvrc lease path")
    parser.add_argument("--serve-peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kvrc-target", help=argparse.SUPPRESS)
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_peer:
        return serve_peer(args.kvrc_target, args.tp)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    # Quiet Mooncake's per-connection INFO logs in this process too.
    os.environ.setdefault("GLOG_minloglevel", "1")
    write_json(args.out, report(args.repeats, args.warmup, with_kvrc=not args.no_kvrc))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
