"""Domain types of inventory events, shared by both ingest edges.

The gRPC session stream and the vLLM ZMQ subscriber both decode into these
values and feed the same inventory core. Pure values: no protobuf, no msgpack.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrc.vocabulary import BlockHash, RankKey, Tier

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "InventoryEvent",
    "RankKey",
    "Tier",
]


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[BlockHash, ...]  # a chain segment, parent first
    parent_block_hash: BlockHash | None
    num_tokens: int
    tier: Tier = Tier.GPU
    group_idx: int = 0
    expiry_ms: int = 0  # on the monotonic clock (the gRPC edge converts unix ms); 0 = none


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    tier: Tier = Tier.GPU
    group_idx: int = 0


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


InventoryEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    """One ordered batch of one publishing stream."""

    incarnation: int
    sequence: int
    events: tuple[InventoryEvent, ...]
    dump_begin: bool = False
    dump_end: bool = False
