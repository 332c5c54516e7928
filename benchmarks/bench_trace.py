"""Cluster-scale trace replay through the real kvrc service (issue 8).

    python -m benchmarks.bench_trace --trace PATH --engines 10 \\
        --capacity-tokens 3000000 --speedup 50 --out benchmarks/results

What runs:
- `local_rr`, `local_kv`, `upper_bound`: the pure simulator (`trace_sim`); they
  need no coordinator.
- `kvrc_cost` and the static thresholds (`kvrc_kv` at each `min_blocks` of
  `STATIC_MIN_BLOCKS`): the simulator with the in-process reference provider;
  kvrc_cost's gate is the coordinator's own `CostModel` (`trace_sim.LoadGate`).
  `kvrc_cost_ttft_vs_static` / `kvrc_cost_ttft_vs_local` compare its mean TTFT
  with the best static threshold's and local_kv's (and `*_p99_*` the p99s).
- `--slow-pairs`: instead of a trace file, the seeded slow-pairs trace and its
  8-engine, two-group cluster (`benchmarks.slow_pairs`), generated at run time;
  `load_sweep` repeats the model's comparison on the same trace at each rate of
  `LOAD_SWEEP_RATES_PER_S` (the first is the trace's own).
- `kvrc_rr`, `kvrc_kv`: a real `python -m coordinator serve --reuse on` process
  and N simulated prefill engines in metadata-only mode, each a real session
  stream registering one rank part. Engines publish BlockStored/BlockRemoved
  for their LRU caches over their sessions, routers and engines call the real
  Lookup, and loads take real prefix-load leases: RequestPrefixLoad -> the
  coordinator sends a PinRequest to the holder's session -> the holder pins
  what its simulated cache still holds -> grant -> CompletePrefixLoad
  (SUCCEEDED, no KV bytes) -> the coordinator's ReleaseRequest -> unpin. The
  replay is paced: virtual time t runs at wall time t / speedup. TTFT comes
  from the virtual-time cost model; lookup latency is wall clock through gRPC.
  The same two modes also run with the in-process reference provider, and the
  report says whether the service reproduced them.
- `max_sustained_speedup`: the highest speedup at which a kvrc_kv replay
  sustained. kvrc_kv is replayed at the default speedup, then at twice that,
  and so on (see `search_max_speedup`). A step fails when lookup p99 >= 10
  ms, an event is lost (after the replay, a Lookup of every block any engine ever published
  disagrees with the engines' caches about who holds it, a stream went stale,
  or a resync was requested), or the replay could not keep pace (it ended more
  than 10 % + 1 s behind its schedule; bursts may lag for a moment). The
  driver shares the machine's cores with the coordinator, so this is a lower
  bound on what the coordinator alone sustains.

Writes `<out>/trace-<trace stem>.json` and `<out>/trace-<trace stem>.png`
(cumulative hit ratio over the trace, one line per mode).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from benchmarks.common import (
    REPO,
    RESULTS_DIR,
    histogram_percentile_ms,
    percentile,
    rpc_histogram,
    start_kvrc,
    write_result,
)
from benchmarks.slow_pairs import SLOW_PAIRS, SlowPairsSpec
from benchmarks.slow_pairs import generate as generate_slow_pairs
from benchmarks.trace_sim import (
    DEFAULT_CAPACITY_TOKENS,
    DEFAULT_ENGINES,
    DEFAULT_TRACE,
    REPLICATION_CHARGE,
    BlockId,
    Candidate,
    CostModel,
    EngineIndex,
    HolderSide,
    LoadGrant,
    Mode,
    ModeResult,
    TraceRequest,
    TraceSimulation,
    best_possible_hit_ratio,
    load_trace,
    simulate,
)
from clients.errors import KvrcClientError
from clients.inventory import (
    InventoryEvent,
    InventoryPublisher,
    LookupClient,
    LookupOutcome,
    LookupResult,
    PublishingHandler,
    RemovedBlocks,
    StoredBlocks,
)
from clients.leases import (
    LeaseClient,
    LeaseSessionHandler,
    PinAnswer,
    PinRequestInfo,
    PrefixLoadGrant,
)
from clients.session import EngineProfile, EngineSession, NullHandler, RankPartRegistration
from clients.transfer import TransferOutcome, TransferResult
from coordinator.core.cost_model import CostConfig
from kvrc.v1 import kvrc_pb2 as pb
from kvrc.v1 import kvrc_pb2_grpc as pb_grpc
from kvrc.vocabulary import MAX_CHAIN_BLOCKS, Tier, TransferEndpoint

T = TypeVar("T")

DEFAULT_OUT = RESULTS_DIR
DEFAULT_SPEEDUP = 50.0
LOOKUP_P99_LIMIT_MS = 10.0
# A replay keeps pace when it ends within 10 % (+1 s) of its schedule; bursts of
# same-instant arrivals may lag for a moment, as long as the replay catches up.
PACE_SLACK = 1.1
PACE_SLACK_S = 1.0
MODEL = "mooncake-trace-sim"
RPC_TIMEOUT_S = 10.0
RELEASE_WAIT_S = 5.0
# Chains beyond the coordinator's limit (kvrc.vocabulary.MAX_CHAIN_BLOCKS) are looked
# up by their head (2M tokens is far past any useful prefix). Event batches are cut by
# InventoryPublisher.
LOOKUP_QUERIES_PER_CHECK = 64  # the coordinator's queries-per-Lookup limit
# The static thresholds kvrc_cost is compared with (issue 25): kvrc_kv at each.
STATIC_MIN_BLOCKS = (1, 4, 16, 64, 256)
# The slow-pairs trace again at these arrival rates (the same seed, cluster and
# documents; the first is the trace itself): how kvrc_cost's gain over the best static
# threshold moves as the prefill engines get busier (docs/benchmarks.md, "Load").
LOAD_SWEEP_RATES_PER_S = (12.0, 16.0, 20.0, 24.0)


def block_hash(block: BlockId) -> bytes:
    """Trace ids are already prefix hashes: 8 bytes big-endian on the wire."""
    return block.to_bytes(8, "big")


def block_from_hash(raw: bytes) -> BlockId:
    return int.from_bytes(raw, "big")


# ---------------------------------------------------------------------------
# The coordinator (benchmarks.common.start_kvrc) and its declared profile
# ---------------------------------------------------------------------------


PROFILES_TOML = f"""# Declared profile of the simulated engines (metadata only).
[[profile]]
name = "trace-sim"
model = "{MODEL}"
block_size = 512
"""


# ---------------------------------------------------------------------------
# One simulated engine (metadata only), on the client library
# ---------------------------------------------------------------------------


def engine_registration(child_engine_id: str) -> RankPartRegistration:
    return RankPartRegistration(
        engine_id=child_engine_id,
        profile=EngineProfile(
            model=MODEL,
            block_size=512,
            kv_dtype="bfloat16",
            gpu_kind="simulated",
            reuse_opt_in=True,
        ),
        endpoint=TransferEndpoint(backend="mooncake", session_name=f"simulated/{child_engine_id}"),
    )


@dataclass
class LinkCounters:
    resyncs: int = 0
    aborts: int = 0
    quarantines: int = 0
    late_pins: int = 0
    send_errors: list[str] = field(default_factory=list)


class HolderBridge:
    """Where session handlers (loop thread) meet the simulation (replay thread).

    A PinRequest is answered from the holder's simulated cache only while the
    replay thread is blocked inside RequestPrefixLoad (the pin window), so the
    cache is never read and changed at once. Releases are recorded and waited
    for by the replay thread, which then unpins.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holders: HolderSide | None = None
        self._window_open = False
        self._window_pins: dict[str, EngineIndex] = {}
        self._released: set[str] = set()
        self.counters = LinkCounters()

    def bind(self, holders: HolderSide) -> None:
        self._holders = holders

    def open_window(self) -> None:
        with self._cond:
            self._window_open = True
            self._window_pins = {}

    def close_window(self) -> dict[str, EngineIndex]:
        with self._cond:
            self._window_open = False
            pins, self._window_pins = self._window_pins, {}
            return pins

    def pin(self, engine: EngineIndex, lease_id: str, hashes: Sequence[bytes]) -> int:
        with self._cond:
            if not self._window_open or self._holders is None:
                self.counters.late_pins += 1
                return 0
            chain = [block_from_hash(h) for h in hashes]
            pinned = self._holders.pin_prefix(engine, lease_id, chain)
            if pinned:
                self._window_pins[lease_id] = engine
            else:
                self._holders.unpin(engine, lease_id)  # holds nothing: no release follows
            return pinned

    def unpin(self, engine: EngineIndex, lease_id: str) -> None:
        assert self._holders is not None
        self._holders.unpin(engine, lease_id)

    def released(self, lease_id: str) -> None:
        with self._cond:
            self._released.add(lease_id)
            self._cond.notify_all()

    def wait_released(self, lease_id: str, timeout_s: float) -> bool:
        with self._cond:
            ok = self._cond.wait_for(lambda: lease_id in self._released, timeout_s)
            self._released.discard(lease_id)
            return ok


class _Counting(NullHandler):
    """Innermost handler: counts what means the replay lost something."""

    def __init__(self, counters: LinkCounters) -> None:
        self._counters = counters

    async def on_resync_request(self, request: pb.ResyncRequest) -> None:
        self._counters.resyncs += 1  # the coordinator saw a gap: an event was lost


class SimEngineLink:
    """One simulated engine on the client library: `EngineSession` +
    `InventoryPublisher` (events) + `LeaseSessionHandler` (pins) + `LeaseClient`.

    Metadata only: pins are answered from the simulated cache, releases
    acknowledged, aborts acknowledged at once (no native transfer runs).
    """

    def __init__(
        self,
        target: str,
        channel: grpc.aio.Channel,
        index: EngineIndex,
        name: str,
        bridge: HolderBridge,
    ) -> None:
        self.index = index
        self.child_engine_id = name
        self._bridge = bridge
        self.leases = LeaseClient(channel, name, timeout_s=RPC_TIMEOUT_S)
        self._lease_handler = LeaseSessionHandler(
            pin=self._pin,
            abort=self._abort,
            on_release=self._on_release,
            on_quarantine=self._on_quarantine,
            inner=_Counting(bridge.counters),
        )
        self.session = EngineSession(target, engine_registration(name), reconnect=False)
        # A lost event shows as a stale stream at the end (no dump callback on purpose).
        self.publisher = InventoryPublisher(self.session)
        self.session.handler = PublishingHandler(self.publisher, self._lease_handler)
        self._lease_handler.attach(self.session)
        self._events: asyncio.Queue[list[InventoryEvent] | None] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ack = await self.session.start()
        if not ack.reuse.enabled:
            raise RuntimeError(f"{self.child_engine_id}: reuse is not enabled: {ack.reuse.detail}")
        await self.session.wait_ready(timeout_s=RPC_TIMEOUT_S)
        self._writer = asyncio.create_task(self._write_events())

    def publish(self, events: list[InventoryEvent]) -> None:
        """Loop thread only (the replay thread goes through call_soon_threadsafe)."""
        self._events.put_nowait(events)

    async def flush(self) -> None:
        """Until every event published so far has been written to the stream."""
        await self._events.join()

    async def _write_events(self) -> None:
        while True:
            events = await self._events.get()
            try:
                if events is None:
                    return
                await self.publisher.publish(events)
            except KvrcClientError as e:
                self._bridge.counters.send_errors.append(f"{self.child_engine_id}: {e}")
            finally:
                self._events.task_done()

    async def close(self) -> None:
        self._events.put_nowait(None)
        if self._writer is not None:
            await self._writer
        await self._lease_handler.aclose()
        await self.session.close()

    # --- holder callbacks (LeaseSessionHandler) -----------------------------------
    def _pin(self, info: PinRequestInfo) -> PinAnswer:
        pinned = self._bridge.pin(self.index, info.lease_id, info.block_hashes)
        if not pinned:
            return PinAnswer(0)
        # Metadata only: engine-local block ids stand in for real KV addresses.
        descriptor = pb.RankPartDescriptor(rank=pb.RankCoordinates(), block_ids=range(pinned))
        return PinAnswer(pinned, descriptor)

    async def _abort(self, lease_id: str, reason: str) -> None:
        self._bridge.counters.aborts += 1  # no native operation to stop

    def _on_release(self, lease_id: str, reason: str) -> None:
        self._bridge.released(lease_id)

    def _on_quarantine(self, lease_id: str, reason: str) -> None:
        self._bridge.counters.quarantines += 1


# ---------------------------------------------------------------------------
# The kvrc-backed reuse provider
# ---------------------------------------------------------------------------


@dataclass
class RealRunStats:
    lookup_ms: list[float] = field(default_factory=list)
    reuse_unavailable: int = 0
    grants: int = 0
    misses: int = 0
    missing_releases: int = 0
    # Wall ms of each step of a load, as the replay thread sees it.
    request_load_ms: list[float] = field(default_factory=list)
    complete_ms: list[float] = field(default_factory=list)
    release_wait_ms: list[float] = field(default_factory=list)


class KvrcProvider:
    """ReuseProvider over the real service and the client library.

    The replay thread runs the clients' coroutines on the sessions' loop and
    waits for them; lookup latency is timed inside the coroutine, around the
    client call (wall clock through gRPC, without the thread hand-off).
    """

    def __init__(
        self,
        links: Sequence[SimEngineLink],
        loop: asyncio.AbstractEventLoop,
        bridge: HolderBridge,
        lookups: LookupClient,
    ) -> None:
        self._links = list(links)
        self._ids = [link.child_engine_id for link in links]
        self._index = {cid: i for i, cid in enumerate(self._ids)}
        self._loop = loop
        self._bridge = bridge
        self._lookups = lookups
        self._next_request = 0
        self._requester_of: dict[str, EngineIndex] = {}
        self.stats = RealRunStats()
        self.stored_ever: set[BlockId] = set()  # for the end-of-run view check

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(RPC_TIMEOUT_S * 3)

    # --- ReuseProvider ------------------------------------------------------
    def bind(self, holders: HolderSide, num_engines: int) -> None:
        if num_engines != len(self._links):
            raise ValueError("one session per simulated engine")
        self._bridge.bind(holders)

    def lookup(
        self, requester: EngineIndex, chain: Sequence[BlockId], include_self: bool, now_ms: float
    ) -> list[Candidate]:
        hashes = [block_hash(b) for b in chain[:MAX_CHAIN_BLOCKS]]

        async def timed() -> tuple[LookupResult, float]:
            started = time.perf_counter()
            result = await self._lookups.lookup(
                self._ids[requester],
                hashes,
                min_blocks=1,
                include_self=include_self,
                max_candidates=2,
                timeout_s=RPC_TIMEOUT_S,
            )
            return result, (time.perf_counter() - started) * 1000.0

        result, ms = self._run(timed())
        self.stats.lookup_ms.append(ms)
        if result.outcome is LookupOutcome.REUSE_UNAVAILABLE:
            self.stats.reuse_unavailable += 1
            return []
        return [
            Candidate(self._index[c.child_engine_id], c.matched_blocks)
            for c in result.candidates
            if c.child_engine_id in self._index
        ]

    def acquire(
        self,
        requester: EngineIndex,
        chain: Sequence[BlockId],
        min_blocks: int,
        now_ms: float,
        local_blocks: int = 0,
    ) -> LoadGrant | None:
        self._next_request += 1
        leases = self._links[requester].leases
        hashes = [block_hash(b) for b in chain[:MAX_CHAIN_BLOCKS]]
        self._bridge.open_window()
        started = time.perf_counter()
        try:
            answer = self._run(
                leases.request_prefix_load(
                    f"load-{self._next_request}",
                    hashes,
                    min_blocks=min_blocks,
                    local_blocks=min(local_blocks, len(hashes) - 1),
                    pin_timeout_ms=5_000,
                    transfer_timeout_ms=60_000,
                )
            )
        finally:
            pins = self._bridge.close_window()
        self.stats.request_load_ms.append((time.perf_counter() - started) * 1000.0)
        granted = isinstance(answer, PrefixLoadGrant)
        for lease_id, engine in pins.items():
            if granted and lease_id == answer.lease_id:
                continue
            # A holder pinned for a lease that missed: the coordinator releases it.
            self._await_release(lease_id)
            self._bridge.unpin(engine, lease_id)
        if not isinstance(answer, PrefixLoadGrant):
            self.stats.misses += 1
            return None
        self.stats.grants += 1
        self._requester_of[answer.lease_id] = requester
        source = self._index[answer.source_child_engine_id]
        return LoadGrant(answer.lease_id, source, answer.matched_blocks)

    def complete(self, grant: LoadGrant, loaded_blocks: int, now_ms: float) -> None:
        lease_id = str(grant.lease_key)
        requester = self._requester_of.pop(lease_id)
        # Metadata only: the modelled load moved no bytes and ran no native call.
        outcome = TransferResult(
            outcome=TransferOutcome.SUCCEEDED,
            bytes_moved=0,
            duration_s=0.0,
            error="",
            tainted_block_ids=(),
        )
        report = outcome.to_report(
            lease_id=lease_id, reporter_child_engine_id=self._ids[requester], tp_rank=0
        )
        started = time.perf_counter()
        self._run(self._links[requester].leases.complete_prefix_load(report))
        completed = time.perf_counter()
        self.stats.complete_ms.append((completed - started) * 1000.0)
        # Quiescent: the holder unpins when the coordinator says so.
        self._await_release(lease_id)
        self.stats.release_wait_ms.append((time.perf_counter() - completed) * 1000.0)

    def blocks_stored(
        self,
        engine: EngineIndex,
        blocks: Sequence[BlockId],
        parent: BlockId | None,
        now_ms: float,
    ) -> None:
        self.stored_ever.update(blocks)
        event: InventoryEvent = StoredBlocks(
            block_hashes=tuple(block_hash(b) for b in blocks),
            parent_block_hash=block_hash(parent) if parent is not None else b"",
            num_tokens=512 * len(blocks),
            tier=Tier.GPU,
        )
        self._loop.call_soon_threadsafe(self._links[engine].publish, [event])

    def blocks_removed(self, engine: EngineIndex, blocks: Sequence[BlockId], now_ms: float) -> None:
        event: InventoryEvent = RemovedBlocks(tuple(block_hash(b) for b in blocks), Tier.GPU)
        self._loop.call_soon_threadsafe(self._links[engine].publish, [event])

    # --- internals ------------------------------------------------------------
    def _await_release(self, lease_id: str) -> None:
        if not self._bridge.wait_released(lease_id, RELEASE_WAIT_S):
            self.stats.missing_releases += 1


# ---------------------------------------------------------------------------
# One replay through the real service
# ---------------------------------------------------------------------------


class LoopThread:
    """An asyncio loop in a helper thread, for the sessions; stopped on exit."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-sessions")

    def __enter__(self) -> LoopThread:
        self._thread.start()
        return self

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


@dataclass
class RealRun:
    mode: Mode
    speedup: float
    result: ModeResult
    requests: int
    wall_s: float
    lookup_ms_p50: float
    lookup_ms_p99: float
    lookups: int
    lag_p99_s: float
    lag_max_s: float
    scheduled_s: float  # wall time the schedule asked for (last event / speedup)
    server_lookup_ms_p99_le: float | None  # coordinator-side, bucket upper edge
    coordinator_cpu_s: float
    events_lost: bool
    lost_detail: str
    stats: RealRunStats
    counters: LinkCounters

    @property
    def cpu_s_per_1k_requests(self) -> float:
        return self.coordinator_cpu_s * 1000.0 / max(1, self.requests)

    @property
    def sustained(self) -> bool:
        return self.lookup_ms_p99 < LOOKUP_P99_LIMIT_MS and not self.events_lost and self.keeps_pace

    @property
    def keeps_pace(self) -> bool:
        return self.wall_s <= PACE_SLACK * self.scheduled_s + PACE_SLACK_S

    @property
    def sustained_by_coordinator(self) -> bool:
        """The same test on the coordinator's own Lookup p99 (its histogram), which
        leaves out the Python client stack and a busy machine's scheduling."""
        p99 = self.server_lookup_ms_p99_le
        return (
            p99 is not None
            and p99 < LOOKUP_P99_LIMIT_MS
            and not self.events_lost
            and self.keeps_pace
        )

    def failed_because(self) -> str:
        why = []
        if self.lookup_ms_p99 >= LOOKUP_P99_LIMIT_MS:
            why.append(f"lookup p99 {self.lookup_ms_p99:.2f} ms >= {LOOKUP_P99_LIMIT_MS} ms")
        if self.events_lost:
            why.append(f"events lost ({self.lost_detail})")
        if not self.keeps_pace:
            why.append(f"replay took {self.wall_s:.1f} s for a {self.scheduled_s:.1f} s schedule")
        return "; ".join(why)

    def step(self) -> dict[str, Any]:
        return {
            "speedup": self.speedup,
            "sustained": self.sustained,
            "sustained_by_coordinator_p99": self.sustained_by_coordinator,
            "failed_because": self.failed_because(),
            "wall_s": round(self.wall_s, 2),
            "lookup_ms_p50": round(self.lookup_ms_p50, 3),
            "lookup_ms_p99": round(self.lookup_ms_p99, 3),
            "server_lookup_ms_p99_le": self.server_lookup_ms_p99_le,
            "lag_p99_s": round(self.lag_p99_s, 4),
            "scheduled_s": round(self.scheduled_s, 2),
            "events_lost": self.events_lost,
            "coordinator_cpu_s_per_1k_requests": round(self.cpu_s_per_1k_requests, 3),
            "hit_ratio": self.result.hit_ratio,
        }


@dataclass
class _Cluster:
    """The simulated engines' client side, living on the session loop."""

    channel: grpc.aio.Channel
    lookups: LookupClient
    links: list[SimEngineLink]


async def _start_cluster(target: str, names: Sequence[str], bridge: HolderBridge) -> _Cluster:
    channel = grpc.aio.insecure_channel(target)
    links = [SimEngineLink(target, channel, i, name, bridge) for i, name in enumerate(names)]
    await asyncio.gather(*(link.start() for link in links))
    return _Cluster(channel, LookupClient(target, channel=channel), links)


async def _close_cluster(cluster: _Cluster) -> None:
    await asyncio.gather(*(link.close() for link in cluster.links), return_exceptions=True)
    await cluster.lookups.close()
    await cluster.channel.close(None)


async def _flush_links(links: Sequence[SimEngineLink]) -> None:
    await asyncio.gather(*(link.flush() for link in links))


def _inventory_mismatch(
    target: str, sim: TraceSimulation, names: Sequence[str], blocks: set[BlockId]
) -> str:
    """'' when the coordinator's view equals every engine's published cache.

    Checked block by block through Lookup (each block as a one-block chain,
    every holder asked for), over every block any engine ever published, so
    a lost store and a lost removal both show; plus the stale flags.
    """
    problems: list[str] = []
    with grpc.insecure_channel(target) as channel:
        status: pb.StatusResponse = pb_grpc.AdminServiceStub(channel).GetStatus(
            pb.StatusRequest(), timeout=RPC_TIMEOUT_S
        )
        by_id = {c.state.child_engine_id: c for c in status.child_engines}
        for name in names:
            child = by_id.get(name)
            if child is None:
                problems.append(f"{name} is not registered")
            elif child.state.stale:
                problems.append(f"{name} is stale")
        stub = pb_grpc.EngineServiceStub(channel)
        index = {name: i for i, name in enumerate(names)}
        ordered = sorted(blocks)
        wrong = 0
        for start in range(0, len(ordered), LOOKUP_QUERIES_PER_CHECK):
            chunk = ordered[start : start + LOOKUP_QUERIES_PER_CHECK]
            response: pb.LookupResponse = stub.Lookup(
                pb.LookupRequest(
                    requester_child_engine_id=names[0],
                    queries=[
                        pb.LookupQuery(
                            block_hashes=[block_hash(b)],
                            min_blocks=1,
                            include_self=True,
                            max_candidates=min(len(names), 64),
                        )
                        for b in chunk
                    ],
                ),
                timeout=RPC_TIMEOUT_S,
            )
            for b, result in zip(chunk, response.results, strict=True):
                seen = {index.get(c.child_engine_id, -1) for c in result.candidates}
                truth = {i for i, eng in enumerate(sim.engines) if b in eng.cache.published}
                if seen != truth:
                    wrong += 1
                    if wrong <= 3:
                        problems.append(
                            f"block {b}: coordinator {sorted(seen)} != engines {sorted(truth)}"
                        )
        if wrong > 3:
            problems.append(f"{wrong} blocks differ in all")
    return "; ".join(problems)


def run_real(
    mode: Mode,
    requests: Sequence[TraceRequest],
    *,
    engines: int,
    capacity_tokens: int,
    cost: CostModel,
    speedup: float,
    workdir: Path,
) -> RealRun:
    """One replay of a kvrc mode through a fresh coordinator process."""
    server = start_kvrc(workdir, PROFILES_TOML, timeout_s=60.0)
    names = [f"prefill-{i}" for i in range(engines)]
    bridge = HolderBridge()
    try:
        with LoopThread() as lt:
            cluster = lt.run(_start_cluster(server.target, names, bridge))
            links = cluster.links
            provider = KvrcProvider(links, lt.loop, bridge, cluster.lookups)
            lags: list[float] = []
            last_virtual_ms = [0.0]
            try:
                cpu_before = server.cpu_seconds()
                t0 = time.perf_counter()

                def pace(virtual_ms: float) -> None:
                    last_virtual_ms[0] = virtual_ms
                    target = t0 + virtual_ms / 1000.0 / speedup
                    ahead = target - time.perf_counter()
                    if ahead > 0:
                        time.sleep(ahead)
                    lags.append(max(0.0, -ahead))

                sim = TraceSimulation(
                    requests,
                    mode,
                    engines=engines,
                    capacity_tokens=capacity_tokens,
                    cost=cost,
                    provider=provider,
                    pace=pace,
                )
                result = sim.run()
                wall_s = time.perf_counter() - t0
                # Before the end-of-run check adds its own lookups.
                server_p99 = histogram_percentile_ms(
                    rpc_histogram(server.metrics_url, "Lookup"), 99
                )
                lt.run(_flush_links(links))
                # Events still in flight settle within moments; a lost one never does.
                check = (server.target, sim, names, provider.stored_ever)
                mismatch = _inventory_mismatch(*check)
                deadline = time.monotonic() + 5
                while mismatch and time.monotonic() < deadline:
                    time.sleep(0.2)
                    mismatch = _inventory_mismatch(*check)
                cpu_s = server.cpu_seconds() - cpu_before
            finally:
                lt.run(_close_cluster(cluster))
    finally:
        server.stop()
    c = bridge.counters
    lost = [
        p
        for p in (
            mismatch,
            f"{c.resyncs} resync requests" if c.resyncs else "",
            f"send errors: {c.send_errors[:3]}" if c.send_errors else "",
            f"{provider.stats.missing_releases} releases never came"
            if provider.stats.missing_releases
            else "",
        )
        if p
    ]
    lookups = provider.stats.lookup_ms
    return RealRun(
        mode=mode,
        speedup=speedup,
        result=result,
        requests=len(requests),
        wall_s=wall_s,
        lookup_ms_p50=percentile(lookups, 50) if lookups else 0.0,
        lookup_ms_p99=percentile(lookups, 99) if lookups else 0.0,
        lookups=len(lookups),
        lag_p99_s=percentile(lags, 99) if lags else 0.0,
        lag_max_s=max(lags, default=0.0),
        scheduled_s=last_virtual_ms[0] / 1000.0 / speedup,
        server_lookup_ms_p99_le=server_p99,
        coordinator_cpu_s=cpu_s,
        events_lost=bool(lost),
        lost_detail="; ".join(lost),
        stats=provider.stats,
        counters=c,
    )


def search_max_speedup(
    first: RealRun,
    run_at: Callable[[float], RealRun],
    budget_s: float,
    log: Callable[[str], None],
) -> tuple[float, float, list[dict[str, Any]]]:
    """The highest speedups whose steps sustained: by the client-side lookup p99
    (the issue's measure) and by the coordinator's own p99.

    Doubles from the first step until the replay cannot keep pace, an event is
    lost, or both p99 tests fail twice in a row (p99 on a shared machine is
    noisy, so one unlucky step does not end the search); when nothing sustained,
    halves from the first step instead. A step is started only if its schedule
    fits in what is left of `budget_s`.
    """
    started = time.monotonic()
    steps = [first.step()]
    best = {True: 0.0, False: 0.0}  # by client p99 (True) / by coordinator p99 (False)

    def note(run: RealRun) -> bool:
        if run.sustained:
            best[True] = max(best[True], run.speedup)
        if run.sustained_by_coordinator:
            best[False] = max(best[False], run.speedup)
        return run.sustained or run.sustained_by_coordinator

    def fits(speed: float) -> bool:
        schedule_s = first.scheduled_s * first.speedup / speed
        return time.monotonic() - started + schedule_s <= budget_s

    def step_at(speed: float) -> RealRun:
        run = run_at(speed)
        steps.append(run.step())
        log(f"  speedup {speed:g}: {'sustained' if run.sustained else run.failed_because()}")
        return run

    misses = 0 if note(first) else 1
    speed = first.speedup * 2
    hard_stop = not first.keeps_pace or first.events_lost
    while not hard_stop and fits(speed) and speed <= 1e6:
        run = step_at(speed)
        misses = 0 if note(run) else misses + 1
        if not run.keeps_pace or run.events_lost or misses >= 2:
            break
        speed *= 2
    speed = first.speedup / 2
    while best[True] == 0.0 and speed >= 1 and fits(speed):
        note(step_at(speed))
        speed /= 2
    return best[True], best[False], steps


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def trace_label(path: Path) -> str:
    """The trace as a report names it: relative to the repository when it lies inside."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def cost_comparison(
    cost_mode: ModeResult, local: ModeResult, static: dict[int, ModeResult]
) -> dict[str, Any]:
    """kvrc_cost against local_kv and against the best static threshold.

    The best static threshold is chosen per figure: the `min_blocks` with the lowest
    mean TTFT for the mean ratio, the lowest p99 for the p99 ratio (ties: the
    smaller threshold), so each ratio faces the strongest static setting."""
    best_mean = min(static, key=lambda k: (static[k].ttft_mean_s, k))
    best_p99 = min(static, key=lambda k: (static[k].ttft_p99_s, k))
    return {
        "kvrc_cost_ttft_vs_static": _ratio(cost_mode.ttft_mean_s, static[best_mean].ttft_mean_s),
        "kvrc_cost_ttft_p99_vs_static": _ratio(cost_mode.ttft_p99_s, static[best_p99].ttft_p99_s),
        "kvrc_cost_ttft_vs_local": _ratio(cost_mode.ttft_mean_s, local.ttft_mean_s),
        "kvrc_cost_ttft_p99_vs_local": _ratio(cost_mode.ttft_p99_s, local.ttft_p99_s),
        "best_static_min_blocks": best_mean,
        "best_static_min_blocks_p99": best_p99,
        "static_thresholds": {str(k): r.summary() for k, r in static.items()},
    }


def busy_share(
    requests: Sequence[TraceRequest], result: ModeResult, cost: CostModel, engines: int
) -> float:
    """The prefill engines' busy share in a run: the tokens it prefilled (every input
    token less the reused blocks'), at the engines' rate, over their time from zero to
    the last arrival. Reused blocks are whole (a request's last, partial block is its
    own), so the sum needs no per-request pass."""
    reused_tokens = (result.blocks_local_hit + result.blocks_loaded) * cost.block_tokens
    busy_ms = (sum(r.input_tokens for r in requests) - reused_tokens) * 1000.0
    span_ms = max((r.arrival_ms for r in requests), default=0) * cost.prefill_tokens_per_s
    return busy_ms / (engines * span_ms) if span_ms else 0.0


def load_sweep(
    spec: SlowPairsSpec,
    gate_config: CostConfig,
    *,
    cold_links: bool,
    requests_limit: int = 0,
    rates: Sequence[float] = LOAD_SWEEP_RATES_PER_S,
) -> list[dict[str, Any]]:
    """The slow-pairs trace at each arrival rate: kvrc_cost, local_kv, upper_bound and
    the static thresholds, in the model (deterministic), with the same ratios as the
    headline run."""
    out: list[dict[str, Any]] = []
    for rate in rates:
        at_rate = dataclasses.replace(spec, rate_per_s=rate)
        requests = generate_slow_pairs(at_rate)
        if requests_limit:
            requests = requests[:requests_limit]
        cost = at_rate.cost()
        declared = cost.pairs.declared() if cost.pairs is not None and not cold_links else ()
        run = functools.partial(
            simulate,
            requests,
            engines=at_rate.engines,
            capacity_tokens=at_rate.capacity_tokens,
            cost=cost,
        )
        local = run(Mode.LOCAL_KV)
        cost_mode = run(Mode.KVRC_COST, gate_config=gate_config, declared_links=declared)
        static = {k: run(Mode.KVRC_KV, min_blocks=k) for k in STATIC_MIN_BLOCKS}
        comparison = cost_comparison(cost_mode, local, static)
        del comparison["static_thresholds"]
        out.append(
            {
                "rate_per_s": rate,
                "busy_share_local_kv": busy_share(requests, local, cost, at_rate.engines),
                "local_kv": local.summary(),
                "kvrc_cost": cost_mode.summary(),
                "upper_bound_ttft_mean_s": run(Mode.UPPER_BOUND).ttft_mean_s,
                **comparison,
            }
        )
    return out


def build_report(
    trace_path: Path,
    requests: Sequence[TraceRequest],
    results: dict[Mode, ModeResult],
    reference: dict[Mode, ModeResult],
    real: dict[Mode, RealRun],
    max_sustained: float | None,
    steps: list[dict[str, Any]],
    config: dict[str, Any],
    static: dict[int, ModeResult],
    trace_name: str | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {
        "trace": trace_label(trace_path) if trace_name is None else f"generated: {trace_name}",
        "trace_name": trace_path.stem if trace_name is None else trace_name,
        "requests": len(requests),
        "blocks": sum(len(r.block_ids) for r in requests),
        "best_possible_hit_ratio": best_possible_hit_ratio(requests),
        "config": config,
    }
    for mode in Mode:
        report[mode.value] = results[mode].summary()
    report["kvrc_kv_ttft_vs_local_kv"] = _ratio(
        results[Mode.KVRC_KV].ttft_mean_s, results[Mode.LOCAL_KV].ttft_mean_s
    )
    report.update(cost_comparison(results[Mode.KVRC_COST], results[Mode.LOCAL_KV], static))
    report["kvrc_cost_source"] = "reference provider, gate = coordinator.core.cost_model.CostModel"
    report["kvrc_rr_vs_local_rr"] = _ratio(
        results[Mode.KVRC_RR].hit_ratio, results[Mode.LOCAL_RR].hit_ratio
    )
    report["kvrc_kv_vs_upper_bound"] = _ratio(
        results[Mode.KVRC_KV].hit_ratio, results[Mode.UPPER_BOUND].hit_ratio
    )
    if real:
        lookups = [ms for run in real.values() for ms in run.stats.lookup_ms]
        cpu = sum(run.coordinator_cpu_s for run in real.values())
        served = sum(run.requests for run in real.values())
        report["lookup_ms_p50"] = percentile(lookups, 50) if lookups else None
        report["lookup_ms_p99"] = percentile(lookups, 99) if lookups else None
        report["coordinator_cpu_s_per_1k_requests"] = cpu * 1000.0 / served
        # The coordinator's own Lookup time (histogram bucket edge), without the
        # client stack and the thread hand-off that lookup_ms_* include.
        server = [r.server_lookup_ms_p99_le for r in real.values()]
        report["coordinator_lookup_ms_p99_le"] = (
            max(v for v in server if v is not None) if any(v is not None for v in server) else None
        )
        report["kvrc_modes_source"] = "service"
    else:
        report["lookup_ms_p50"] = report["lookup_ms_p99"] = None
        report["coordinator_cpu_s_per_1k_requests"] = None
        report["coordinator_lookup_ms_p99_le"] = None
        report["kvrc_modes_source"] = "reference provider (no service run)"
    report["max_sustained_speedup"] = max_sustained
    report["speedup_steps"] = steps
    report["reference_provider"] = {
        mode.value: {
            **res.summary(),
            "service_matches": (
                real[mode].result.summary() == res.summary() if mode in real else None
            ),
        }
        for mode, res in reference.items()
    }
    report["service_runs"] = {
        mode.value: {
            **run.step(),
            "lookups": run.lookups,
            "load_grants": run.stats.grants,
            "load_misses": run.stats.misses,
            "reuse_unavailable": run.stats.reuse_unavailable,
            "late_pins": run.counters.late_pins,
            "aborts": run.counters.aborts,
            "quarantines": run.counters.quarantines,
            "lost_detail": run.lost_detail,
        }
        for mode, run in real.items()
    }
    return report


_LINE_STYLES = {
    Mode.LOCAL_RR: "-",
    Mode.KVRC_RR: "-",
    Mode.LOCAL_KV: "-",
    Mode.KVRC_KV: "--",  # dashed and dotted: visible where they overlap upper_bound
    Mode.KVRC_COST: "-.",
    Mode.UPPER_BOUND: ":",
}


def write_plot(
    path: Path, trace_name: str, requests: Sequence[TraceRequest], results: dict[Mode, ModeResult]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r.arrival_ms / 60_000 for r in requests]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for mode in Mode:
        ax.plot(
            x,
            results[mode].cumulative_hit_ratio,
            label=f"{mode.value} ({results[mode].hit_ratio:.3f})",
            linestyle=_LINE_STYLES[mode],
            linewidth=2.0 if mode is Mode.UPPER_BOUND else 1.4,
        )
    ax.set_xlabel("trace time (minutes)")
    ax.set_ylabel("cumulative prefix hit ratio")
    ax.set_ylim(0, 1)
    ax.set_title(f"{trace_name}: cumulative hit ratio by mode")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_trace", description="Trace replay through kvrc."
    )
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument(
        "--slow-pairs",
        action="store_true",
        help="replay the seeded slow-pairs trace and cluster instead (benchmarks/slow_pairs.py;"
        " its engines, caches and links)",
    )
    p.add_argument("--engines", type=int, default=DEFAULT_ENGINES)
    p.add_argument("--capacity-tokens", type=int, default=DEFAULT_CAPACITY_TOKENS)
    p.add_argument(
        "--speedup",
        type=float,
        default=DEFAULT_SPEEDUP,
        help="replay this many times faster than the trace clock (%(default)s)",
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--prefill-tokens-per-s", type=float, default=CostModel().prefill_tokens_per_s)
    p.add_argument("--load-ms-per-block", type=float, default=CostModel().load_ms_per_block)
    p.add_argument("--requests", type=int, default=0, help="replay only the first N (0 = all)")
    cold = CostConfig()
    p.add_argument(
        "--cost-default-bandwidth-gbps",
        type=float,
        default=cold.default_bandwidth_bytes_per_s / 1e9,
        help="kvrc_cost: a cold link's bandwidth, as kvrc serve's flag (%(default)s)",
    )
    p.add_argument(
        "--cost-default-latency-ms",
        type=float,
        default=cold.default_latency_ms,
        help="kvrc_cost: a cold link's latency, as kvrc serve's flag (%(default)s)",
    )
    p.add_argument(
        "--cost-reverse-prior",
        choices=("on", "off"),
        default="on" if cold.reverse_prior else "off",
        help="kvrc_cost: an undeclared link stands on its measured reverse (no probe while "
        "the reverse says the load pays), as kvrc serve's flag (%(default)s)",
    )
    p.add_argument(
        "--cost-measurement-ttl-s",
        type=float,
        default=cold.measurement_ttl_s,
        help="kvrc_cost: a link's fit is re-learnt this long (simulated) after its last "
        "sample, as kvrc serve's flag; 0: never (%(default)s)",
    )
    p.add_argument(
        "--cold-links",
        action="store_true",
        help="kvrc_cost: do not declare the cluster's links to the gate (every link starts "
        "from the cold defaults and is learnt from its first loads)",
    )
    p.add_argument(
        "--search-budget-s",
        type=float,
        default=240.0,
        help="wall time for the max-speedup search; 0 skips it (%(default)s)",
    )
    p.add_argument(
        "--no-service",
        action="store_true",
        help="kvrc modes through the in-process reference provider only (no coordinator)",
    )
    args = p.parse_args(argv)
    if args.engines < 1 or args.capacity_tokens < 512 or args.speedup <= 0 or args.requests < 0:
        p.error("--engines >= 1, --capacity-tokens >= 512, --speedup > 0, --requests >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    load_before = os.getloadavg()[0]

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {msg}", flush=True)

    trace_name: str | None = None
    if args.slow_pairs:
        # The trace and its cluster come together: the spec fixes engines, caches, links.
        spec = SLOW_PAIRS
        requests = generate_slow_pairs(spec)
        trace_name = spec.name
        args.engines, args.capacity_tokens = spec.engines, spec.capacity_tokens
        cost = spec.cost()
    else:
        try:
            requests = load_trace(args.trace)
        except (OSError, ValueError) as e:
            print(f"bench_trace: {e}", file=sys.stderr)
            return 2
        cost = CostModel(args.prefill_tokens_per_s, args.load_ms_per_block)
    if args.requests:
        requests = requests[: args.requests]
    name = trace_name if trace_name is not None else args.trace.stem
    log(f"{len(requests)} requests from {trace_name or args.trace}")

    gate_config = CostConfig(
        default_bandwidth_bytes_per_s=args.cost_default_bandwidth_gbps * 1e9,
        default_latency_ms=args.cost_default_latency_ms,
        reverse_prior=args.cost_reverse_prior == "on",
        measurement_ttl_s=args.cost_measurement_ttl_s,
    )

    # kvrc_cost: the links are declared as an operator would ([[link]] in the profiles
    # file), unless --cold-links; a trace without per-pair links has nothing to declare.
    declared = cost.pairs.declared() if cost.pairs is not None and not args.cold_links else ()

    def sim(mode: Mode, min_blocks: int = 1) -> ModeResult:
        return simulate(
            requests,
            mode,
            engines=args.engines,
            capacity_tokens=args.capacity_tokens,
            cost=cost,
            min_blocks=min_blocks,
            gate_config=gate_config if mode is Mode.KVRC_COST else None,
            declared_links=declared if mode is Mode.KVRC_COST else (),
        )

    results: dict[Mode, ModeResult] = {}
    reference: dict[Mode, ModeResult] = {}
    for mode in Mode:
        res = sim(mode)
        # kvrc_cost runs on the reference provider only (its gate is in-process).
        (reference if mode in (Mode.KVRC_RR, Mode.KVRC_KV) else results)[mode] = res
        log(
            f"{mode.value:12s} (simulated) hit ratio {res.hit_ratio:.4f}, "
            f"TTFT {res.ttft_mean_s:.3f} s, p99 {res.ttft_p99_s:.3f} s"
        )
    static = {k: sim(Mode.KVRC_KV, k) for k in STATIC_MIN_BLOCKS}
    for k, res in static.items():
        log(f"kvrc_kv min_blocks {k:3d}: TTFT {res.ttft_mean_s:.3f} s, p99 {res.ttft_p99_s:.3f} s")

    real: dict[Mode, RealRun] = {}
    steps: list[dict[str, Any]] = []
    max_sustained: float | None = None
    max_by_coordinator: float | None = None
    if args.no_service:
        results.update(reference)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
            workdir = Path(tmp)

            def run_at(mode: Mode, speedup: float) -> RealRun:
                return run_real(
                    mode,
                    requests,
                    engines=args.engines,
                    capacity_tokens=args.capacity_tokens,
                    cost=cost,
                    speedup=speedup,
                    workdir=workdir,
                )

            for mode in (Mode.KVRC_RR, Mode.KVRC_KV):
                run = run_at(mode, args.speedup)
                real[mode] = run
                results[mode] = run.result
                same = run.result.summary() == reference[mode].summary()
                log(
                    f"{mode.value:12s} (service, {args.speedup:g}x) hit ratio "
                    f"{run.result.hit_ratio:.4f}, TTFT {run.result.ttft_mean_s:.3f} s, lookup p99 "
                    f"{run.lookup_ms_p99:.2f} ms, {run.wall_s:.1f} s"
                    f"{'' if same else ', differs from the reference provider'}"
                    f"{'' if run.sustained else ' [' + run.failed_because() + ']'}"
                )
            if args.search_budget_s > 0:
                log("searching the max sustained speedup (kvrc_kv)")
                max_sustained, max_by_coordinator, steps = search_max_speedup(
                    real[Mode.KVRC_KV],
                    lambda s: run_at(Mode.KVRC_KV, s),
                    args.search_budget_s,
                    log,
                )
            else:
                steps = [real[Mode.KVRC_KV].step()]

    config = {
        "engines": args.engines,
        "capacity_tokens": args.capacity_tokens,
        "capacity_blocks": args.capacity_tokens // cost.block_tokens,
        "speedup": args.speedup,
        "prefill_tokens_per_s": cost.prefill_tokens_per_s,
        "load_ms_per_block": cost.load_ms_per_block,
        "block_tokens": cost.block_tokens,
        "kv_bytes_per_token": cost.kv_bytes_per_token,
        # The simulator's model: loads overlap the queue ahead; routers charge a copy.
        "loads": "asynchronous, one at a time per inbound link",
        "replication_charge": REPLICATION_CHARGE,
        "pairs": dataclasses.asdict(cost.pairs) if cost.pairs is not None else None,
        "slow_pairs": dataclasses.asdict(SLOW_PAIRS) if args.slow_pairs else None,
        # kvrc_cost's gate (cold links' defaults); every engine declares its prefill rate.
        "cost_gate": dataclasses.asdict(gate_config),
        "cost_gate_declared_links": [
            {
                "name": k.name,
                "bandwidth_bytes_per_s": k.bandwidth_bytes_per_s,
                "latency_ms": k.latency_ms,
            }
            for k in declared
        ],
        "static_min_blocks": list(STATIC_MIN_BLOCKS),
        "lookup_p99_limit_ms": LOOKUP_P99_LIMIT_MS,
        "pace_slack": [PACE_SLACK, PACE_SLACK_S],
        "command": "python -m benchmarks.bench_trace "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    report = build_report(
        args.trace,
        requests,
        results,
        reference,
        real,
        max_sustained,
        steps,
        config,
        static,
        trace_name,
    )
    report["max_sustained_speedup_by_coordinator_p99"] = max_by_coordinator
    if args.slow_pairs:
        log(
            "load sweep: the slow-pairs trace at "
            f"{', '.join(f'{r:g}' for r in LOAD_SWEEP_RATES_PER_S)} req/s"
        )
        report["load_sweep"] = load_sweep(
            SLOW_PAIRS, gate_config, cold_links=args.cold_links, requests_limit=args.requests
        )
        for row in report["load_sweep"]:
            log(
                f"  {row['rate_per_s']:g} req/s (engines {row['busy_share_local_kv']:.0%} busy "
                f"under local_kv): kvrc_cost_ttft_vs_static {row['kvrc_cost_ttft_vs_static']:.3f}, "
                f"p99 {row['kvrc_cost_ttft_p99_vs_static']:.3f}"
            )
    report["wall_s"] = round(time.monotonic() - started, 1)
    # Others' work on a shared machine moves the wall-clock numbers: say how busy it was.
    report["load_average_1m"] = {"start": load_before, "end": os.getloadavg()[0]}
    json_path = write_result(f"trace-{name}", report, results_dir=args.out)
    png_path = args.out / f"trace-{name}.png"
    try:
        write_plot(png_path, name, requests, results)
    except ImportError:
        print(
            f"bench_trace: wrote {json_path} but no plot: matplotlib is not installed "
            "(.venv/bin/pip install matplotlib)",
            file=sys.stderr,
        )
        return 1
    log(f"wrote {json_path} and {png_path}")
    for key in (
        "kvrc_cost_ttft_vs_static",
        "kvrc_cost_ttft_p99_vs_static",
        "kvrc_cost_ttft_vs_local",
        "kvrc_cost_ttft_p99_vs_local",
        "best_static_min_blocks",
        "kvrc_kv_ttft_vs_local_kv",
        "kvrc_rr_vs_local_rr",
        "kvrc_kv_vs_upper_bound",
        "lookup_ms_p50",
        "lookup_ms_p99",
        "coordinator_cpu_s_per_1k_requests",
        "coordinator_lookup_ms_p99_le",
        "max_sustained_speedup",
        "max_sustained_speedup_by_coordinator_p99",
    ):
        log(f"  {key} = {report[key]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
