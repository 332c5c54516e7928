"""Where visibility time goes between two replicas (issue 23): stamps along one batch's path.

    python -m benchmarks.profile_visibility [--rate 100000] [--seconds 3]

The same two processes as `bench_cluster`'s visibility phase (the runtime's
`ReplicatedInventory` and `RedisStore` over a real `redis-server`), with
`time.time_ns()` stamps, both processes on this host's clock, at:

    A apply -> XADD sent -> XADD answered | B XREAD returned -> unpack -> B apply end

plus the other Redis calls B makes per read and every GC pass on either side
(`gc.callbacks`). Prints, for all batches and for those over 10 ms, the mean of
each segment, and how many of the slow ones overlap a GC pass. A diagnostic, not
a figure of record: it writes no result file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import multiprocessing
import multiprocessing.connection
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import redis

import coordinator.runtime.redis_store as redis_store
from benchmarks.bench_cluster import BLOCKS_PER_BATCH, CAPS, _free_port
from benchmarks.common import percentile
from coordinator.core.events import BlockStored
from coordinator.runtime.clock import SystemClock
from coordinator.runtime.config import StoreConfig
from coordinator.runtime.gc_policy import freeze_startup_heap
from coordinator.runtime.metrics import Metrics
from coordinator.runtime.redis_store import RedisStore
from coordinator.runtime.replication import OP_APPLY, Op, ReplicatedInventory, unpack_ops

SLOW_MS = 10.0


def _gc_log() -> list[tuple[int, int, int]]:
    """(generation, start ns, end ns) of every GC pass in this process from now on."""
    passes: list[tuple[int, int, int]] = []
    started = [0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.time_ns()
        else:
            passes.append((info["generation"], started[0], time.time_ns()))

    gc.callbacks.append(callback)
    return passes


def _timed(calls: list[tuple[str, int, int]], name: str, fn: Callable[..., Any]) -> Any:
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time_ns()
        try:
            return await fn(*args, **kwargs)
        finally:
            calls.append((name, t0, time.time_ns()))

    return wrapper


class _StampedInventory(ReplicatedInventory):
    def __init__(self, origin: str, expect: int) -> None:
        super().__init__(origin, **CAPS)
        self.expect = expect
        self.seen = 0
        self.all_seen = asyncio.Event()
        self.read_returned = 0
        self.batches: dict[int, tuple[int, int, int]] = {}  # sent -> (read, apply0, apply1)

    def apply_remote(self, origin: str, ops: Sequence[Op], now_ms: int) -> int:
        t0 = time.time_ns()
        applied = super().apply_remote(origin, ops, now_ms)
        t1 = time.time_ns()
        for op in ops:
            if op[0] == OP_APPLY:
                for event in op[3]:
                    sent = struct.unpack_from(">Q", event[1][0])[0]
                    self.batches[sent] = (self.read_returned, t0, t1)
                    self.seen += len(event[1])
        if self.seen >= self.expect:
            self.all_seen.set()
        return applied


async def _consumer(
    port: int, expect: int, freeze: bool, conn: multiprocessing.connection.Connection
) -> None:
    gcs = _gc_log()
    cprofile = os.environ.get("KVRC_PROFILE_CPROFILE")  # a path: B's cProfile stats there
    profiler = cProfile.Profile() if cprofile else None
    inv = _StampedInventory("bench-b", expect)
    store = RedisStore(
        StoreConfig(kind="redis", host="127.0.0.1", port=port), inv, SystemClock(), Metrics()
    )
    calls: list[tuple[str, int, int]] = []
    if hasattr(store, "_read_after"):  # XREAD and, pipelined behind it, the trim check
        real_read = store._read_after

        async def read_after(last_id: str) -> tuple[Any, str | None]:
            t0 = time.time_ns()
            answer = await real_read(last_id)
            inv.read_returned = t1 = time.time_ns()
            calls.append(("xread+xrange", t0, t1))
            return answer

        store._read_after = read_after  # type: ignore[method-assign]
    else:  # the store before that pipeline: XREAD, then its own XRANGE
        reader = store._reader_conn
        real_xread = reader.xread

        async def xread(*args: Any, **kwargs: Any) -> Any:
            t0 = time.time_ns()
            reply = await real_xread(*args, **kwargs)
            inv.read_returned = t1 = time.time_ns()
            calls.append(("xread", t0, t1))
            return reply

        reader.xread = xread  # type: ignore[method-assign]
        reader.xrange = _timed(calls, "xrange", reader.xrange)  # type: ignore[method-assign]
    unpacks: list[tuple[int, int]] = []
    real_unpack = unpack_ops

    def unpack(data: bytes) -> list[Op]:
        t0 = time.time_ns()
        ops = real_unpack(data)
        unpacks.append((t0, time.time_ns()))
        return ops

    redis_store.unpack_ops = unpack  # type: ignore[attr-defined]
    if freeze:
        freeze_startup_heap()
    await store.start()
    stalls: list[tuple[int, int, int]] = []  # (start ns, end ns, CPU ns of this process)
    watch = asyncio.get_running_loop().create_task(_watch_loop(stalls))
    conn.send("ready")
    if profiler is not None:
        profiler.enable()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(inv.all_seen.wait(), 120)
    if profiler is not None and cprofile:
        profiler.disable()
        profiler.dump_stats(cprofile)
    tracked = len(gc.get_objects())
    watch.cancel()
    await store.close()
    conn.send(
        {
            "batches": inv.batches,
            "calls": calls,
            "gc": gcs,
            "unpacks": unpacks,
            "tracked": tracked,
            "stalls": stalls,
        }
    )


async def _watch_loop(stalls: list[tuple[int, int, int]]) -> None:
    """Loop stalls over 3 ms: busy (CPU time ran on) or not scheduled (it did not)."""
    while True:
        t0, cpu0 = time.time_ns(), time.process_time_ns()
        await asyncio.sleep(0.001)
        t1 = time.time_ns()
        if t1 - t0 > 4_000_000:  # 1 ms asked, 3 ms late
            stalls.append((t0, t1, time.process_time_ns() - cpu0))


def _consumer_main(
    port: int, expect: int, freeze: bool, conn: multiprocessing.connection.Connection
) -> None:
    import uvloop

    uvloop.run(_consumer(port, expect, freeze, conn))


async def _producer(port: int, rate: int, seconds: float, freeze: bool) -> dict[str, Any]:
    gcs = _gc_log()
    inv = ReplicatedInventory("bench-a", **CAPS)
    clock = SystemClock()
    store = RedisStore(
        StoreConfig(kind="redis", host="127.0.0.1", port=port), inv, clock, Metrics()
    )
    xadds: dict[int, tuple[int, int]] = {}  # sent -> (xadd start, xadd answered)
    real_xadd: Any = store._writer_conn.xadd

    async def xadd(key: str, fields: dict[str, Any], **kwargs: Any) -> Any:
        t0 = time.time_ns()
        reply = await real_xadd(key, fields, **kwargs)
        t1 = time.time_ns()
        for op in msgpack.unpackb(fields["d"], raw=False):
            if op[0] == OP_APPLY:
                for event in op[3]:
                    xadds[struct.unpack_from(">Q", event[1][0])[0]] = (t0, t1)
        return reply

    store._writer_conn.xadd = xadd  # type: ignore[method-assign,assignment]
    if freeze:
        freeze_startup_heap()
    await store.start()
    inv.add_engine("engine-a", "compat")
    inv.set_ready("engine-a", True)
    batches = int(rate * seconds / BLOCKS_PER_BATCH)
    interval = BLOCKS_PER_BATCH / rate
    started = time.perf_counter()
    for i in range(batches):
        delay = started + i * interval - time.perf_counter()
        await asyncio.sleep(max(delay, 0))
        sent = time.time_ns()
        hashes = tuple(struct.pack(">QII", sent, i, j) for j in range(BLOCKS_PER_BATCH))
        inv.apply(
            "engine-a",
            [BlockStored(hashes, None, 16 * BLOCKS_PER_BATCH)],
            now_ms=clock.monotonic_ms(),
        )
    elapsed = time.perf_counter() - started
    await store.close(flush_timeout_s=60)
    return {"xadds": xadds, "gc": gcs, "achieved": batches * BLOCKS_PER_BATCH / elapsed}


def _overlaps(passes: Sequence[tuple[int, int, int]], lo: int, hi: int) -> bool:
    return any(start < hi and end > lo for _, start, end in passes)


def _gc_summary(name: str, passes: Sequence[tuple[int, int, int]]) -> None:
    for gen in (0, 1, 2):
        ms = [(e - s) / 1e6 for g, s, e in passes if g == gen]
        if ms:
            print(
                f"  GC {name} gen{gen}: {len(ms)} passes, mean {statistics.mean(ms):.2f} ms, "
                f"max {max(ms):.2f} ms, total {sum(ms):.0f} ms"
            )


def profile(rate: int, seconds: float, freeze: bool) -> None:
    server = shutil.which("redis-server")
    if server is None:
        raise SystemExit("redis-server is not installed: make sysdeps")
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="kvrc-profile-redis-") as tmp:
        proc = subprocess.Popen(
            [server, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp, "--save", ""],
            stdout=subprocess.DEVNULL,
        )
        try:
            for _ in range(200):
                with contextlib.suppress(redis.ConnectionError):
                    redis.Redis(port=port).ping()
                    break
                time.sleep(0.05)
            expect = int(rate * seconds / BLOCKS_PER_BATCH) * BLOCKS_PER_BATCH
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            consumer = ctx.Process(target=_consumer_main, args=(port, expect, freeze, child))
            consumer.start()
            assert parent.recv() == "ready"
            import uvloop

            produced = uvloop.run(_producer(port, rate, seconds, freeze))
            got = parent.recv()
            consumer.join(30)
        finally:
            proc.terminate()
            proc.wait(10)
    _report(rate, produced, got)


def _report(rate: int, produced: dict[str, Any], got: dict[str, Any]) -> None:
    rows = []  # (total, a_queue, xadd, to_read, b_wait, apply)
    slow_gc_a = slow_gc_b = 0
    slow_spans: list[tuple[int, int, int]] = []  # (sent, XADD answered, B apply end)
    for sent, (read, apply0, apply1) in got["batches"].items():
        x0, x1 = produced["xadds"].get(sent, (sent, sent))
        row = [(apply1 - sent), (x0 - sent), (x1 - x0), (read - x1), (apply0 - read)]
        row.append(apply1 - apply0)
        rows.append([v / 1e6 for v in row])
        if row[0] / 1e6 > SLOW_MS:
            slow_spans.append((sent, x1, apply1))
            slow_gc_a += _overlaps(produced["gc"], sent, x0)
            slow_gc_b += _overlaps(got["gc"], x1, apply1)
    total = [r[0] for r in rows]
    print(
        f"rate {rate}/s (achieved {produced['achieved']:.0f}): {len(rows)} batches, "
        f"p50 {percentile(total, 50):.2f} ms p99 {percentile(total, 99):.2f} ms "
        f"max {max(total):.2f} ms"
    )
    names = (
        "total",
        "A apply->XADD",
        "XADD rtt",
        "XADD answered->B read",
        "B read->apply",
        "B apply",
    )
    slow = [r for r in rows if r[0] > SLOW_MS]
    for label, subset in (("all", rows), (f"> {SLOW_MS:g} ms", slow)):
        if not subset:
            continue
        means = [statistics.mean(r[i] for r in subset) for i in range(len(names))]
        print(
            f"  {label} ({len(subset)}): "
            + ", ".join(f"{n} {m:.2f}" for n, m in zip(names, means, strict=True))
        )
    print(f"  slow batches overlapping a GC pass: A {slow_gc_a}, B {slow_gc_b} of {len(slow)}")
    _gc_summary("A", produced["gc"])
    _gc_summary("B", got["gc"])
    print(f"  B objects tracked by the GC at the end: {got['tracked']}")
    stalls = got["stalls"]
    if stalls:
        wall = sum(e - s for s, e, _ in stalls) / 1e6
        cpu = sum(c for _, _, c in stalls) / 1e6
        in_slow = sum(any(s < b[2] and e > b[0] for s, e, _ in stalls) for b in slow_spans)
        print(
            f"  B loop stalls > 3 ms: {len(stalls)}, {wall:.0f} ms in all, of which "
            f"{cpu:.0f} ms on B's CPU; slow batches overlapping one: {in_slow} of {len(slow)}"
        )
    by_call: dict[str, list[float]] = {}
    for name, t0, t1 in got["calls"]:
        by_call.setdefault(name, []).append((t1 - t0) / 1e6)
    for name, ms in by_call.items():
        p50, p99 = percentile(ms, 50), percentile(ms, 99)
        print(f"  B {name}: {len(ms)} calls, p50 {p50:.3f} ms p99 {p99:.3f} ms")
    unpack_ms = [(e - s) / 1e6 for s, e in got["unpacks"]]
    if unpack_ms:
        print(f"  B unpack: {len(unpack_ms)}, p99 {percentile(unpack_ms, 99):.3f} ms")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rate", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the startup heap to the GC (as before freeze_startup_heap)",
    )
    args = parser.parse_args(argv)
    profile(args.rate, args.seconds, not args.no_freeze)
    return 0


if __name__ == "__main__":
    sys.exit(main())
