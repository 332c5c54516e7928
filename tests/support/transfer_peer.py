"""A peer rank part for data-plane tests: a real process with a real Mooncake engine.

Run: `python tests/transfer_peer.py '<layout json>' <pattern seed> [port_min port_max]`.
It allocates a `PagedKvCache`, fills every block with `block_pattern`, registers
it, prints its endpoint description as one JSON line on stdout and waits. It
exits on "exit" or at end of stdin (so a crashed test leaves no process); tests
may also SIGKILL or SIGSTOP it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from clients.kv_cache import KvCacheLayout, PagedKvCache
from clients.mooncake_engine import MooncakeConfig, MooncakeTransferEngine


def block_pattern(layout: KvCacheLayout, seed: int, layer: int, block_id: int) -> torch.Tensor:
    """The bytes of one block: a function of (seed, layer, block) that differs per block."""
    offsets = torch.arange(layout.block_bytes, dtype=torch.int64)
    # 251 is prime: blocks < 251 apart, layers and seeds all give different bytes.
    values = (offsets * 31 + block_id * 131 + layer * 17 + seed * 101) % 251
    return values.to(torch.uint8)


def fill_pattern(cache: PagedKvCache, seed: int) -> None:
    for layer in range(cache.layout.num_layers):
        for block_id in range(cache.layout.num_blocks):
            cache.block_bytes_view(layer, block_id).copy_(
                block_pattern(cache.layout, seed, layer, block_id)
            )


def main(argv: list[str]) -> int:
    layout = KvCacheLayout.from_dict(json.loads(argv[1]))
    seed = int(argv[2])
    port_min = int(argv[3]) if len(argv) > 3 else None
    port_max = int(argv[4]) if len(argv) > 4 else None
    engine = MooncakeTransferEngine(MooncakeConfig(rpc_port_min=port_min, rpc_port_max=port_max))
    cache = PagedKvCache(layout, device="cpu")
    fill_pattern(cache, seed)
    endpoint = cache.register(engine)
    print(endpoint.to_json(), flush=True)
    for line in sys.stdin:
        if line.strip() == "exit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
