"""Dynamo's RadixTree side by side with the inventory core (the `bench-dynamo` extra).

`ai-dynamo-runtime` ships Dynamo's Rust KV indexer as `dynamo._core.RadixTree`
(`apply_event(worker_id, json_bytes)`, `find_matches([u64, ...])`). The bench feeds it
the very events the inventory gets, one Dynamo event per kvrc event (a BlockStored of
16 hashes becomes one `stored` event of 16 blocks, its parent the previous block; a
BlockRemoved one `removed` event), with a block's u64 the first 8 bytes of its hash
(its `block_hash` and its `tokens_hash` alike). Events are serialized before timing
(the decoding of a kvrc batch is not timed either). Where the package is missing, every
function here says so and the bench skips the comparison.

Memory is measured the same way for both: a fresh child process (`python -m
benchmarks.dynamo_anchor --rss kvrc|dynamo`) builds the index from the same chains,
and the growth of its resident set (VmRSS, after a gc) is divided by the memberships.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from coordinator.core.events import BlockRemoved, BlockStored, InventoryEvent

DYNAMO_DIST = "ai-dynamo-runtime"


def dynamo_version() -> str | None:
    try:
        return metadata.version(DYNAMO_DIST)
    except metadata.PackageNotFoundError:
        return None


def radix_tree() -> Any | None:
    """A new Dynamo RadixTree, or None when `ai-dynamo-runtime` cannot be imported."""
    # Its Rust log would print a warning per block of a redundant removal.
    os.environ.setdefault("DYN_LOG", "error")
    try:
        from dynamo._core import RadixTree
    except ImportError:
        return None
    return RadixTree()


def unavailable_reason() -> str:
    return (
        f"{DYNAMO_DIST} is not installed (pip install -e '.[bench-dynamo]'): "
        "the Dynamo comparison is skipped"
    )


def u64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[:8], "little")


def encode_events(events: Sequence[InventoryEvent], event_id: int) -> list[bytes]:
    """Dynamo's JSON KvCacheEvent for each kvrc event (stored and removed only)."""
    out: list[bytes] = []
    for i, ev in enumerate(events):
        if isinstance(ev, BlockStored):
            parent = ev.parent_block_hash
            data: dict[str, Any] = {
                "stored": {
                    "parent_hash": None if parent is None else u64(parent),
                    "blocks": [
                        {"block_hash": u64(h), "tokens_hash": u64(h)} for h in ev.block_hashes
                    ],
                }
            }
        elif isinstance(ev, BlockRemoved):
            data = {"removed": {"block_hashes": [u64(h) for h in ev.block_hashes]}}
        else:
            raise ValueError(f"no Dynamo event for {type(ev).__name__}")
        out.append(json.dumps({"event_id": event_id + i, "data": data}).encode())
    return out


def scores(tree: Any, chain: Sequence[int]) -> dict[int, int]:
    """worker id -> matched blocks (Dynamo leaves out workers with none)."""
    return {worker: n for (worker, _dp), n in tree.find_matches(list(chain)).scores.items()}


# --- RSS, the same method for both -------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _rss_child(which: str, chains: int) -> dict[str, Any]:
    from benchmarks import bench_index as b

    rng = random.Random(7)
    if which == "kvrc":
        inv = b.new_inventory()
        tree = None
    else:
        tree = radix_tree()
        if tree is None:
            raise RuntimeError(unavailable_reason())
    gc.collect()
    before = _rss_bytes()
    done = 0
    for spec in b.plan_chains(rng, True):
        if which == "kvrc":
            if inv.stats().entries_total >= b.TARGET_MEMBERSHIPS:
                break
        elif done >= chains:
            break
        batch = b.stored_batch(b.chain_hashes(spec))
        if tree is None:
            inv.apply(b.engine_id(spec.engine_idx), batch, now_ms=1_000)
        else:
            for raw in encode_events(batch, done * 8):
                tree.apply_event(spec.engine_idx, raw)
        done += 1
    if tree is not None:
        tree.find_matches([0])  # every event applied before measuring
    gc.collect()
    grown = _rss_bytes() - before
    out: dict[str, Any] = {"rss_bytes": grown, "chains": done}
    if which == "kvrc":
        out["memberships"] = inv.stats().entries_total
    return out


def rss_side_by_side() -> dict[str, Any]:
    """RSS growth per membership of kvrc and of Dynamo, each in a fresh process."""

    def run(*args: str) -> dict[str, Any]:
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks.dynamo_anchor", "--rss", *args],
            check=True,
            capture_output=True,
            text=True,
        )
        result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
        return result

    kvrc = run("kvrc")
    memberships = int(kvrc["memberships"])
    out: dict[str, Any] = {
        "kvrc_rss_bytes_per_membership": round(kvrc["rss_bytes"] / memberships, 1),
        "memberships": memberships,
    }
    if dynamo_version() is not None and radix_tree() is not None:
        dyn = run("dynamo", "--chains", str(kvrc["chains"]))
        out["dynamo_rss_bytes_per_membership"] = round(dyn["rss_bytes"] / memberships, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="RSS child of the Dynamo comparison")
    parser.add_argument("--rss", choices=("kvrc", "dynamo"), required=True)
    parser.add_argument("--chains", type=int, default=0)
    args = parser.parse_args(argv)
    print(json.dumps(_rss_child(args.rss, args.chains)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
