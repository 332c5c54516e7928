"""Deterministic "prefill compute": KV values as a pure function of the prompt.

A rank part's K and V for position `p` of layer `layer` depend only on
(the token ids up to and including `p`, `p`, `layer`, the global KV head), so a
block loaded from any engine can be compared bit for bit with the same block
computed here. Values are small multiples of 1/16 (exact in bf16, fp16, fp32),
never NaN, so comparing raw bytes is meaningful.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from clients.kv_cache import KvCacheLayout, PagedKvCache

_MASK = (1 << 31) - 1
_PRIME = 1_000_003  # rolling prefix hash multiplier


def prefix_digests(token_ids: Sequence[int]) -> torch.Tensor:
    """digest[p]: a 31-bit rolling hash of token_ids[0..p] (int64, one per position)."""
    digests = torch.empty(len(token_ids), dtype=torch.int64)
    state = 0
    for position, token in enumerate(token_ids):
        state = (state * _PRIME + token + 1) & _MASK
        digests[position] = state
    return digests


def _mix(x: torch.Tensor) -> torch.Tensor:
    # Products of two values below 2**31 stay below 2**62: no int64 overflow.
    x = (x * 48271 + 11) & _MASK
    x = x ^ (x >> 13)
    x = (x * 69621) & _MASK
    return x ^ (x >> 17)


def kv_values(
    layout: KvCacheLayout,
    token_ids: Sequence[int],
    positions: range,
    *,
    tp_rank: int,
    digests: torch.Tensor | None = None,
) -> torch.Tensor:
    """KV of `positions` for every layer of this rank part's heads.

    Shape `[num_layers, len(positions), 2, num_kv_heads, head_size]` (NHD order),
    dtype of the layout. `digests` may pass `prefix_digests(token_ids)` to reuse it.
    """
    if positions.step != 1 or positions.start < 0 or positions.stop > len(token_ids):
        raise ValueError(f"positions {positions} outside 0..{len(token_ids)}")
    if digests is None:
        digests = prefix_digests(token_ids[: positions.stop])
    heads = layout.num_kv_heads
    pos = torch.arange(positions.start, positions.stop, dtype=torch.int64)
    seed = _mix(digests[positions.start : positions.stop] ^ (pos * 7919))
    layer = torch.arange(layout.num_layers, dtype=torch.int64) * 104_729
    kv = torch.arange(2, dtype=torch.int64) * 15_485_863
    head = (torch.arange(heads, dtype=torch.int64) + tp_rank * heads) * 32_452_843
    dim = torch.arange(layout.head_size, dtype=torch.int64) * 2_654_435
    x = (
        layer.view(-1, 1, 1, 1, 1)
        + seed.view(1, -1, 1, 1, 1)
        + kv.view(1, 1, -1, 1, 1)
        + head.view(1, 1, 1, -1, 1)
        + dim.view(1, 1, 1, 1, -1)
    ) & _MASK
    values = ((_mix(x) & 255) - 128).to(torch.float32) / 16
    return values.to(layout.torch_dtype)


def expected_blocks(
    layout: KvCacheLayout,
    token_ids: Sequence[int],
    block_indexes: Sequence[int],
    *,
    tp_rank: int,
) -> torch.Tensor:
    """The bytes blocks `block_indexes` (of the request) must hold, one row per block.

    Shape `[len(block_indexes), num_layers, block_bytes]` as uint8. The unfilled
    tail of a partial last block is zero, as `write_positions` leaves it.
    """
    bs = layout.block_size
    digests = prefix_digests(token_ids)
    out = torch.zeros(
        (len(block_indexes), layout.num_layers, *layout.block_shape), dtype=layout.torch_dtype
    )
    for row, index in enumerate(block_indexes):
        start = index * bs
        stop = min(start + bs, len(token_ids))
        if start >= stop:
            raise ValueError(f"block {index} holds no token of a {len(token_ids)}-token request")
        values = kv_values(layout, token_ids, range(start, stop), tp_rank=tp_rank, digests=digests)
        for layer in range(layout.num_layers):
            _place(layout, out[row, layer], values[layer], 0)
    return out.reshape(len(block_indexes), layout.num_layers, -1).view(torch.uint8)


def write_positions(
    cache: PagedKvCache,
    token_ids: Sequence[int],
    block_ids: Sequence[int],
    first_position: int,
    *,
    tp_rank: int,
) -> None:
    """Compute positions `first_position..len(token_ids)-1` into the request's blocks.

    `block_ids[i]` is the cache block holding request positions `i*bs..i*bs+bs-1`.
    A block written from its first slot gets its unfilled tail zeroed, so a
    partial block has one well-defined content.
    """
    layout = cache.layout
    bs = layout.block_size
    total = len(token_ids)
    if len(block_ids) != -(-total // bs):
        raise ValueError(f"{len(block_ids)} blocks for {total} tokens of block size {bs}")
    if not 0 <= first_position <= total:
        raise ValueError(f"first_position {first_position} outside 0..{total}")
    if first_position == total:
        return
    digests = prefix_digests(token_ids)
    values = kv_values(
        layout, token_ids, range(first_position, total), tp_rank=tp_rank, digests=digests
    )
    position = first_position
    while position < total:
        index, offset = divmod(position, bs)
        stop = min((index + 1) * bs, total)
        chunk = values[:, position - first_position : stop - first_position]
        for layer in range(layout.num_layers):
            block = cache.block(layer, block_ids[index])  # a view into the cache
            if offset == 0:
                block.zero_()
            _place(layout, block, chunk[layer], offset)
        position = stop


def _place(layout: KvCacheLayout, block: torch.Tensor, values: torch.Tensor, offset: int) -> None:
    """Write `values` [n, 2, heads, dim] into one layer's `block` from slot `offset`."""
    n = values.shape[0]
    if layout.kv_layout == "NHD":  # block: [2, block_size, heads, dim]
        block[:, offset : offset + n] = values.permute(1, 0, 2, 3)
    else:  # HND block: [2, heads, block_size, dim]
        block[:, :, offset : offset + n] = values.permute(1, 2, 0, 3)
