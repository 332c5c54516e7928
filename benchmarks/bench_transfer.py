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
* `kvrc`: grant -> pull -> report through a live kvrc. Not measured yet: it
  needs the service's lease path; `kvrc_gbps` and `kvrc_vs_raw` stay null
  until `measure_kvrc` is filled in.

Throughput is bytes / median seconds per batch, in GB/s (1e9 bytes). Every
batch is checked: a block whose first bytes do not name its source block fails
the run. Writes the JSON report (see `write_report`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from clients.kv_cache import KvCacheLayout, KvEndpointDescription, PagedKvCache
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine
from clients.transfer import TransferOutcome, TransferPlan, pull

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "transfer.json"
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


def serve_peer() -> int:
    """Allocate, tag and register the source cache; print its description; wait."""
    engine = MooncakeTransferEngine(MooncakeConfig())
    cache = PagedKvCache(SOURCE_LAYOUT, device="cpu")
    for block_id in range(SOURCE_LAYOUT.num_blocks):
        _tag(cache, block_id, block_id)
    print(cache.register(engine).to_json(), flush=True)
    for line in sys.stdin:  # end of stdin (our parent died) also ends the peer
        if line.strip() == "exit":
            break
    return 0


def _tag(cache: PagedKvCache, block_id: int, value: int) -> None:
    cache.block_bytes_view(0, block_id)[:8].copy_(
        torch.tensor(list(value.to_bytes(8, "little")), dtype=torch.uint8)
    )


def _tag_of(cache: PagedKvCache, block_id: int) -> int:
    return int.from_bytes(bytes(cache.block_bytes_view(0, block_id)[:8].tolist()), "little")


class PeerProcess:
    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.bench_transfer", "--serve-peer"],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # Mooncake logs every connection at INFO
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError(f"benchmark peer exited with {self.process.returncode}")
        self.endpoint = KvEndpointDescription.from_json(line)

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


def measure_raw(
    engine: MooncakeTransferEngine,
    local: PagedKvCache,
    remote: KvEndpointDescription,
    batch: Batch,
) -> float:
    """Seconds for one raw batch read: one entry per block, no plan, no executor."""
    block_len = remote.layout.block_bytes
    local_base = local.describe().regions[0].base_addr
    remote_base = remote.regions[0].base_addr
    local_addresses = [local_base + i * block_len for i in range(len(batch.remote_ids))]
    remote_addresses = [remote_base + r * block_len for r in batch.remote_ids]
    lengths = [block_len] * len(batch.remote_ids)
    started = time.perf_counter()
    return_code = engine.read_batch(remote.session_name, local_addresses, remote_addresses, lengths)
    elapsed = time.perf_counter() - started
    if return_code != 0:
        raise RuntimeError(f"raw batch read returned {return_code}")
    return elapsed


def measure_pull(
    engine: MooncakeTransferEngine,
    local: PagedKvCache,
    remote: KvEndpointDescription,
    batch: Batch,
    loop: asyncio.AbstractEventLoop,
    executor: concurrent.futures.Executor,
) -> float:
    """Seconds for plan + `pull` (executor thread, own deadline), as an engine runs it."""

    async def once() -> float:
        started = time.perf_counter()
        plan = TransferPlan.build(local.describe(), remote, batch.pairs)
        result = await pull(engine, plan, deadline_s=DEADLINE_S, executor=executor)
        elapsed = time.perf_counter() - started
        if result.outcome is not TransferOutcome.SUCCEEDED:
            raise RuntimeError(f"pull failed: {result.error}")
        return elapsed

    return loop.run_until_complete(once())


def measure_kvrc(batch: Batch) -> float | None:
    """Seconds for RequestPrefixLoad grant -> pull -> CompletePrefixLoad through kvrc.

    Not available yet: it needs the coordinator's lease path (issue 5, second
    half). It will register the peer and this process as rank parts of two
    engines, publish the source blocks, and time the three steps per batch.
    """
    return None


# --- the run ------------------------------------------------------------------------


def _median_gbps(total_bytes: int, seconds: Sequence[float]) -> float:
    return total_bytes / statistics.median(seconds) / 1e9


def _clear_and_check(local: PagedKvCache, batch: Batch) -> Callable[[], None]:
    for i in range(len(batch.remote_ids)):
        _tag(local, i, 2**63)

    def check() -> None:
        for i, remote_id in enumerate(batch.remote_ids):
            found = _tag_of(local, i)
            if found != remote_id:
                raise RuntimeError(f"local block {i} holds block {found}, expected {remote_id}")

    return check


def run(repeats: int, warmup: int) -> dict[str, Any]:
    engine = MooncakeTransferEngine(MooncakeConfig())
    local = PagedKvCache(LOCAL_LAYOUT, device="cpu")
    local.register(engine)
    peer = PeerProcess()
    loop = asyncio.new_event_loop()
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    rng = random.Random(20260)
    raw: dict[str, float] = {}
    pulled: dict[str, float] = {}
    kvrc: dict[str, float | None] = {}
    raw_seconds: dict[str, list[float]] = {}
    try:
        for size in BATCH_SIZES:
            batch = Batch(tuple(rng.sample(range(SOURCE_LAYOUT.num_blocks), size)))
            for _ in range(warmup):
                measure_raw(engine, local, peer.endpoint, batch)
                measure_pull(engine, local, peer.endpoint, batch, loop, executor)
            raw_runs: list[float] = []
            pull_runs: list[float] = []
            for _ in range(repeats):  # interleaved, so drift hits both paths alike
                check = _clear_and_check(local, batch)
                raw_runs.append(measure_raw(engine, local, peer.endpoint, batch))
                check()
                check = _clear_and_check(local, batch)
                pull_runs.append(measure_pull(engine, local, peer.endpoint, batch, loop, executor))
                check()
            kvrc_seconds = measure_kvrc(batch)
            key = str(size)
            raw[key] = round(_median_gbps(batch.total_bytes, raw_runs), 4)
            pulled[key] = round(_median_gbps(batch.total_bytes, pull_runs), 4)
            kvrc[key] = (
                None if kvrc_seconds is None else round(batch.total_bytes / kvrc_seconds / 1e9, 4)
            )
            raw_seconds[key] = [round(s, 6) for s in raw_runs]
            print(
                f"{size:>5} blocks x 64 KiB: raw {raw[key]:.3f} GB/s, "
                f"pull {pulled[key]:.3f} GB/s ({pulled[key] / raw[key]:.2f} of raw)",
                flush=True,
            )
    finally:
        peer.close()
        executor.shutdown(wait=True)
        loop.close()
        local.unregister()
    return {
        "benchmark": "transfer",
        "transport": "mooncake tcp, loopback, two processes, CPU memory",
        "block_bytes": BLOCK_BYTES,
        "batch_sizes": list(BATCH_SIZES),
        "layout": "scattered source blocks, one entry per block",
        "repeats": repeats,
        "raw_gbps": raw,
        "pull_gbps": pulled,
        "pull_vs_raw": {key: round(pulled[key] / raw[key], 4) for key in raw},
        "kvrc_gbps": kvrc,
        "kvrc_vs_raw": {
            key: None if value is None else round(value / raw[key], 4)
            for key, value in kvrc.items()
        },
        "raw_seconds": raw_seconds,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        },
        "finished_unix_s": int(time.time()),
    }


def write_report(report: dict[str, Any], out: Path) -> None:
    """Write the JSON report atomically (benchmarks/common.py does not exist yet)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    partial.replace(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--serve-peer", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_peer:
        return serve_peer()
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    # Quiet Mooncake's per-connection INFO logs in this process too.
    os.environ.setdefault("GLOG_minloglevel", "1")
    report = run(args.repeats, args.warmup)
    write_report(report, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
