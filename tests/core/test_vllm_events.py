"""The pure decoder of vLLM's KV-event frames, on vLLM's own bytes and on built ones."""

from __future__ import annotations

import contextlib
import json
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    Tier,
)
from coordinator.core.vllm_events import (
    MAX_FRAME_BLOCKS,
    MAX_FRAME_EVENTS,
    DecodedBatch,
    MalformedFrame,
    decode_frame,
    decode_payload,
    decode_sequence,
    tier_for_medium,
)
from kvrc.ids import child_engine_id

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm_frames"
SEQ0 = (0).to_bytes(8, "big")
CLEARED_MAP = {"type": "AllBlocksCleared"}


def frame(payload: Any, seq: int = 0, topic: bytes = b"") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), msgpack.packb(payload, use_bin_type=True)]


def stored_map(hashes: list[Any], parent: Any = None, **extra: Any) -> dict[str, Any]:
    # Field order and shape of vLLM 0.33.0's BlockStored (see the captured frames).
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(4 * len(hashes))),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * len(hashes),
        "group_idx": 0,
    }
    event.update(extra)
    return event


def apply(model: set[str], events: tuple[InventoryEvent, ...]) -> None:
    """The inventory a stream of events describes, as "group:hash-hex" strings."""
    for ev in events:
        if isinstance(ev, BlockStored):
            model.update(f"{ev.group_idx}:{h.hex()}" for h in ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            model.difference_update(f"{ev.group_idx}:{h.hex()}" for h in ev.block_hashes)
        else:
            model.clear()


# --- vLLM's own bytes -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["int", "bytes"])
def test_real_vllm_frames_describe_the_pools_exact_inventory(kind: str) -> None:
    frames = msgpack.unpackb((DATA / f"vllm-0.33.0-{kind}-hashes.msgpack").read_bytes())
    truth = [
        json.loads(line)
        for line in (DATA / f"vllm-0.33.0-{kind}-hashes.truth.jsonl").read_text().splitlines()
    ]
    truth_by_seq = {t["seq"]: set(t["cached"]) for t in truth if "seq" in t}
    assert len(frames) == len(truth_by_seq) - (1 if -1 in truth_by_seq else 0)
    model: set[str] = set()
    kinds_seen: set[type] = set()
    for seq, raw in enumerate(frames):
        batch = decode_frame(raw)
        assert batch.sequence == seq
        assert batch.dp_rank == 0
        assert batch.block_sizes <= {4}
        assert batch.lora_names <= {""}
        assert batch.unknown_events == 0
        apply(model, batch.events)
        kinds_seen.update(type(ev) for ev in batch.events)
        assert model == truth_by_seq[seq], f"after sequence {seq}"
    assert kinds_seen == {BlockStored, BlockRemoved, AllBlocksCleared}
    width = 8 if kind == "int" else 32
    stored = next(ev for raw in frames for ev in decode_frame(raw).events)
    assert isinstance(stored, BlockStored)
    assert {len(h) for h in stored.block_hashes} == {width}
    assert stored.tier is Tier.GPU
    assert stored.num_tokens == 4 * len(stored.block_hashes)


def test_real_frame_re_encoded_as_tagged_arrays_decodes_the_same() -> None:
    """vLLM <= 0.23 sent each event as [tag, fields by position]: same meaning."""
    for raw in msgpack.unpackb((DATA / "vllm-0.33.0-int-hashes.msgpack").read_bytes()):
        ts, events, dp_rank = msgpack.unpackb(raw[2])
        arrays = [list(ev.values()) for ev in events]  # "type" first, then field order
        as_arrays = decode_frame(frame([ts, arrays, dp_rank], int.from_bytes(raw[1], "big")))
        assert as_arrays == decode_frame(raw)


# --- both encodings, both hash kinds ------------------------------------------------


def test_int_hashes_become_8_bytes_big_endian_including_above_2_63() -> None:
    big = (1 << 64) - 1
    batch = decode_frame(frame([1.0, [stored_map([5, big], parent=(1 << 63) + 7)], 0]))
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (b"\x00" * 7 + b"\x05", b"\xff" * 8)
    assert ev.parent_block_hash == struct.pack(">Q", (1 << 63) + 7)
    assert batch.stored_blocks == 2 and batch.block_events == 2


def test_32_byte_hashes_are_kept_as_they_are() -> None:
    h1, h2 = bytes(range(32)), bytes(range(1, 33))
    batch = decode_frame(frame([1.0, [stored_map([h2], parent=h1)], 0]))
    (ev,) = batch.events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == (h2,) and ev.parent_block_hash == h1


def test_tagged_array_encoding_of_every_event_type() -> None:
    events = [
        # vLLM 0.2x: BlockStored up to medium, no lora_name, no group_idx.
        ["BlockStored", [1, 2], None, [0] * 32, 16, None, "CPU"],
        # The oldest shape: no medium (means GPU).
        ["BlockStored", [3], 2, [0] * 16, 16, None],
        ["BlockRemoved", [1], "CPU"],
        ["BlockRemoved", [3]],
        ["AllBlocksCleared"],
    ]
    batch = decode_frame(frame([2.5, events]))  # no dp_rank: older publisher
    assert batch.dp_rank is None and batch.ts == 2.5
    h = [n.to_bytes(8, "big") for n in range(4)]
    assert batch.events == (
        BlockStored((h[1], h[2]), None, 32, Tier.CPU, 0),
        BlockStored((h[3],), h[2], 16, Tier.GPU, 0),
        BlockRemoved((h[1],), Tier.CPU, 0),
        BlockRemoved((h[3],), Tier.GPU, 0),
        AllBlocksCleared(),
    )
    assert (batch.stored_blocks, batch.removed_blocks, batch.cleared) == (3, 2, 1)
    assert batch.block_sizes == {16}


def test_full_tagged_array_reads_lora_name_and_group_by_position() -> None:
    event = ["BlockStored", [9], None, [0] * 4, 4, 7, "GPU", "adapter-a", [None], 2, "full"]
    batch = decode_frame(frame([0.0, [event, ["BlockRemoved", [9], "GPU", 2]], 1]))
    stored, removed = batch.events
    assert isinstance(stored, BlockStored) and stored.group_idx == 2
    assert isinstance(removed, BlockRemoved) and removed.group_idx == 2
    assert batch.lora_names == {"adapter-a"} and batch.dp_rank == 1


hash_values = st.one_of(
    st.integers(min_value=0, max_value=(1 << 64) - 1), st.binary(min_size=32, max_size=32)
)


@settings(max_examples=60, deadline=None)
@given(
    hashes=st.lists(hash_values, min_size=1, max_size=8),
    parent=st.none() | hash_values,
    medium=st.sampled_from([None, "GPU", "CPU", "STORAGE", "cpu", "nvme-tier"]),
    group=st.none() | st.integers(min_value=0, max_value=7),
)
def test_map_and_array_encodings_decode_to_the_same_values(
    hashes: list[int | bytes], parent: int | bytes | None, medium: str | None, group: int | None
) -> None:
    as_map = stored_map(hashes, parent=parent, medium=medium, group_idx=group)
    as_array = ["BlockStored", *list(as_map.values())[1:]]
    removed_map = {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    removed_array = ["BlockRemoved", hashes, medium]
    a = decode_frame(frame([1.0, [as_map, removed_map], 0]))
    b = decode_frame(frame([1.0, [as_array, removed_array], 0]))
    assert a == b
    stored = a.events[0]
    assert isinstance(stored, BlockStored)
    assert stored.group_idx == (group or 0)
    assert stored.tier is tier_for_medium(medium)
    for raw, decoded in zip(hashes, stored.block_hashes, strict=True):
        assert decoded == (raw.to_bytes(8, "big") if isinstance(raw, int) else raw)


def test_runs_of_removals_become_one_event_per_medium_and_group_in_order() -> None:
    """vLLM sends one BlockRemoved per evicted block; a run shares one event."""

    def rm(h: int, medium: str = "GPU", group: int = 0) -> dict[str, Any]:
        return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": group}

    events: list[Any] = [rm(1), rm(2), rm(3, "CPU"), rm(4, "CPU", 1), stored_map([5]), rm(6)]
    events += [["BlockRemoved", [7], "GPU", 0], CLEARED_MAP, rm(8)]
    batch = decode_frame(frame([1.0, events, 0]))
    h = [n.to_bytes(8, "big") for n in range(9)]
    assert batch.events == (
        BlockRemoved((h[1], h[2]), Tier.GPU, 0),
        BlockRemoved((h[3],), Tier.CPU, 0),
        BlockRemoved((h[4],), Tier.CPU, 1),
        BlockStored((h[5],), None, 4, Tier.GPU, 0),
        BlockRemoved((h[6], h[7]), Tier.GPU, 0),
        AllBlocksCleared(),
        BlockRemoved((h[8],), Tier.GPU, 0),
    )
    assert batch.removed_blocks == 7 and batch.block_events == 9
    bad = [rm(1), rm(2), rm(-5)]
    with pytest.raises(MalformedFrame, match="BlockRemoved from event 0 on"):
        decode_frame(frame([1.0, bad, 0]))


# --- unknown fields, mapping rules ----------------------------------------------------


def test_unknown_fields_and_event_types_are_ignored() -> None:
    newer = stored_map([1], future_field={"x": [1, 2]}, locality="LOCAL", session_id="s")
    events = [
        newer,
        {"type": "BlockReusedSomehow", "anything": 1},
        ["BlockStored", [2], None, [0] * 4, 4, None, "GPU", None, None, 0, "k", 3, "L", "o", "s"],
        ["SomeFutureEvent", 1, 2],
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "GPU", "ownership": "x"},
    ]
    batch = decode_frame(frame([1.0, events, 0, "a trailing batch field"]))
    assert [type(ev) for ev in batch.events] == [BlockStored, BlockStored, BlockRemoved]
    assert batch.unknown_events == 2


def test_medium_maps_to_tier() -> None:
    assert tier_for_medium(None) is Tier.GPU
    assert tier_for_medium("GPU") is Tier.GPU
    assert tier_for_medium("CPU") is Tier.CPU
    assert tier_for_medium("cpu") is Tier.CPU
    assert tier_for_medium("STORAGE") is Tier.DISK
    assert tier_for_medium("LMCache-remote") is Tier.EXTERNAL


def test_child_engine_id_follows_vllm_dp_naming() -> None:
    assert child_engine_id("engine-a", 0, 1) == "engine-a"
    assert child_engine_id("engine-a", 0, 4) == "engine-a_dp0"
    assert child_engine_id("engine-a", 3, 4) == "engine-a_dp3"


def test_map_encoded_batch_and_topic_are_accepted() -> None:
    payload = {"ts": 3.0, "events": [stored_map([1])], "data_parallel_rank": 2}
    batch = decode_frame(frame(payload, seq=9, topic=b"kv@engine-a"))
    assert (batch.sequence, batch.topic, batch.dp_rank) == (9, b"kv@engine-a", 2)


# --- malformed ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("frames", "says"),
    [
        ([b"", SEQ0], "3 frames"),
        ([b"", b"\x00\x01", msgpack.packb([1.0, []])], "8 bytes"),
        ([b"", SEQ0, b"\xc1not msgpack"], "not msgpack"),
        (frame("a string"), "batch must be an array"),
        (frame([1.0]), "batch array"),
        (frame(["ts", []]), "ts must be a number"),
        (frame([1.0, {"a": 1}]), "events must be an array"),
        (frame([1.0, [], -1]), "data_parallel_rank"),
        (frame([1.0, [7]]), "neither a map nor a tagged array"),
        (frame([1.0, [{"block_hashes": [1]}]]), "no string 'type'"),
        (frame([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]), "lacks field"),
        (frame([1.0, [{"type": "BlockRemoved"}]]), "lacks field 'block_hashes'"),
        (frame([1.0, [["BlockStored", [1], None, [0]]]]), "at least 5"),
        (frame([1.0, [["BlockRemoved"]]]), "no block_hashes"),
        (frame([1.0, [stored_map([-1])]]), "unsigned 64-bit"),
        (frame([1.0, [stored_map([True])]]), "int or bytes"),
        (frame([1.0, [stored_map([1.5])]]), "int or bytes"),
        (frame([1.0, [stored_map([b""])]]), "1..64 bytes"),
        (frame([1.0, [stored_map([b"x" * 65])]]), "1..64 bytes"),
        (frame([1.0, [stored_map([1], block_hashes=7)]]), "block_hashes must be an array"),
        (frame([1.0, [stored_map([1], parent="p")]]), "int or bytes"),
        (frame([1.0, [stored_map([1], block_size=0)]]), "block_size"),
        (frame([1.0, [stored_map([1], token_ids=3)]]), "token_ids"),
        (frame([1.0, [stored_map([1], medium=3)]]), "medium"),
        (frame([1.0, [stored_map([1], group_idx=-2)]]), "group_idx"),
        # Past the inventory's groups: refused per frame, not per batch downstream.
        (frame([1.0, [stored_map([1], group_idx=1024)]]), "group_idx must be an int in 0..1023"),
        (
            frame([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": 5000}]]),
            "0..1023",
        ),
        (frame([1.0, [stored_map([1], lora_name=5)]]), "lora_name"),
    ],
)
def test_malformed_frames_raise_one_clear_error(frames: list[bytes], says: str) -> None:
    with pytest.raises(MalformedFrame, match=says):
        decode_frame(frames)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_payload_bytes_decode_or_raise_malformed_only(payload: bytes) -> None:
    try:
        result = decode_frame([b"", SEQ0, payload])
    except MalformedFrame:
        return
    assert isinstance(result, DecodedBatch)


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(json_like, max_size=4))
def test_arbitrary_msgpack_events_decode_or_raise_malformed_only(events: list[Any]) -> None:
    with contextlib.suppress(MalformedFrame):
        decode_frame(frame([1.0, events, 0]))


def test_a_frame_is_bounded_in_events_and_block_hashes() -> None:
    """One frame's decode and apply cost the event loop a bounded time (I8-bad-input):
    an 8 MiB frame held ~900,000 hashes, seconds of work."""
    removed = {"type": "BlockRemoved", "block_hashes": list(range(1, 4097))}
    at_bound = frame([1.0, [removed] * (MAX_FRAME_BLOCKS // 4096)])
    assert decode_frame(at_bound).removed_blocks == MAX_FRAME_BLOCKS  # control: at the bound
    over = frame([1.0, [removed] * (MAX_FRAME_BLOCKS // 4096) + [stored_map([1])]])
    with pytest.raises(MalformedFrame, match=f"more than {MAX_FRAME_BLOCKS} block hashes"):
        decode_frame(over)
    stored_over = frame([1.0, [stored_map(list(range(1, MAX_FRAME_BLOCKS + 2)))]])
    with pytest.raises(MalformedFrame, match="block hashes in one frame"):
        decode_frame(stored_over)
    with pytest.raises(MalformedFrame, match=f"at most {MAX_FRAME_EVENTS}"):
        decode_frame(frame([1.0, [CLEARED_MAP] * (MAX_FRAME_EVENTS + 1)]))
    assert decode_frame(frame([1.0, [CLEARED_MAP] * MAX_FRAME_EVENTS])).cleared == MAX_FRAME_EVENTS


def test_the_event_count_is_checked_before_any_event_is_decoded() -> None:
    """A frame of millions of tiny events was decoded whole (about 0.6 s of the event
    loop for 4 MiB) before its count was refused. The count is read from the array's
    header now: this frame claims 70,000 events and carries none of them, and is refused
    for its count (before: for its bytes, once msgpack had tried to read them all)."""
    header = msgpack.packb(1.0)
    claims = b"\xdd" + (70_000).to_bytes(4, "big")  # array 32 header: 70,000 elements
    payload = b"\x93" + header + claims  # [ts, events, ...] with the events missing
    with pytest.raises(MalformedFrame, match="70000 events in one frame; at most 65536"):
        decode_payload(b"", 0, payload)
    # Trailing bytes after a whole batch are refused, as msgpack.unpackb refused them.
    with pytest.raises(MalformedFrame, match="data after the batch"):
        decode_payload(b"", 0, msgpack.packb([1.0, [], 0]) + b"\x00")


def test_a_sequence_past_2_63_is_malformed_not_a_batch() -> None:
    """vLLM counts its batches from 0; all ones marks a replay's end. Taken as a batch,
    a sequence near 2**64 left every later batch of the stream a duplicate."""
    assert decode_sequence(((1 << 63) - 1).to_bytes(8, "big")) == (1 << 63) - 1
    for raw in (b"\xff" * 8, (1 << 63).to_bytes(8, "big")):
        with pytest.raises(MalformedFrame, match="past 2\\*\\*63 - 1"):
            decode_sequence(raw)
