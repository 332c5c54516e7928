"""Pure decoder of vLLM's native KV-event frames (`vllm.distributed.kv_events`).

A vLLM scheduler publishes each batch as the ZMQ multipart message
`[topic, seq (8-byte big-endian unsigned), payload]`. The payload is msgpack of
`KVEventBatch`, an array `[ts, events, data_parallel_rank]` (the rank is omitted
when None). Each event is msgspec-tagged:

- vLLM >= 0.24: a map whose first key is `"type"` (`"BlockStored"`, ...);
- vLLM <= 0.23: a tagged array, the tag first and every field by position.

Field order (vLLM 0.33.0; older versions publish a prefix of it):

    BlockStored:  block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                  medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
    BlockRemoved: block_hashes, medium, group_idx, ...
    AllBlocksCleared: (none)

Block hashes are unsigned 64-bit ints (the default; converted to 8 bytes
big-endian, the kvrc wire convention) or byte strings (32-byte sha256 with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`, kept as is). Unknown fields and unknown
event types are ignored, so a newer vLLM does not break ingestion. Anything else
that does not fit raises `MalformedFrame`; the ZMQ edge counts and skips it.

No I/O, no asyncio: bytes in, `coordinator.core.events` values out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from coordinator.core.event_streams import MAX_SEQUENCE
from coordinator.core.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    Tier,
)
from kvrc.vocabulary import MAX_BLOCK_HASH_BYTES, MAX_GROUP_IDX

# What one frame may carry. A vLLM step publishes tens to a few thousand block hashes;
# these bound the work one frame costs the event loop (decode and apply, ~3 us a hash)
# to a fraction of a second whatever the publisher sends (I8-bad-input).
MAX_FRAME_EVENTS = 65_536
MAX_FRAME_BLOCKS = 65_536

# vLLM's replay end marker: seq = -1 as signed 8 bytes.
END_SEQ = b"\xff" * 8
_U64_LIMIT = 1 << 64

# vLLM's `medium` strings (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE) and common aliases.
_TIER_BY_MEDIUM: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "CPU": Tier.CPU,
    "STORAGE": Tier.DISK,
    "DISK": Tier.DISK,
}

# Positions in the tagged-array encoding (index 0 is the tag).
_STORED_HASHES, _STORED_PARENT, _STORED_TOKENS, _STORED_BLOCK_SIZE = 1, 2, 3, 4
_STORED_MEDIUM, _STORED_LORA_NAME, _STORED_GROUP = 6, 7, 9
_STORED_MIN_LEN = 6  # tag + the five fields every version publishes (up to lora_id)
_REMOVED_HASHES, _REMOVED_MEDIUM, _REMOVED_GROUP = 1, 2, 3


class MalformedFrame(ValueError):
    """A frame that is not a vLLM KV-event batch; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    """One decoded PUB frame."""

    topic: bytes
    sequence: int
    ts: float
    dp_rank: int | None  # None when the publisher omitted it (older vLLM, or rank unset)
    events: tuple[InventoryEvent, ...]
    # Each BlockStored event's index in `events`, its block_size and its lora_name ("" for
    # the base model: vLLM's None): a store of another adapter (multi-LoRA serving) or of
    # a partial block is skipped alone by the ZMQ edge, not the whole batch.
    stored_scopes: tuple[tuple[int, int, str], ...]
    stored_blocks: int
    removed_blocks: int
    cleared: int
    unknown_events: int  # event types this decoder does not know, ignored

    @property
    def block_sizes(self) -> frozenset[int]:
        return frozenset(size for _, size, _ in self.stored_scopes)

    @property
    def lora_names(self) -> frozenset[str]:
        return frozenset(name for _, _, name in self.stored_scopes)

    @property
    def block_events(self) -> int:
        """Block events carried: one per stored or removed block hash, one per clear."""
        return self.stored_blocks + self.removed_blocks + self.cleared


def decode_sequence(seq_bytes: bytes) -> int:
    if len(seq_bytes) != 8:
        raise MalformedFrame(f"sequence frame must be 8 bytes, got {len(seq_bytes)}")
    seq = int.from_bytes(seq_bytes, "big")
    if seq > MAX_SEQUENCE:
        # vLLM counts from 0 (and marks a replay's end with all ones, which is no batch):
        # one near 2**64 would leave every later batch a duplicate.
        raise MalformedFrame(f"sequence {seq} is past 2**63 - 1: a publisher counts from 0")
    return seq


def decode_frame(frames: Sequence[bytes]) -> DecodedBatch:
    """Decode one PUB message `[topic, seq, payload]`."""
    if len(frames) != 3:
        raise MalformedFrame(f"expected 3 frames [topic, seq, payload], got {len(frames)}")
    topic, seq_bytes, payload = frames
    return decode_payload(bytes(topic), decode_sequence(bytes(seq_bytes)), bytes(payload))


def decode_payload(topic: bytes, sequence: int, payload: bytes) -> DecodedBatch:
    """Decode the msgpack `KVEventBatch` of one frame already split into parts."""
    try:
        batch = _unpack_batch(payload)
    except MalformedFrame:
        raise
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise MalformedFrame(f"payload is not msgpack: {exc}") from None
    ts, raw_events, dp_rank = _split_batch(batch)
    if len(raw_events) > MAX_FRAME_EVENTS:
        raise MalformedFrame(f"{len(raw_events)} events in one frame; at most {MAX_FRAME_EVENTS}")

    events: list[InventoryEvent] = []
    scopes: list[tuple[int, int, str]] = []
    stored = cleared = unknown = blocks = 0
    # vLLM emits one BlockRemoved per evicted block. A run of them with the same
    # medium and group becomes one event (removals commute): far fewer objects
    # here and one loop instead of many in the inventory core.
    run: list[object] = []
    run_key: tuple[object, object] | None = None
    run_start = 0
    for index, raw in enumerate(raw_events):
        try:
            if type(raw) is dict:
                tag = raw.get("type")
                if tag == "BlockRemoved":
                    if "block_hashes" not in raw:
                        raise MalformedFrame("BlockRemoved lacks field 'block_hashes'")
                    hashes = raw["block_hashes"]
                    key = (raw.get("medium"), raw.get("group_idx"))
            elif type(raw) is tuple and raw and type(raw[0]) is str:
                tag = raw[0]
                if tag == "BlockRemoved":
                    n = len(raw)
                    if n < 2:
                        raise MalformedFrame("BlockRemoved array has no block_hashes")
                    hashes = raw[_REMOVED_HASHES]
                    key = (
                        raw[_REMOVED_MEDIUM] if n > _REMOVED_MEDIUM else None,
                        raw[_REMOVED_GROUP] if n > _REMOVED_GROUP else None,
                    )
            else:
                raise MalformedFrame(
                    f"event is neither a map nor a tagged array: {type(raw).__name__}"
                )
            if tag == "BlockRemoved":
                if type(hashes) is not tuple:
                    raise MalformedFrame(
                        f"block_hashes must be an array, got {type(hashes).__name__}"
                    )
                blocks += len(hashes)
                if blocks > MAX_FRAME_BLOCKS:
                    raise _too_many_blocks()
                if key != run_key:
                    if run_key is not None:
                        events.append(_removed_run(run, run_key, run_start))
                    run, run_key, run_start = [], key, index
                run.extend(hashes)
                continue
            if run_key is not None:
                events.append(_removed_run(run, run_key, run_start))
                run, run_key = [], None
            if tag == "BlockStored":
                if type(raw) is dict:
                    ev, block_size, lora_name = _stored_from_map(raw)
                else:
                    ev, block_size, lora_name = _stored_from_array(raw)
                stored += len(ev.block_hashes)
                blocks += len(ev.block_hashes)
                if blocks > MAX_FRAME_BLOCKS:
                    raise _too_many_blocks()
                scopes.append((len(events), block_size, lora_name))
                events.append(ev)
            elif tag == "AllBlocksCleared":
                cleared += 1
                events.append(_CLEARED)
            elif type(tag) is str:
                unknown += 1
            else:
                raise MalformedFrame("event map has no string 'type'")
        except MalformedFrame as exc:
            raise MalformedFrame(f"event {index}: {exc}") from None
    if run_key is not None:
        events.append(_removed_run(run, run_key, run_start))
    removed = sum(len(ev.block_hashes) for ev in events if type(ev) is BlockRemoved)
    return DecodedBatch(
        topic=topic,
        sequence=sequence,
        ts=ts,
        dp_rank=dp_rank,
        events=tuple(events),
        stored_scopes=tuple(scopes),
        stored_blocks=stored,
        removed_blocks=removed,
        cleared=cleared,
        unknown_events=unknown,
    )


def tier_for_medium(medium: object) -> Tier:
    """vLLM's `medium` string → Tier; None (older vLLM) means GPU."""
    if medium is None:
        return Tier.GPU
    if type(medium) is not str:
        raise MalformedFrame(f"medium must be a string or nil, got {type(medium).__name__}")
    # The exact strings vLLM sends first, before any normalising.
    tier = _TIER_BY_MEDIUM.get(medium)
    return tier if tier is not None else _TIER_BY_MEDIUM.get(medium.upper(), Tier.EXTERNAL)


# --- internals -------------------------------------------------------------------

_CLEARED = AllBlocksCleared()


# Fields of one event map, at most (vLLM's BlockStored has about a dozen).
_MAX_MAP_LEN = 256


def _unpack_batch(payload: bytes) -> Any:
    """`msgpack.unpackb` of a `KVEventBatch` array, with its event count checked before
    any event is decoded: a frame of millions of tiny events cost the event loop a
    decode of all of them (about 0.6 s for 4 MiB) before it was refused (I8-bad-input).
    A map-encoded batch (not what vLLM sends) is decoded whole, within the same limits."""
    options: dict[str, Any] = {"raw": False, "use_list": False, "max_map_len": _MAX_MAP_LEN}
    unpacker = msgpack.Unpacker(max_buffer_size=max(len(payload), 1), **options)
    unpacker.feed(payload)
    try:
        fields = unpacker.read_array_header()
    except ValueError:  # not an array: a map-encoded batch
        return msgpack.unpackb(payload, **options)
    if fields < 2:
        return tuple(unpacker.unpack() for _ in range(fields))
    ts = unpacker.unpack()
    try:
        count = unpacker.read_array_header()
    except ValueError:
        raise MalformedFrame("batch events must be an array") from None
    if count > MAX_FRAME_EVENTS:
        raise MalformedFrame(f"{count} events in one frame; at most {MAX_FRAME_EVENTS}")
    events = tuple(unpacker.unpack() for _ in range(count))
    rest = tuple(unpacker.unpack() for _ in range(fields - 2))
    try:
        unpacker.unpack()
    except msgpack.OutOfData:
        return (ts, events, *rest)
    raise MalformedFrame("payload has data after the batch")


def _split_batch(batch: Any) -> tuple[float, tuple[Any, ...], int | None]:
    if type(batch) is tuple:
        if len(batch) < 2:
            raise MalformedFrame(f"batch array needs [ts, events, dp_rank?], got {len(batch)}")
        ts, events = batch[0], batch[1]
        dp_rank = batch[2] if len(batch) > 2 else None
    elif type(batch) is dict:  # a map-encoded batch (not what vLLM sends, accepted)
        ts, events = batch.get("ts"), batch.get("events")
        dp_rank = batch.get("data_parallel_rank")
    else:
        raise MalformedFrame(f"batch must be an array, got {type(batch).__name__}")
    if type(ts) is not float and type(ts) is not int:
        raise MalformedFrame(f"batch ts must be a number, got {type(ts).__name__}")
    if type(events) is not tuple:
        raise MalformedFrame(f"batch events must be an array, got {type(events).__name__}")
    if dp_rank is not None and (type(dp_rank) is not int or dp_rank < 0):
        raise MalformedFrame(f"data_parallel_rank must be a non-negative int, got {dp_rank!r:.40}")
    return float(ts), events, dp_rank


def _hashes(raw: object) -> tuple[BlockHash, ...]:
    if type(raw) is not tuple:
        raise MalformedFrame(f"block_hashes must be an array, got {type(raw).__name__}")
    try:
        # The common case: every hash an unsigned 64-bit int (bools are not hashes).
        fast = [h.to_bytes(8, "big") for h in raw if type(h) is int]
        if len(fast) == len(raw):
            return tuple(fast)
    except OverflowError:
        pass
    return tuple([_hash(h) for h in raw])


def _hash(raw: object) -> BlockHash:
    if type(raw) is int:
        if not 0 <= raw < _U64_LIMIT:
            raise MalformedFrame(f"int block hash out of the unsigned 64-bit range: {raw}")
        return raw.to_bytes(8, "big")
    if type(raw) is bytes:
        if not 0 < len(raw) <= MAX_BLOCK_HASH_BYTES:
            raise MalformedFrame(
                f"byte block hash must be 1..{MAX_BLOCK_HASH_BYTES} bytes, got {len(raw)}"
            )
        return raw
    raise MalformedFrame(f"block hash must be an int or bytes, got {type(raw).__name__}")


def _optional_hash(raw: object) -> BlockHash | None:
    return None if raw is None else _hash(raw)


def _group(raw: object) -> int:
    if raw is None:
        return 0
    if type(raw) is not int or not 0 <= raw <= MAX_GROUP_IDX:
        raise MalformedFrame(f"group_idx must be an int in 0..{MAX_GROUP_IDX}, got {raw!r:.40}")
    return raw


def _too_many_blocks() -> MalformedFrame:
    return MalformedFrame(f"more than {MAX_FRAME_BLOCKS} block hashes in one frame")


def _lora_name(raw: object) -> str:
    if raw is None:
        return ""
    if type(raw) is not str:
        raise MalformedFrame(f"lora_name must be a string or nil, got {type(raw).__name__}")
    return raw


def _stored(
    hashes: object,
    parent: object,
    token_ids: object,
    block_size: object,
    medium: object,
    lora_name: object,
    group_idx: object,
) -> tuple[BlockStored, int, str]:
    if type(token_ids) is not tuple:
        raise MalformedFrame(f"token_ids must be an array, got {type(token_ids).__name__}")
    if type(block_size) is not int or block_size <= 0:
        raise MalformedFrame(f"block_size must be a positive int, got {block_size!r:.40}")
    event = BlockStored(
        block_hashes=_hashes(hashes),
        parent_block_hash=_optional_hash(parent),
        num_tokens=len(token_ids),
        tier=tier_for_medium(medium),
        group_idx=_group(group_idx),
    )
    return event, block_size, _lora_name(lora_name)


def _stored_from_map(raw: dict[Any, Any]) -> tuple[BlockStored, int, str]:
    try:
        hashes, parent = raw["block_hashes"], raw["parent_block_hash"]
        token_ids, block_size = raw["token_ids"], raw["block_size"]
    except KeyError as exc:
        raise MalformedFrame(f"BlockStored lacks field {exc.args[0]!r:.40}") from None
    return _stored(
        hashes,
        parent,
        token_ids,
        block_size,
        raw.get("medium"),
        raw.get("lora_name"),
        raw.get("group_idx"),
    )


def _stored_from_array(raw: tuple[Any, ...]) -> tuple[BlockStored, int, str]:
    n = len(raw)
    if n < _STORED_MIN_LEN:
        raise MalformedFrame(f"BlockStored array has {n - 1} fields, needs at least 5")
    return _stored(
        raw[_STORED_HASHES],
        raw[_STORED_PARENT],
        raw[_STORED_TOKENS],
        raw[_STORED_BLOCK_SIZE],
        raw[_STORED_MEDIUM] if n > _STORED_MEDIUM else None,
        raw[_STORED_LORA_NAME] if n > _STORED_LORA_NAME else None,
        raw[_STORED_GROUP] if n > _STORED_GROUP else None,
    )


def _removed_run(hashes: list[object], key: tuple[object, object], first: int) -> BlockRemoved:
    """One BlockRemoved for a run of map-encoded ones sharing (medium, group_idx)."""
    medium, group_idx = key
    try:
        return BlockRemoved(
            block_hashes=_hashes(tuple(hashes)),
            tier=tier_for_medium(medium),
            group_idx=_group(group_idx),
        )
    except MalformedFrame as exc:
        raise MalformedFrame(f"BlockRemoved from event {first} on: {exc}") from None
