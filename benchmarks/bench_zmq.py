"""ZMQ ingest throughput: vLLM-shaped KV-event batches through a real ZMQ socket.

    python -m benchmarks.bench_zmq [--batches 2000] [--repeats 3] [--out PATH]

A publisher process pre-encodes vLLM 0.33.0-shaped `KVEventBatch` payloads
(msgpack maps with every field vLLM sends, unsigned 64-bit hashes) and pushes
them as `[topic, seq, payload]` through a ZMQ PUB socket on loopback as fast as
it can. This process ingests them with `ZmqEventStream` (decode, ordering,
metrics) on uvloop, into:

* `inventory`: the inventory core (`coordinator.core.inventory.Inventory`), the path
  the running service uses: `block_events_per_s` (the headline);
* `count`: a sink that only counts, i.e. the edge alone: `edge_block_events_per_s`.

Shape of a batch (one scheduler step in steady state): 8 `BlockStored` events of
16 new blocks each (block size 16, token ids included, each a chain continuing
the previous), and once the cache holds `capacity` blocks, one `BlockRemoved`
per evicted block (vLLM emits one event per evicted block): 256 block events.
`decode_block_events_per_s` is the pure decoder alone on the same payloads.
`grpc_block_events_per_s` is the gRPC event path into a running `kvrc serve`: the
same block events (decoded once, before timing) sent as kvrc `EventBatch`es on
one engine's session stream, timed from the first send until a Lookup sees the
last batch's blocks (session messages are applied in order), median of repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import msgpack
import uvloop
import zmq
import zmq.asyncio

from benchmarks.common import RESULTS_DIR, write_json
from coordinator.core.events import BlockRemoved, BlockStored, EventBatch
from coordinator.core.inventory import Inventory
from coordinator.core.vllm_events import decode_payload
from coordinator.edges.zmq_ingest import ZmqEventStream, ZmqStreamConfig
from coordinator.runtime.metrics import Metrics

DEFAULT_OUT = RESULTS_DIR / "zmq.json"
ENGINE = "bench-engine"
BLOCK_SIZE = 16
STORES_PER_BATCH = 8
BLOCKS_PER_STORE = 16
CAPACITY_BLOCKS = 50_000


def _token_ids(seed: int, n: int) -> list[int]:
    # Token ids spread over a 150k vocabulary, like real prompts (3- and 5-byte ints).
    return [(seed + i * 7919) % 150_000 for i in range(n)]


def encode_batches(n_batches: int, seed: int = 7) -> tuple[list[bytes], int]:
    """vLLM-shaped payloads and the block events they carry."""
    rng = random.Random(seed)
    resident: list[int] = []  # FIFO of cached blocks, oldest first
    evict_from = 0
    payloads: list[bytes] = []
    total = 0
    for _ in range(n_batches):
        events: list[dict[str, Any]] = []
        for _ in range(STORES_PER_BATCH):
            hashes = [rng.getrandbits(64) for _ in range(BLOCKS_PER_STORE)]
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": hashes,
                    "parent_block_hash": resident[-1] if resident else None,
                    "token_ids": _token_ids(rng.getrandbits(17), BLOCK_SIZE * len(hashes)),
                    "block_size": BLOCK_SIZE,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                    "extra_keys": [None] * len(hashes),
                    "group_idx": 0,
                }
            )
            resident.extend(hashes)
            total += len(hashes)
        while len(resident) - evict_from > CAPACITY_BLOCKS:
            events.append(
                {
                    "type": "BlockRemoved",
                    "block_hashes": [resident[evict_from]],
                    "medium": "GPU",
                    "group_idx": 0,
                }
            )
            evict_from += 1
            total += 1
        payloads.append(msgpack.packb([time.time(), events, 0]))
    return payloads, total


def publisher_main(n_batches: int, conn: multiprocessing.connection.Connection) -> None:
    payloads, _ = encode_batches(n_batches)
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # the benchmark measures ingest, not drops
    pub.setsockopt(zmq.LINGER, 5000)
    pub.bind("tcp://127.0.0.1:0")
    conn.send(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    pub.recv()  # the subscription: nothing sent before it is lost
    conn.recv()  # go
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload], copy=False)
    conn.recv()  # done: the subscriber has everything
    pub.close()
    ctx.term()


class CountingSink:
    def __init__(self, n_batches: int) -> None:
        self.n_batches = n_batches
        self.batches = 0
        self.first_s = 0.0
        self.last_s = 0.0
        self.done = asyncio.Event()

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        self._tick()

    def _tick(self) -> None:
        if self.batches == 0:
            self.first_s = time.perf_counter()
        self.batches += 1
        if self.batches == self.n_batches:
            self.last_s = time.perf_counter()
            self.done.set()

    def drop_engine_inventory(self, child_engine_id: str) -> None:
        raise AssertionError("no restart in the benchmark")

    def mark_stale(self, child_engine_id: str, reason: str) -> None:
        raise AssertionError(f"stale: {reason}")

    def mark_degraded(self, child_engine_id: str, reason: str) -> None:
        raise AssertionError(f"degraded: {reason}")

    def mark_live(self, child_engine_id: str) -> None:
        pass


class InventorySink(CountingSink):
    """Feeds the inventory core, as the service's sink will."""

    def __init__(self, n_batches: int) -> None:
        super().__init__(n_batches)
        self.inventory = Inventory(max_entries_total=10 * CAPACITY_BLOCKS)
        self.inventory.add_engine(ENGINE, "bench-compat")
        self.inventory.set_ready(ENGINE, True)

    def apply(self, child_engine_id: str, batch: EventBatch) -> None:
        self.inventory.apply(child_engine_id, batch.events, now_ms=0)
        self._tick()


async def measure_zmq(n_batches: int, total: int, sink_kind: str) -> float:
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("spawn").Process(
        target=publisher_main, args=(n_batches, child), daemon=True
    )
    proc.start()
    endpoint = await asyncio.to_thread(parent.recv)
    sink = InventorySink(n_batches) if sink_kind == "inventory" else CountingSink(n_batches)
    ctx = zmq.asyncio.Context()
    config = ZmqStreamConfig(
        engine_id=ENGINE, endpoint=endpoint, block_size=BLOCK_SIZE, rcv_hwm=n_batches + 16
    )
    stream = ZmqEventStream(config, sink, Metrics(), context=ctx)
    await stream.start()
    try:
        parent.send("go")
        await asyncio.wait_for(sink.done.wait(), 600)
        parent.send("done")
    finally:
        await stream.close()
        ctx.destroy(linger=0)
        await asyncio.to_thread(proc.join, 30)
    status = stream.status()
    assert status.applied_batches == n_batches and status.malformed_frames == 0
    # Timed from the first batch applied to the last: what the first one (stores
    # only, the cache is not full yet) carries is not in that time.
    first_batch = STORES_PER_BATCH * BLOCKS_PER_STORE
    return (total - first_batch) / (sink.last_s - sink.first_s)


def measure_decode(n_batches: int) -> float:
    payloads, total = encode_batches(n_batches)
    start = time.perf_counter()
    for seq, payload in enumerate(payloads):
        decode_payload(b"", seq, payload)
    return total / (time.perf_counter() - start)


def _hash_bytes(block_hash: int | bytes) -> bytes:
    return block_hash if isinstance(block_hash, bytes) else block_hash.to_bytes(8, "big")


def grpc_batches(n_batches: int) -> list[Any]:
    """The benchmark's block events as kvrc EventMessages (incarnation set at send time)."""
    from kvrc.v1 import kvrc_pb2 as pb

    payloads, _ = encode_batches(n_batches)
    batches = []
    for seq, payload in enumerate(payloads):
        events = []
        for event in decode_payload(b"", seq, payload).events:
            if isinstance(event, BlockStored):
                parent = event.parent_block_hash
                events.append(
                    pb.InventoryEvent(
                        stored=pb.BlockStored(
                            block_hashes=[_hash_bytes(h) for h in event.block_hashes],
                            parent_block_hash=b"" if parent is None else _hash_bytes(parent),
                            num_tokens=event.num_tokens,
                            tier=pb.TIER_GPU,
                        )
                    )
                )
            elif isinstance(event, BlockRemoved):
                events.append(
                    pb.InventoryEvent(
                        removed=pb.BlockRemoved(
                            block_hashes=[_hash_bytes(h) for h in event.block_hashes],
                            tier=pb.TIER_GPU,
                        )
                    )
                )
            else:
                raise AssertionError(f"unexpected event {event!r}")
        batches.append(pb.EventBatch(sequence=seq, events=events))
    return batches


async def measure_grpc(target: str, batches: list[Any], total: int, run_no: int) -> float:
    """Block events per second through one session stream of a live kvrc."""
    from clients.session import EngineProfile, EngineSession, RankPartRegistration
    from kvrc.v1 import kvrc_pb2 as pb

    engine_id = f"bench-grpc-{run_no}"  # a fresh engine (empty inventory) per repeat
    profile = EngineProfile(model="bench-model", block_size=BLOCK_SIZE, reuse_opt_in=True)
    session = EngineSession(target, RankPartRegistration(engine_id, profile), reconnect=False)
    ack = await session.start()
    last_store = next(e.stored for e in reversed(batches[-1].events) if e.HasField("stored"))
    probe = pb.LookupRequest(
        requester_child_engine_id=engine_id,
        queries=[pb.LookupQuery(block_hashes=list(last_store.block_hashes), include_self=True)],
    )
    for batch in batches:
        batch.incarnation = ack.incarnation
    lookups = grpc.aio.insecure_channel(target)
    lookup = lookups.unary_unary(
        "/kvrc.v1.EngineService/Lookup",
        pb.LookupRequest.SerializeToString,
        pb.LookupResponse.FromString,
    )
    try:
        started = time.perf_counter()
        for batch in batches:
            await session.send_event_batch(batch)
        for _ in range(600_000):  # applied in order: the last batch visible means all are
            if (await lookup(probe)).results[0].candidates:
                break
            await asyncio.sleep(0.001)
        else:
            raise RuntimeError("kvrc never showed the last batch's blocks")
        elapsed = time.perf_counter() - started
    finally:
        await lookups.close(None)
        await session.close()
    return total / elapsed


def _grpc_runs(batches: list[Any], total: int, repeats: int) -> list[float]:
    import tempfile

    from benchmarks.bench_index import start_bench_kvrc

    with tempfile.TemporaryDirectory(prefix="bench-zmq-") as tmp:
        kvrc = start_bench_kvrc(Path(tmp))
        try:
            return [
                uvloop.run(measure_grpc(kvrc.target, batches, total, i)) for i in range(repeats)
            ]
        finally:
            kvrc.stop()


def run(n_batches: int, repeats: int) -> dict[str, Any]:
    _, total = encode_batches(n_batches)
    load_before = os.getloadavg()[0]
    # Interleaved repeats, median reported: the host is shared and noisy.
    runs: dict[str, list[float]] = {"decode": [], "count": [], "inventory": []}
    for _ in range(repeats):
        runs["decode"].append(measure_decode(n_batches))
        runs["count"].append(uvloop.run(measure_zmq(n_batches, total, "count")))
        runs["inventory"].append(uvloop.run(measure_zmq(n_batches, total, "inventory")))
    runs["grpc"] = _grpc_runs(grpc_batches(n_batches), total, repeats)
    median = {kind: statistics.median(values) for kind, values in runs.items()}
    return {
        "block_events_per_s": round(median["inventory"]),
        "edge_block_events_per_s": round(median["count"]),
        "decode_block_events_per_s": round(median["decode"]),
        "runs_block_events_per_s": {k: [round(v) for v in vs] for k, vs in runs.items()},
        "repeats": repeats,
        "grpc_block_events_per_s": round(median["grpc"]),
        "target_block_events_per_s": 300_000,
        "batches": n_batches,
        "block_events": total,
        "shape": {
            "stores_per_batch": STORES_PER_BATCH,
            "blocks_per_store": BLOCKS_PER_STORE,
            "block_size": BLOCK_SIZE,
            "capacity_blocks": CAPACITY_BLOCKS,
            "hashes": "uint64",
            "encoding": "vLLM 0.33.0 maps",
        },
        "host": {
            "cpus": os.cpu_count(),
            # Other work on the host skews every figure: the 1-minute load around the run.
            "loadavg_1m_before": round(load_before, 2),
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "zmq": zmq.zmq_version(),
            "pyzmq": zmq.pyzmq_version(),
            "msgpack": ".".join(map(str, msgpack.version)),
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    report = run(args.batches, args.repeats)
    write_json(args.out, report)
    print(json.dumps(report, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
