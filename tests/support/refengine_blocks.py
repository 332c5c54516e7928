"""Talking to real reference engines, and what their caches must hold.

Tests with real reference engines (clients/refengine) drive them over their control
channels (`connect`, `call`) and check KV from outside: each engine returns sha256
digests of its cached blocks (`digests`), and these helpers recompute the expected
bytes with the engine's own default layout.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

from clients.kv_cache import KvCacheLayout
from clients.refengine.channel import Channel
from clients.refengine.compute import expected_blocks
from clients.refengine.demo import BLOCK_SIZE, EngineGroup
from clients.refengine.options import EngineOptions

DEFAULTS = EngineOptions(role="prefill", engine_id="x", tp_rank=0, tp_size=1, target="")


async def connect(groups: Mapping[str, EngineGroup]) -> dict[str, Channel]:
    """A control channel to each engine, by engine id, once every rank part is ready."""
    channels = {
        name: await Channel.connect("127.0.0.1", g.control_port, name=name)
        for name, g in groups.items()
    }
    for channel in channels.values():
        await channel.call("ready", timeout_s=120.0, wait_s=100.0)
    return channels


async def call(channel: Channel, op: str, **args: Any) -> Any:
    """One control op, with the generous timeout a loaded host needs."""
    return await channel.call(op, timeout_s=90.0, **args)


def tokens(seed: int, count: int) -> list[int]:
    """`count` seeded token ids: the same prompt every run."""
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(count)]


def layout_for(tp_size: int) -> KvCacheLayout:
    """One rank part's KV layout of a reference engine with the default options."""
    return KvCacheLayout(
        num_layers=DEFAULTS.num_layers,
        num_blocks=DEFAULTS.num_blocks,
        block_size=BLOCK_SIZE,
        num_kv_heads=DEFAULTS.num_kv_heads // tp_size,
        head_size=DEFAULTS.head_size,
        dtype=DEFAULTS.kv_dtype,
    )


def expected_digests(chain: list[int], num_blocks: int, tp_size: int) -> list[list[str]]:
    """Per rank part, the digests of the first `num_blocks` blocks of `chain`."""
    layout = layout_for(tp_size)
    out = []
    for rank in range(tp_size):
        rows = expected_blocks(layout, chain, list(range(num_blocks)), tp_rank=rank)
        out.append([hashlib.sha256(bytes(row.reshape(-1).tolist())).hexdigest() for row in rows])
    return out


async def assert_blocks_exact(engine: Channel, chain: list[int], tp_size: int = 2) -> int:
    """The engine's cached blocks of `chain` equal the test's own recomputation; how many."""
    digests = await call(engine, "digests", tokens=chain)
    num_blocks = len(digests[0])
    assert num_blocks > 0
    assert digests == expected_digests(chain, num_blocks, tp_size)
    return num_blocks
