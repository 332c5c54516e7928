"""The replicated inventory on plain data (coordinator/runtime/replication.py), no Redis.

Two `ReplicatedInventory`s stand for two replicas; what one records goes through
the log's codec (`pack_ops` / `unpack_ops`) to the other's `apply_remote`, as the
Redis store carries it. The hypothesis test drives random local changes, ships
the log in random slices, and checks that both replicas answer every lookup alike
(I7-ordered-streams: log order is the origin's order; I4-advisory).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from coordinator.core.errors import KvrcError
from coordinator.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    InventoryEvent,
    Tier,
)
from coordinator.core.inventory import Candidate, Scope
from coordinator.core.vllm_events import MAX_FRAME_BLOCKS, decode_payload
from coordinator.edges.zmq_ingest import ZmqStreamConfig
from coordinator.runtime.config import MIN_OUTBOX_MAX_BYTES
from coordinator.runtime.replication import (
    ReplicatedInventory,
    decode_events,
    encode_events,
    pack_ops,
    unpack_ops,
)
from kvrc.vocabulary import MAX_BLOCK_HASH_BYTES, MAX_BLOCKS_PER_BATCH, MAX_EVENTS_PER_BATCH

CHAIN = tuple(bytes([0xC0, i]) * 4 for i in range(12))
COMPAT = "compat-1"


def replica(origin: str, limit: int = 1_000_000) -> ReplicatedInventory:
    return ReplicatedInventory(
        origin, max_entries_total=10_000, max_entries_per_engine=1_000, outbox_limit=limit
    )


def ship(source: ReplicatedInventory, *targets: ReplicatedInventory, now_ms: int = 0) -> int:
    """Drains the source's outbox through the codec into every target."""
    ops = list(source.outbox)
    source.outbox.clear()
    data = pack_ops(ops)
    for target in targets:
        target.apply_remote(source.origin, unpack_ops(data), now_ms)
    return len(ops)


def view(
    inv: ReplicatedInventory, now_ms: int, chain: Sequence[bytes] = CHAIN
) -> list[tuple[str, int, Tier, int]]:
    """A lookup as any third requester sees it; expiry as the time left (clocks differ)."""
    answer = inv.lookup(Scope(COMPAT), chain, now_ms=now_ms, max_candidates=64)
    return [_relative(c, now_ms) for c in answer.candidates]


def _relative(c: Candidate, now_ms: int) -> tuple[str, int, Tier, int]:
    left = c.expiry_ms - now_ms if c.expiry_ms else 0
    return (c.child_engine_id, c.matched_blocks, c.tier, left)


def ready_engine(inv: ReplicatedInventory, cid: str) -> None:
    inv.add_engine(cid, COMPAT)
    inv.set_ready(cid, True)


def test_events_round_trip_with_expiry_as_time_left() -> None:
    events: tuple[InventoryEvent, ...] = (
        BlockStored(CHAIN[:3], None, 48, Tier.CPU, 1, expiry_ms=10_500),
        BlockStored(CHAIN[3:4], CHAIN[2], 16),
        BlockRemoved(CHAIN[1:2], Tier.GPU, 0),
        AllBlocksCleared(),
    )
    raw = unpack_ops(pack_ops([encode_events(events, now_ms=10_000)]))[0]
    back = decode_events(raw, now_ms=900_000)
    assert back[0] == BlockStored(CHAIN[:3], None, 48, Tier.CPU, 1, expiry_ms=900_500)
    assert back[1:] == events[1:]
    # An instant already past still expires (1 ms left), it does not become "no expiry".
    late = decode_events(encode_events((events[0],), now_ms=20_000), now_ms=5)
    assert isinstance(late[0], BlockStored) and late[0].expiry_ms == 6


def test_local_changes_reach_the_other_replica_and_departures_too() -> None:
    a, b = replica("a"), replica("b")
    ready_engine(a, "h1")
    a.apply("h1", [BlockStored(CHAIN[:6], None, 96)], now_ms=0)
    ship(a, b)
    assert view(b, 0) == view(a, 0) == [("h1", 6, Tier.GPU, 0)]
    assert b.remote_engines() == {"h1": "a"}
    a.remove_engine("h1")
    ship(a, b)
    assert view(b, 0) == [] and not b.has_engine("h1")


def test_own_ops_are_not_applied_twice_and_a_local_engine_wins() -> None:
    a, b = replica("a"), replica("b")
    ready_engine(a, "shared")
    a.apply("shared", [BlockStored(CHAIN[:4], None, 64)], now_ms=0)
    ready_engine(b, "shared")  # the same id registered on b: b's session is first hand
    b.apply("shared", [BlockStored(CHAIN[:2], None, 32)], now_ms=0)
    ops = list(a.outbox)
    assert a.apply_remote("a", ops, 0) == 0  # its own entry, read back from the log
    ship(a, b)
    assert view(b, 0) == [("shared", 2, Tier.GPU, 0)]
    assert b.remote_engines() == {}


def test_an_engine_that_moves_replaces_the_remote_copy() -> None:
    a, b = replica("a"), replica("b")
    ready_engine(a, "mover")
    a.apply("mover", [BlockStored(CHAIN[:5], None, 80)], now_ms=0)
    ship(a, b)
    ready_engine(b, "mover")  # a died; the engine reconnected to b with a fresh stream
    assert b.remote_engines() == {} and view(b, 0) == []
    b.apply("mover", [BlockStored(CHAIN[:3], None, 48)], now_ms=0)
    assert view(b, 0) == [("mover", 3, Tier.GPU, 0)]
    # A late op of the old owner changes nothing here.
    a.apply("mover", [BlockStored(CHAIN[5:8], CHAIN[4], 48)], now_ms=0)
    ship(a, b)
    assert view(b, 0) == [("mover", 3, Tier.GPU, 0)]


def test_reset_and_silent_origins_drop_that_origins_engines_only() -> None:
    a, c, b = replica("a"), replica("c"), replica("b")
    ready_engine(a, "ea")
    ready_engine(c, "ec")
    a.apply("ea", [BlockStored(CHAIN[:2], None, 32)], now_ms=0)
    c.apply("ec", [BlockStored(CHAIN[:3], None, 48)], now_ms=0)
    ship(a, b, now_ms=1_000)
    ship(c, b, now_ms=1_000)
    assert {x[0] for x in view(b, 0)} == {"ea", "ec"}
    a.reannounce()  # a lost ops: reset, then its engines again (without their entries)
    ship(a, b, now_ms=2_000)
    assert b.remote_engines() == {"ea": "a", "ec": "c"}
    assert b.engine_entries("ea") == 0 and b.engine_entries("ec") == 3
    c.heartbeat()
    ship(c, b, now_ms=9_000)
    # a was last heard at 2 000, c at 9 000: only a's engines leave at 9 500 (timeout 5 000).
    assert b.expire_silent_origins(9_500, 5_000) == 1
    assert b.remote_engines() == {"ec": "c"}


def test_an_origin_called_silent_and_heard_again_is_asked_to_announce_again() -> None:
    a, b, c = replica("a"), replica("b"), replica("c")
    asked: list[str] = []
    a.on_asked_to_announce = asked.append
    ready_engine(a, "ea")
    a.apply("ea", [BlockStored(CHAIN[:2], None, 32)], now_ms=0)
    ship(a, b, c, now_ms=1_000)
    b.outbox.clear()
    assert b.expire_silent_origins(9_000, 5_000) == 1  # a was only cut off from b
    a.heartbeat()
    ship(a, b, c, now_ms=9_500)
    assert list(b.outbox) == [["W", "a"]]  # b heard a again: a hello naming a
    ship(b, a, c, now_ms=9_600)
    assert asked == ["b"] and list(c.outbox) == []  # c, which kept a, is not asked
    ship(a, b, c, now_ms=9_700)  # a's engine again, no reset: c keeps its entries
    assert b.remote_engines() == {"ea": "a"} and b.is_visible("ea")
    assert c.engine_entries("ea") == 2
    a.outbox.clear()
    # Other replicas that heard a again, inside the window: served by that announcement.
    a.apply_remote("x", [["W", "a"]], 9_800)
    a.heartbeat(10_700)
    assert asked == ["b"] and [op[0] for op in a.outbox] == ["H"]
    a.outbox.clear()
    a.apply_remote("x", [["W", "a"]], 10_700)  # past the window: announced again
    assert asked == ["b", "x"] and [op[0] for op in a.outbox] == ["E", "V"]


def test_a_hello_after_a_zombies_fence_inside_the_window_is_served_at_its_end() -> None:
    """A replica that fenced a zombie had ignored a's last announcement (the engine was
    its own then) and asks after it. Inside the re-announce window that hello was
    dropped: it never heard of the engine again. One more announcement serves it (and
    every such asker meanwhile) at the first health beat past the window."""
    a = replica("a")
    asked: list[str] = []
    a.on_asked_to_announce = asked.append
    ready_engine(a, "ea")
    a.apply_remote("b", [["W", "a"]], 9_600)  # announced at once
    a.outbox.clear()
    a.apply_remote("x", [["W", "a", "fence"]], 9_800)
    a.apply_remote("y", [["W", "a", "fence"]], 9_900)
    assert asked == ["b"] and list(a.outbox) == []
    a.heartbeat(10_000)  # the window is not over
    assert asked == ["b"] and [op[0] for op in a.outbox] == ["H"]
    a.outbox.clear()
    a.heartbeat(10_600)
    assert asked == ["b", "x, y"] and [op[0] for op in a.outbox] == ["H", "E", "V"]
    a.outbox.clear()
    a.heartbeat(11_100)  # served: nothing more
    assert [op[0] for op in a.outbox] == ["H"]
    # An announcement made at once in between serves a deferred asker too (a review
    # found a third round: the deferred one still fired after it).
    a.apply_remote("x", [["W", "a", "fence"]], 11_200)  # inside 10 600's window: deferred
    a.outbox.clear()
    a.apply_remote("d", [["W", "a"]], 11_700)  # past it: at once
    a.heartbeat(12_000)
    assert asked == ["b", "x, y", "d"] and [op[0] for op in a.outbox] == ["E", "V", "H"]


def test_a_bad_op_is_skipped_and_the_rest_of_the_entry_applies() -> None:
    a, b = replica("a"), replica("b")
    ready_engine(a, "ok")
    a.apply("ok", [BlockStored(CHAIN[:2], None, 32)], now_ms=0)
    ops: list[list[Any]] = [["?", "x"], ["A", "unknown", None, []], *a.outbox]
    # The unknown tag is skipped, the op of an engine b never heard of changes nothing.
    assert b.apply_remote("a", ops, 0) == len(ops) - 2
    assert view(b, 0) == [("ok", 2, Tier.GPU, 0)]


def test_refused_local_changes_are_not_recorded() -> None:
    a = replica("a")
    ready_engine(a, "e")
    a.outbox.clear()
    with pytest.raises(KvrcError):
        a.apply("e", [BlockStored(CHAIN[:2], None, 32)], rank_key=(0, 0, 0), now_ms=0)
    with pytest.raises(KvrcError):
        a.add_engine("e", COMPAT)
    assert list(a.outbox) == []


def test_a_full_outbox_turns_into_a_reset_and_re_announcement() -> None:
    a, b = replica("a", limit=4), replica("b")
    ready_engine(a, "e")
    for i in range(6):
        a.apply("e", [BlockStored(CHAIN[i : i + 1], CHAIN[i - 1] if i else None, 16)], now_ms=0)
    assert a.outbox_overflowed and len(a.outbox) < 4
    generation = a.generation
    a.reannounce()
    assert a.generation > generation and not a.outbox_overflowed
    assert [op[0] for op in a.outbox] == ["R", "E", "V"]
    ship(a, b)
    assert b.remote_engines() == {"e": "a"} and b.is_visible("e")


def packed(ops: Sequence[list[Any]]) -> int:
    """What the ops take in a log entry, counted one by one (less the entry's header)."""
    return sum(len(msgpack.packb(op, use_bin_type=True)) for op in ops)


def test_the_outbox_is_bounded_by_its_packed_bytes() -> None:
    """The bound counts bytes as appended (msgpack), not ops: a few big store ops
    overflow it long before the op count would."""
    bound = 20_000
    a = ReplicatedInventory(
        "a", max_entries_total=100_000, max_entries_per_engine=100_000, outbox_max_bytes=bound
    )
    ready_engine(a, "e")
    big = [bytes([i % 256, i // 256]) * 16 for i in range(256)]  # one 256-block op: ~9 KB
    for i in range(0, 256, 64):
        a.apply("e", [BlockStored(tuple(big[i : i + 64]), None, 1024)], now_ms=0)
        assert a.outbox_bytes == packed(a.outbox) <= bound
    assert not a.outbox_overflowed
    a.outbox.clear()
    for _ in range(3):  # 3 x ~9 KB > 20 KB: overflows at the third, 3 ops in all
        a.apply("e", [BlockStored(tuple(big), None, 4096)], now_ms=0)
        assert a.outbox_bytes == packed(a.outbox) <= bound
    assert a.outbox_overflowed and len(a.outbox) < 3
    a.reannounce()
    assert not a.outbox_overflowed and a.outbox_bytes == packed(a.outbox)


def test_one_engine_message_s_ops_fit_the_smallest_outbox_with_room_to_spare() -> None:
    """`--store-outbox-max-bytes` may be as low as one gRPC message (16 MiB). The ops of
    one engine message must fit it, or every full dump would overflow it again. The
    largest batches the wire bounds allow, gRPC's and a vLLM ZMQ frame's, record one op
    each of at most a third of that (counted, not timed; the bounds are the shared ones,
    so raising them fails here first)."""
    a = ReplicatedInventory(
        "a",
        max_entries_total=1_000_000,
        max_entries_per_engine=1_000_000,
        outbox_max_bytes=MIN_OUTBOX_MAX_BYTES,
    )
    ready_engine(a, "e")
    a.outbox.clear()  # the engine's announcement
    # gRPC: MAX_EVENTS_PER_BATCH events sharing MAX_BLOCKS_PER_BATCH hashes, all at the
    # longest hash and parent the wire takes.
    per_event = MAX_BLOCKS_PER_BATCH // MAX_EVENTS_PER_BATCH
    events = [
        BlockStored(
            tuple(
                (i * per_event + k).to_bytes(4, "big") * (MAX_BLOCK_HASH_BYTES // 4)
                for k in range(per_event)
            ),
            bytes([0xFE]) * MAX_BLOCK_HASH_BYTES,
            16 * per_event,
        )
        for i in range(MAX_EVENTS_PER_BATCH)
    ]
    a.apply("e", events, now_ms=0)
    assert len(a.outbox) == 1 and not a.outbox_overflowed
    assert a.outbox_bytes <= MIN_OUTBOX_MAX_BYTES // 3, a.outbox_bytes
    a.outbox.clear()
    # ZMQ: a frame of MAX_FRAME_BLOCKS removals with 48-byte hashes (vLLM's frames stop at
    # 4 MiB); the op is the frame's hashes again, and little else.
    hashes = [i.to_bytes(4, "big") * 12 for i in range(MAX_FRAME_BLOCKS)]
    frame = {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}
    payload = msgpack.packb([0.0, [frame], 0], use_bin_type=True)
    assert len(payload) <= ZmqStreamConfig("e", "tcp://127.0.0.1:1").max_frame_bytes
    decoded = decode_payload(b"kv", 1, payload)
    a.apply("e", decoded.events, now_ms=0)
    assert len(a.outbox) == 1 and not a.outbox_overflowed
    assert a.outbox_bytes <= 1.1 * len(payload) <= MIN_OUTBOX_MAX_BYTES // 3, a.outbox_bytes


@pytest.mark.parametrize("count", [1, 15, 16, 300])
def test_a_log_entry_is_the_ops_packed_once_each_when_recorded(count: int) -> None:
    """The writer sends each op as packed when it was recorded (no second packing): the
    entry must be, byte for byte, what packing the ops together gives."""
    a = replica("a")
    ready_engine(a, "e")
    a.outbox.clear()
    for i in range(count):
        a.apply("e", [BlockStored((bytes([i % 256, i // 256]) * 16,), None, 16)], now_ms=0)
    ops = list(a.outbox)
    for n in {1, min(15, len(ops)), len(ops)}:
        assert a.entry(n) == pack_ops(ops[:n])
    a.take_sent(len(ops) - 1)
    assert a.entry(1) == pack_ops(ops[-1:]) and a.outbox_bytes == packed(ops[-1:])


RELEASE = ["M", "b", "h", [0, 0, 0], "s-1", ["release", "pl-1@a", 1, "succeeded"]]
ANSWER = ["Q", "b", "b/1", True, None]


def test_lease_messages_outlive_a_reset_and_follow_the_re_announcement() -> None:
    """A store loss or an overflow resets the outbox: a release queued there must still
    reach its holder (I6-quiescence), after the re-announcement."""
    a = replica("a")
    ready_engine(a, "e")
    a.record(list(RELEASE))
    a.apply("e", [BlockStored(CHAIN[:1], None, 16)], now_ms=0)
    a.reannounce()  # a store loss
    assert [op[0] for op in a.outbox] == ["R", "E", "V", "M"]
    assert a.outbox[-1] == RELEASE
    b = replica("b", limit=5)  # an overflow: kept from the outbox and after it
    ready_engine(b, "e")
    b.record(list(RELEASE))
    for i in range(6):
        b.apply("e", [BlockStored(CHAIN[i : i + 1], CHAIN[i - 1] if i else None, 16)], now_ms=0)
    b.record(list(ANSWER))
    assert b.outbox_overflowed
    b.reannounce()
    assert [op[0] for op in b.outbox] == ["R", "E", "V", "M", "Q"]


def test_hellos_and_call_cancels_outlive_a_reset_too() -> None:
    """Nothing asks again for them: a hello lost to an overflow left the parts it asked
    for missing from this view for good, and a lost call cancel could leave a begin
    waiting on its owner to be granted to nobody. A forwarded call itself is not kept
    (its caller asks again)."""
    b = replica("b", limit=8)
    ready_engine(b, "e")
    hello, named = ["W"], ["W", "x"]
    cancel = ["K", "x", "7/cancel", "cancel", "7"]
    call = ["K", "x", "8", "begin_handoff", []]
    for op in (hello, named, cancel, call):
        b.record(list(op))
    for i in range(4):
        b.apply("e", [BlockStored(CHAIN[i : i + 1], CHAIN[i - 1] if i else None, 16)], now_ms=0)
    b.record(list(named))  # recorded while overflowed: kept as well
    assert b.outbox_overflowed
    b.reannounce()
    assert [op for op in b.outbox if op[0] in ("W", "K")] == [hello, named, cancel, named]


# --- the model: both replicas answer alike -------------------------------------------------

ENGINES = ("e0", "e1", "e2")
_store = st.tuples(
    st.just("store"),
    st.sampled_from(ENGINES),
    st.integers(0, 3),
    st.integers(1, 6),
    st.sampled_from([Tier.GPU, Tier.CPU]),
    st.sampled_from([0, 0, 500, 5_000]),
)
_op = st.one_of(
    _store,
    _store,  # stores weigh more: most examples then end with candidates to compare
    _store,
    st.tuples(st.just("add"), st.sampled_from(ENGINES)),
    st.tuples(st.just("ready"), st.sampled_from(ENGINES), st.booleans()),
    st.tuples(
        st.just("store"),
        st.sampled_from(ENGINES),
        st.integers(0, 10),
        st.integers(1, 4),
        st.sampled_from([Tier.GPU, Tier.CPU]),
        st.sampled_from([0, 0, 500, 5_000]),
    ),
    st.tuples(st.just("remove_blocks"), st.sampled_from(ENGINES), st.integers(0, 11)),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES)),
    st.tuples(st.just("stale"), st.sampled_from(ENGINES)),
    st.tuples(st.just("dump"), st.sampled_from(ENGINES), st.booleans()),
    st.tuples(st.just("leave"), st.sampled_from(ENGINES)),
    st.tuples(
        st.just("ship"),
    ),
)


def _run(inv: ReplicatedInventory, op: tuple[Any, ...], now_ms: int) -> None:
    kind, *args = op
    cid = args[0] if args else ""
    try:
        if kind == "add":
            inv.add_engine(cid, COMPAT)
        elif kind == "ready":
            inv.set_ready(cid, args[1])
        elif kind == "store":
            start, length, tier, ttl = args[1:]
            hashes = CHAIN[start : start + length]
            parent = CHAIN[start - 1] if start else None
            expiry = now_ms + ttl if ttl else 0
            inv.apply(
                cid, [BlockStored(hashes, parent, 16 * len(hashes), tier, 0, expiry)], now_ms=now_ms
            )
        elif kind == "remove_blocks":
            inv.apply(cid, [BlockRemoved(CHAIN[args[1] : args[1] + 1])], now_ms=now_ms)
        elif kind == "clear":
            inv.clear_stream(cid)
        elif kind == "stale":
            inv.mark_stale(cid)
        elif kind == "dump":
            (inv.begin_dump if args[1] else inv.end_dump)(cid)
        elif kind == "leave":
            inv.remove_engine(cid)
    except KvrcError:
        pass  # refused: changed nothing and recorded nothing


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40), st.integers(0, 3_000))
def test_both_replicas_answer_every_lookup_alike(ops: list[tuple[Any, ...]], elapsed: int) -> None:
    a, b = replica("a"), replica("b")
    now_a, now_b = 1_000, 7_777_000  # monotonic clocks of two hosts never agree
    for cid in ENGINES[:2]:  # most examples then reach visible engines with entries
        ready_engine(a, cid)
    # The log's own transit time is left out (the clocks stand still while it runs): a
    # reader adds the time left when it reads, so it errs toward keeping a hint longer.
    for op in ops:
        if op[0] == "ship":
            ship(a, b, now_ms=now_b)
        else:
            _run(a, op, now_a)
    ship(a, b, now_ms=now_b)
    seen = False
    for start in (0, 1, 4):
        chain = CHAIN[start:]
        expected = view(a, now_a + elapsed, chain)
        assert view(b, now_b + elapsed, chain) == expected
        seen = seen or bool(expected)
    event("some candidate" if seen else "no candidate")
    assert set(b.remote_engines()) == {cid for cid in ENGINES if a.has_engine(cid)}


def test_the_serving_flag_reaches_the_other_replica_and_old_ops_still_read() -> None:
    # Score counts an engine's own matches whatever its reuse gate (docs/score.md): the
    # flag rides as the visibility op's 4th element.
    a, b = replica("a"), replica("b")
    a.add_engine("e", COMPAT)
    a.apply("e", [BlockStored(CHAIN[:4], None, 64, Tier.GPU)])
    a.set_ready("e", False)  # reuse off: not a holder
    a.set_serving("e", True)
    ship(a, b)
    assert view(b, 0) == []  # no lookup sees it
    assert b.match(Scope(COMPAT), CHAIN, ["e"], now_ms=0).matches["e"].matched_blocks == 4
    a.set_serving("e", False)
    ship(a, b)
    assert b.match(Scope(COMPAT), CHAIN, ["e"], now_ms=0).matches == {}
    # A replica that predates the flag sends 3 elements: a visible engine serves.
    c = replica("c")
    c.apply_remote("old", [["E", "x", COMPAT, 1, []], ["V", "x", True]], 0)
    assert c.match(Scope(COMPAT), CHAIN, ["x"], now_ms=0).matches["x"].matched_blocks == 0
    c.apply_remote("old", [["V", "x", False]], 0)
    assert c.match(Scope(COMPAT), CHAIN, ["x"], now_ms=0).matches == {}


def test_every_op_tag_on_the_log_is_distinct() -> None:
    """Replication ops and peer ops share one log and one tag space: a tag used twice
    routes one kind of op to the other's handler (a replicated clear dropped as a call)."""
    from coordinator.runtime import peers, replication

    tags = [
        value
        for module in (replication, peers)
        for name, value in vars(module).items()
        if name.startswith("OP_") and isinstance(value, str)
    ]
    assert len(tags) == len(set(tags)), sorted(tags)
