"""Snapshots of the replicated inventory on plain data (no Redis): codec and equivalence.

A snapshot is every engine a replica sees, labelled with the last log entry it
read (coordinator/runtime/replication.py). What must hold: a replica that loads
it and then applies the rest of the log has the view of one that applied the whole
log, whoever wrote it (the origin itself, whose own engines may be ahead of the
label, or a reader). The hypothesis test checks that on random histories; the
codec tests check the round trip, the bounds and what a malformed or foreign
snapshot does (refused, never half-loaded).
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.core.errors import KvrcError
from coordinator.core.events import BlockRemoved, BlockStored, Tier
from coordinator.core.inventory import EngineImage, Scope
from coordinator.runtime.replication import (
    ReplicatedInventory,
    Snapshot,
    SnapshotIncompatible,
    decode_snapshot,
    encode_snapshot,
    pack_ops,
    unpack_ops,
)
from kvrc.vocabulary import PublishMode

CHAIN = tuple(bytes([0xD0, i]) * 4 for i in range(12))
COMPAT = "compat-1"
RANKS = ((0, 0, 0), (1, 0, 0))


def replica(origin: str) -> ReplicatedInventory:
    return ReplicatedInventory(origin, max_entries_total=10_000, max_entries_per_engine=1_000)


def ship(ops: list[Any], origin: str, target: ReplicatedInventory, now_ms: int) -> None:
    target.apply_remote(origin, unpack_ops(pack_ops(ops)), now_ms)


def canonical(inv: ReplicatedInventory, now_ms: int) -> list[tuple[Any, ...]]:
    """The whole state of every engine, orders dropped, expiries as the time left."""
    out = []
    for cid in sorted(inv.engine_ids()):
        im = inv.export_engine(cid, now_ms)
        out.append(
            (
                im.child_engine_id,
                im.compatibility_hash,
                im.publish_mode,
                im.rank_keys,
                im.ready,
                im.serving,
                sorted(map(repr, im.stale)),
                sorted(map(repr, im.dumping)),
                sorted((g, t, k) for g, t, keys in im.index for k in keys),
                sorted(
                    (g, k, e - now_ms)
                    for g, keys, exp in im.expiry
                    for k, e in zip(keys, exp, strict=True)
                ),
                sorted(
                    (r, g, k, t, e - now_ms if e else 0)
                    for r, g, keys, tiers, exp in im.parts
                    for k, t, e in zip(keys, tiers, exp, strict=True)
                ),
            )
        )
    return out


def lookups(inv: ReplicatedInventory, now_ms: int) -> list[Any]:
    out = []
    for start in (0, 1, 4):
        answer = inv.lookup(Scope(COMPAT), CHAIN[start:], now_ms=now_ms, max_candidates=64)
        out.append(
            [
                (
                    c.child_engine_id,
                    c.matched_blocks,
                    c.tier,
                    c.expiry_ms - now_ms if c.expiry_ms else 0,
                )
                for c in answer.candidates
            ]
        )
    return out


def test_a_snapshot_round_trips_every_kind_of_state() -> None:
    a = replica("a")
    a.add_engine("e", COMPAT)
    a.set_ready("e", True)
    a.apply("e", [BlockStored(CHAIN[:4], None, 64)], now_ms=100)
    a.apply("e", [BlockStored(CHAIN[4:6], CHAIN[3], 32, Tier.CPU, 2, 600)], now_ms=100)
    a.add_engine("p", COMPAT, publish_mode=PublishMode.PER_RANK_PART, rank_keys=RANKS)
    for rank in RANKS:
        a.apply("p", [BlockStored(CHAIN[:3], None, 48, expiry_ms=900)], rank_key=rank, now_ms=100)
    a.apply("p", [BlockStored(CHAIN[3:5], CHAIN[2], 32)], rank_key=RANKS[0], now_ms=100)
    a.mark_stale("p", RANKS[1])
    a.apply_remote("b", [["E", "r", COMPAT, 1, []], ["V", "r", True, True]], 100)
    snap = a.snapshot("5-1", wall_ms=123, now_ms=100)
    back = decode_snapshot(encode_snapshot(snap, now_ms=100), now_ms=10_100)
    assert (back.stream_id, back.writer, back.wall_ms) == ("5-1", "a", 123)
    assert {(o, im.child_engine_id) for o, im in back.engines} == {
        ("a", "e"),
        ("a", "p"),
        ("b", "r"),
    }
    assert back.memberships == snap.memberships == 4 + 2 + 3
    c = replica("c")
    assert c.load_snapshot(back, now_ms=10_100) == 3
    assert canonical(c, 10_100) == canonical(a, 100)
    assert lookups(c, 10_100) == lookups(a, 100)
    assert c.remote_engines() == {"e": "a", "p": "a", "r": "b"}
    # The loader's own origin and its own engines are first hand: not replaced.
    b = replica("b")
    b.add_engine("e", COMPAT)
    assert b.load_snapshot(back, now_ms=0) == 1 and b.remote_engines() == {"p": "a"}


def test_about_8_bytes_per_membership_and_expired_entries_left_out() -> None:
    a = replica("a")
    a.add_engine("e", COMPAT)
    hashes = tuple(i.to_bytes(32, "big") for i in range(1000))
    a.apply("e", [BlockStored(hashes, None, 16 * len(hashes))], now_ms=0)
    size = len(encode_snapshot(a.snapshot("1-0", 0, 0), now_ms=0))
    assert 8_000 <= size <= 8_000 + 200
    a.apply("e", [BlockStored(hashes[:10], None, 160, Tier.CPU, 0, 50)], now_ms=0)
    assert a.snapshot("1-0", 0, now_ms=60).memberships == 1000  # the 10 CPU ones expired


def test_a_malformed_or_foreign_snapshot_is_refused_and_nothing_is_loaded() -> None:
    a = replica("a")
    a.add_engine("e", COMPAT)
    a.apply("e", [BlockStored(CHAIN[:4], None, 64)])
    good = encode_snapshot(a.snapshot("1-0", 0, 0), now_ms=0)
    doc = msgpack.unpackb(good, raw=False)
    foreign = msgpack.packb([doc[0], doc[1] ^ 1, *doc[2:]], use_bin_type=True)
    with pytest.raises(SnapshotIncompatible):
        decode_snapshot(foreign, now_ms=0)
    with pytest.raises(ValueError, match="version"):
        decode_snapshot(msgpack.packb([99, *doc[1:]], use_bin_type=True), now_ms=0)
    cut = msgpack.unpackb(good, raw=False)
    cut[5][0][10] = [[0, b"\x01" * 16, b"\x01" * 8]]  # two keys, one expiry
    with pytest.raises(ValueError, match="malformed"):
        decode_snapshot(msgpack.packb(cut, use_bin_type=True), now_ms=0)
    doc[5][0][9][0][2] = b"\x01" * 7  # a key array cut short
    with pytest.raises(ValueError, match="malformed"):
        decode_snapshot(msgpack.packb(doc, use_bin_type=True), now_ms=0)
    for junk in (b"", b"\xc1", msgpack.packb({"a": 1})):
        with pytest.raises(ValueError):
            decode_snapshot(junk, now_ms=0)


def test_an_image_with_an_unknown_rank_or_tier_is_refused() -> None:
    c = replica("c")
    bad = EngineImage("x", COMPAT, PublishMode.PER_CHILD_ENGINE, (), True, True, (), (),
                      ((0, 9, (1,)),), (), ())  # fmt: skip
    with pytest.raises(KvrcError):
        c.restore_engine(bad)
    assert not c.has_engine("x")  # refused before anything was added
    wrong_rank = EngineImage("y", COMPAT, PublishMode.PER_RANK_PART, RANKS, True, True, (), (),
                             (), (), (((9, 9, 9), 0, (1,), (2,), (0,)),))  # fmt: skip
    good = EngineImage("z", COMPAT, PublishMode.PER_CHILD_ENGINE, (), True, True, (), (),
                       ((0, 1, (1, 2)),), (), ())  # fmt: skip
    # A snapshot with a bad engine loads the others.
    assert c.load_snapshot(Snapshot("1-0", "a", 0, (("a", wrong_rank), ("a", good))), 0) == 1
    assert not c.has_engine("y") and c.engine_entries("z") == 2


# --- the model: snapshot + tail == the whole log -----------------------------------------

ENGINES = ("e0", "e1")
_op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from(ENGINES),
        st.integers(0, 8),
        st.integers(1, 4),
        st.sampled_from([Tier.GPU, Tier.CPU]),
        st.sampled_from([0, 0, 500]),
    ),
    st.tuples(st.just("pstore"), st.sampled_from(RANKS), st.integers(0, 8), st.integers(1, 4)),
    st.tuples(st.just("premove"), st.sampled_from(RANKS), st.integers(0, 11)),
    st.tuples(st.just("add"), st.sampled_from(ENGINES)),
    st.tuples(st.just("ready"), st.sampled_from(ENGINES), st.booleans()),
    st.tuples(st.just("remove_blocks"), st.sampled_from(ENGINES), st.integers(0, 11)),
    st.tuples(st.just("clear"), st.sampled_from(ENGINES)),
    st.tuples(st.just("stale"), st.sampled_from(ENGINES)),
    st.tuples(st.just("dump"), st.sampled_from(ENGINES), st.booleans()),
    st.tuples(st.just("leave"), st.sampled_from(ENGINES)),
    st.tuples(st.just("ship")),
)


def _run(inv: ReplicatedInventory, op: tuple[Any, ...], now_ms: int) -> None:
    kind, *args = op
    try:
        if kind == "add":
            inv.add_engine(args[0], COMPAT)
        elif kind == "ready":
            inv.set_ready(args[0], args[1])
        elif kind == "store":
            cid, start, length, tier, ttl = args
            inv.apply(
                cid,
                [
                    BlockStored(
                        CHAIN[start : start + length], None, 16, tier, 0, now_ms + ttl if ttl else 0
                    )
                ],
                now_ms=now_ms,
            )
        elif kind == "pstore":
            rank, start, length = args
            inv.apply(
                "p",
                [BlockStored(CHAIN[start : start + length], None, 16)],
                rank_key=rank,
                now_ms=now_ms,
            )
        elif kind == "premove":
            inv.apply(
                "p", [BlockRemoved(CHAIN[args[1] : args[1] + 1])], rank_key=args[0], now_ms=now_ms
            )
        elif kind == "remove_blocks":
            inv.apply(args[0], [BlockRemoved(CHAIN[args[1] : args[1] + 1])], now_ms=now_ms)
        elif kind == "clear":
            inv.clear_stream(args[0])
        elif kind == "stale":
            inv.mark_stale(args[0])
        elif kind == "dump":
            (inv.begin_dump if args[1] else inv.end_dump)(args[0])
        elif kind == "leave":
            inv.remove_engine(args[0])
    except KvrcError:
        pass  # refused: changed nothing and recorded nothing


@settings(max_examples=150, deadline=None)
@given(
    st.lists(_op, max_size=30),
    st.lists(_op, max_size=30),
    st.booleans(),
    st.integers(0, 4),
)
def test_snapshot_plus_tail_equals_the_whole_log(
    before: list[tuple[Any, ...]], after: list[tuple[Any, ...]], origin_writes: bool, early: int
) -> None:
    now_a, now_b, now_c = 1_000, 7_777_000, 42_000  # three hosts' monotonic clocks
    a, b = replica("a"), replica("b")
    a.add_engine("e0", COMPAT)
    a.set_ready("e0", True)
    a.add_engine("p", COMPAT, publish_mode=PublishMode.PER_RANK_PART, rank_keys=RANKS)
    a.set_ready("p", True)
    log: list[list[Any]] = []  # the log's entries, in order

    def append() -> None:
        log.append(list(a.outbox))
        a.outbox.clear()

    shipped = 0  # entries b has applied, each once

    def catch_up() -> None:
        nonlocal shipped
        for entry in log[shipped:]:
            ship(entry, "a", b, now_b)
        shipped = len(log)

    for op in before:
        append() if op[0] == "ship" else _run(a, op, now_a)
    append()
    catch_up()
    covered = len(log)  # the snapshot's label: the last entry its writer has read
    # The origin writes with ops not appended yet (its engines ahead of the label), or
    # a reader writes exactly at the label.
    # The first `early` engines are taken before more ops, the rest after (a writer
    # that lets the event loop run between engines).
    writer, now_w = (a, now_a) if origin_writes else (b, now_b)
    taken = [writer.snapshot_engine(cid, now_w) for cid in writer.engine_ids()[:early]]
    for op in after[: len(after) // 2]:
        _run(a, op, now_a)
        if op[0] == "ship":
            append()
            catch_up()
    names = {im.child_engine_id for _, im in taken}
    taken += [writer.snapshot_engine(c, now_w) for c in writer.engine_ids() if c not in names]
    data = encode_snapshot(Snapshot("x", writer.origin, 0, tuple(taken)), now_w)
    for op in after[len(after) // 2 :]:
        append() if op[0] == "ship" else _run(a, op, now_a)
    append()
    catch_up()
    c = replica("c")
    c.load_snapshot(decode_snapshot(data, now_c), now_c)
    for entry in log[covered:]:
        ship(entry, "a", c, now_c)
    assert canonical(c, now_c) == canonical(b, now_b)
    assert lookups(c, now_c) == lookups(b, now_b)
    assert c.remote_engines() == b.remote_engines()


def test_the_model_can_fail_without_the_tail() -> None:
    # The negative control of the model: the snapshot alone misses what came after it.
    a, c = replica("a"), replica("c")
    a.add_engine("e0", COMPAT)
    snap = encode_snapshot(a.snapshot("x", 0, 0), 0)
    a.set_ready("e0", True)
    a.apply("e0", [BlockStored(CHAIN[:3], None, 48)])
    c.load_snapshot(decode_snapshot(snap, 0), 0)
    assert canonical(c, 0) != canonical(a, 0)
    ship(list(a.outbox), "a", c, 0)
    assert canonical(c, 0) == canonical(a, 0)


def test_snapshot_type_is_frozen() -> None:
    snap = Snapshot("1-0", "a", 0, ())
    with pytest.raises(AttributeError):
        snap.stream_id = "2-0"  # type: ignore[misc]
