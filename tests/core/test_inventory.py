"""Unit tests of the inventory core: one rule per test."""

from __future__ import annotations

import gc
import hashlib
import sys
import tracemalloc
from typing import Any

import pytest

from coordinator.core.errors import ErrorCode, KvrcError
from coordinator.core.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from coordinator.core.inventory import (
    Candidate,
    Inventory,
    LookupOutcome,
    Scope,
)
from kvrc.vocabulary import MAX_CHAIN_BLOCKS, PublishMode

A = "compat-a"
B = "compat-b"
PARTS = ((0, 0, 0), (1, 0, 0))


def h(*n: int) -> bytes:
    return hashlib.sha256(repr(n).encode()).digest()


def chain(n: int, family: int = 0) -> tuple[bytes, ...]:
    return tuple(h(family, i) for i in range(n))


def stored(
    hashes: tuple[bytes, ...], tier: Tier = Tier.GPU, group: int = 0, expiry_ms: int = 0
) -> BlockStored:
    return BlockStored(hashes, None, 16 * len(hashes), tier, group, expiry_ms)


def ready_inventory(*engines: tuple[str, str], **caps: int) -> Inventory:
    inv = Inventory(**caps)
    for eid, compat in engines:
        inv.add_engine(eid, compat)
        inv.set_ready(eid, True)
    return inv


def ids(inv: Inventory, c: tuple[bytes, ...], compat: str = A, **kw: Any) -> list[tuple[str, int]]:
    answer = inv.lookup(Scope(compat), c, now_ms=kw.pop("now_ms", 0), **kw)
    return [(x.child_engine_id, x.matched_blocks) for x in answer.candidates]


# --------------------------------------------------------------------------- lookup


def test_longest_contiguous_prefix_first_then_tier_then_leases_then_id() -> None:
    inv = ready_inventory(("e1", A), ("e2", A), ("e3", A), ("e4", A), ("e5", A))
    c = chain(8)
    inv.apply("e1", [stored(c[:3])])
    inv.apply("e2", [stored(c[:6])])
    inv.apply("e3", [stored(c[:6], Tier.CPU)])
    inv.apply("e4", [stored(c[:6])])
    # e5 holds blocks 0,1 and 3..7: the hole at 2 ends its contiguous match.
    inv.apply("e5", [stored(c[:2] + c[3:])])
    answer = inv.lookup(
        Scope(A), c, now_ms=0, max_candidates=5, leases_in_flight={"e2": 3, "e4": 1}
    )
    assert answer.outcome is LookupOutcome.HIT
    assert answer.best_matched_blocks == 6
    assert answer.candidates == (
        Candidate("e4", 6, Tier.GPU, 0, 1),
        Candidate("e2", 6, Tier.GPU, 0, 3),
        Candidate("e3", 6, Tier.CPU, 0, 0),
        Candidate("e1", 3, Tier.GPU, 0, 0),
        Candidate("e5", 2, Tier.GPU, 0, 0),
    )
    # Without leases the GPU tie is broken by id.
    assert ids(inv, c, max_candidates=2) == [("e2", 6), ("e4", 6)]


def test_tier_of_a_candidate_is_the_slowest_among_its_matched_blocks() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(4)
    inv.apply("e1", [stored(c[:2]), stored(c[2:3], Tier.DISK), stored(c[3:], Tier.CPU)])
    assert inv.lookup(Scope(A), c, now_ms=0).candidates[0].tier is Tier.DISK
    assert inv.lookup(Scope(A), c[:2], now_ms=0).candidates[0].tier is Tier.GPU
    # A block held in two tiers counts at its faster one.
    inv.apply("e1", [stored(c[2:3])])
    assert inv.lookup(Scope(A), c, now_ms=0).candidates[0].tier is Tier.CPU


def test_miss_and_below_min_blocks_are_answers() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(5)
    inv.apply("e1", [stored(c[:2])])
    miss = inv.lookup(Scope(A), chain(5, family=9), now_ms=0)
    assert (miss.outcome, miss.candidates, miss.best_matched_blocks) == (
        LookupOutcome.MISS,
        (),
        0,
    )
    below = inv.lookup(Scope(A), c, now_ms=0, min_blocks=3)
    assert (below.outcome, below.candidates, below.best_matched_blocks) == (
        LookupOutcome.BELOW_MIN_BLOCKS,
        (),
        2,
    )
    assert inv.lookup(Scope(A), c, now_ms=0, min_blocks=2).outcome is LookupOutcome.HIT
    assert inv.lookup(Scope(A), (), now_ms=0).outcome is LookupOutcome.MISS


def test_min_blocks_filters_shorter_candidates_but_keeps_longer() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    c = chain(6)
    inv.apply("e1", [stored(c[:2])])
    inv.apply("e2", [stored(c)])
    assert ids(inv, c, min_blocks=3) == [("e2", 6)]


def test_requester_is_excluded_when_asked() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    c = chain(4)
    inv.apply("e1", [stored(c)])
    inv.apply("e2", [stored(c[:2])])
    assert ids(inv, c, exclude_child_engine_id="e1") == [("e2", 2)]
    assert ids(inv, c) == [("e1", 4), ("e2", 2)]


def test_compatibility_scopes_and_groups_never_mix() -> None:
    inv = ready_inventory(("a1", A), ("b1", B))
    c = chain(4)
    inv.apply("a1", [stored(c, group=0)])
    inv.apply("b1", [stored(c, group=1)])
    assert ids(inv, c, A) == [("a1", 4)]
    assert ids(inv, c, B) == []
    assert inv.lookup(Scope(B, 1), c, now_ms=0).candidates[0].child_engine_id == "b1"
    assert inv.lookup(Scope(A, 1), c, now_ms=0).outcome is LookupOutcome.MISS
    assert inv.lookup(Scope("unknown"), c, now_ms=0).outcome is LookupOutcome.MISS
    # Excluding an engine of another scope changes nothing.
    assert ids(inv, c, A, exclude_child_engine_id="b1") == [("a1", 4)]


def test_removed_blocks_and_clears_stop_matching() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(6)
    inv.apply("e1", [stored(c)])
    result = inv.apply("e1", [BlockRemoved(c[3:4])])
    assert result.entries_removed == 1
    assert ids(inv, c) == [("e1", 3)]
    # Removing a tier the block is not held in changes nothing.
    inv.apply("e1", [BlockRemoved(c[:1], Tier.CPU)])
    assert ids(inv, c) == [("e1", 3)]
    result = inv.apply("e1", [AllBlocksCleared(), stored(c[:1])])
    assert result.clears == 1
    assert ids(inv, c) == [("e1", 1)]
    assert inv.stats().entries_total == 1


def test_max_candidates() -> None:
    inv = ready_inventory(*((f"e{i}", A) for i in range(10)))
    c = chain(3)
    for i in range(10):
        inv.apply(f"e{i}", [stored(c[: 1 + i % 3])])
    got = ids(inv, c, max_candidates=4)
    assert got == [("e2", 3), ("e5", 3), ("e8", 3), ("e1", 2)]


# --------------------------------------------------------------------------- readiness


def test_events_of_a_not_ready_engine_are_held_not_shown() -> None:
    inv = Inventory()
    inv.add_engine("e1", A)
    c = chain(3)
    inv.apply("e1", [stored(c)])
    assert inv.lookup(Scope(A), c, now_ms=0).outcome is LookupOutcome.MISS
    assert inv.stats().entries_total == 3
    assert inv.stats().engines_not_ready == 1
    inv.set_ready("e1", True)
    assert ids(inv, c) == [("e1", 3)]
    inv.set_ready("e1", False)
    assert ids(inv, c) == []


def test_stale_stream_hides_the_engine_until_its_dump_ends() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    old, new = chain(3), chain(3, family=1)
    inv.apply("e1", [stored(old)])
    inv.apply("e2", [stored(old[:1])])
    inv.mark_stale("e1")
    assert inv.is_stale("e1") and not inv.is_visible("e1")
    assert ids(inv, old) == [("e2", 1)]
    assert inv.stats().engines_stale == 1
    inv.begin_dump("e1")  # old state dropped here; still hidden
    assert inv.stats().engines_resyncing == 1
    assert inv.engine_entries("e1") == 0
    inv.apply("e1", [stored(new)])
    assert ids(inv, new) == []
    inv.end_dump("e1")
    assert ids(inv, new) == [("e1", 3)]
    assert ids(inv, old) == [("e2", 1)]
    assert inv.stats().engines_ready == 2


def test_end_dump_without_a_dump_does_not_clear_a_gap() -> None:
    inv = ready_inventory(("e1", A))
    inv.mark_stale("e1")
    inv.end_dump("e1")
    assert inv.is_stale("e1")


def test_new_incarnation_drops_the_streams_state_and_staleness() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(3)
    inv.apply("e1", [stored(c)])
    inv.mark_stale("e1")
    assert inv.clear_stream("e1") == 3
    assert not inv.is_stale("e1")
    assert inv.stats().entries_total == 0
    assert ids(inv, c) == []


# --------------------------------------------------------------------------- rank parts


def per_part_inventory() -> Inventory:
    inv = Inventory()
    inv.add_engine("p", A, publish_mode=PublishMode.PER_RANK_PART, rank_keys=PARTS)
    inv.set_ready("p", True)
    return inv


def test_per_rank_part_block_visible_only_when_every_part_stored_it() -> None:
    inv = per_part_inventory()
    c = chain(4)
    inv.apply("p", [stored(c)], rank_key=PARTS[0])
    assert ids(inv, c) == []
    inv.apply("p", [stored(c[:3])], rank_key=PARTS[1])
    assert ids(inv, c) == [("p", 3)]
    # Any part removing a block hides it.
    inv.apply("p", [BlockRemoved(c[1:2])], rank_key=PARTS[0])
    assert ids(inv, c) == [("p", 1)]
    inv.apply("p", [AllBlocksCleared()], rank_key=PARTS[1])
    assert ids(inv, c) == []
    assert inv.engine_entries("p") == 3  # part 0 still holds 3 facts


def test_per_rank_part_tiers_and_expiry_combine_across_parts() -> None:
    inv = per_part_inventory()
    c = chain(2)
    inv.apply("p", [stored(c, Tier.CPU, expiry_ms=500)], rank_key=PARTS[0])
    inv.apply("p", [stored(c, Tier.GPU, expiry_ms=900)], rank_key=PARTS[1])
    assert ids(inv, c) == []  # no tier held by both parts
    inv.apply("p", [stored(c, Tier.CPU, expiry_ms=900)], rank_key=PARTS[1])
    cand = inv.lookup(Scope(A), c, now_ms=0).candidates
    assert cand == (Candidate("p", 2, Tier.CPU, 500, 0),)
    assert inv.lookup(Scope(A), c, now_ms=500).outcome is LookupOutcome.MISS


def test_per_rank_part_ingest_walks_the_grid_only_for_facts_that_changed() -> None:
    """Every hash of a per-rank-part event re-derived its index entry over every part,
    changed or not: removals of blocks nobody stored cost O(hashes x parts), ~2 s of
    event loop a batch at 4,096 parts (review)."""
    grid = tuple((tp, 0, 0) for tp in range(256))
    inv = Inventory()
    inv.add_engine("g", A, publish_mode=PublishMode.PER_RANK_PART, rank_keys=grid)
    inv.set_ready("g", True)
    counters: list[_CountingDict] = []
    for part in inv._engines["g"].parts.values():
        counting = _CountingDict(part.tiers)
        part.tiers = counting
        counters.append(counting)

    def reads() -> int:
        return sum(c.gets for c in counters)

    inv.apply("g", [BlockRemoved(chain(64, family=-5))], rank_key=grid[0])
    assert reads() == 64  # the removing part's own facts, nothing else
    held = chain(8)
    inv.apply("g", [stored(held)], rank_key=grid[0])
    assert reads() - 64 <= 8 * 3  # its own fact, then the grid up to a part without it
    before = reads()
    inv.apply("g", [stored(held)], rank_key=grid[0])  # a repeat changes no fact
    assert reads() - before == 8
    for rank in grid:  # every part stores it: then (and only then) it is visible
        inv.apply("g", [stored(held)], rank_key=rank)
    assert ids(inv, held) == [("g", 8)]
    inv.apply("g", [BlockRemoved(held[4:])], rank_key=grid[7])
    assert ids(inv, held) == [("g", 4)]


def test_rank_keys_must_match_the_publish_mode() -> None:
    inv = per_part_inventory()
    inv.add_engine("c", A)
    for eid, key in (("p", None), ("p", (5, 0, 0)), ("c", PARTS[0])):
        with pytest.raises(KvrcError) as err:
            inv.apply(eid, [stored(chain(1))], rank_key=key)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert inv.stats().entries_total == 0
    with pytest.raises(KvrcError):
        inv.add_engine("x", A, publish_mode=PublishMode.PER_RANK_PART)
    with pytest.raises(KvrcError):
        inv.add_engine("y", A, rank_keys=PARTS)


# --------------------------------------------------------------------------- expiry


def test_expired_entries_are_misses_and_expiry_is_the_earliest_matched() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(4)
    inv.apply("e1", [stored(c[:2], expiry_ms=2_000), stored(c[2:], expiry_ms=1_000)])
    assert inv.lookup(Scope(A), c, now_ms=0).candidates == (Candidate("e1", 4, Tier.GPU, 1_000, 0),)
    assert inv.lookup(Scope(A), c[:2], now_ms=0).candidates[0].expiry_ms == 2_000
    assert ids(inv, c, now_ms=1_000) == [("e1", 2)]
    assert ids(inv, c, now_ms=2_000) == []
    # The lookups purged the expired blocks they stopped at (the third, then the first).
    assert inv.stats().entries_total == 2
    assert inv.sweep_expired(now_ms=2_000) == 2
    assert inv.stats().entries_total == 0


def test_restore_extends_or_clears_an_expiry() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(2)
    inv.apply("e1", [stored(c, expiry_ms=100)])
    inv.apply("e1", [stored(c, expiry_ms=300)])
    assert ids(inv, c, now_ms=200) == [("e1", 2)]
    inv.apply("e1", [stored(c)])
    assert inv.lookup(Scope(A), c, now_ms=10**9).candidates[0].expiry_ms == 0


def test_storing_over_an_expired_entry_starts_from_nothing() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(1)
    inv.apply("e1", [stored(c, Tier.GPU, expiry_ms=100)])
    inv.apply("e1", [stored(c, Tier.DISK)], now_ms=150)
    # The expired GPU copy does not come back.
    assert inv.lookup(Scope(A), c, now_ms=150).candidates[0].tier is Tier.DISK
    assert inv.stats().entries_total == 1


def test_sweep_purges_expired_entries_within_a_budget() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    for i in range(50):
        inv.apply("e1", [stored(chain(4, family=i), expiry_ms=1_000 + i)])
    inv.apply("e2", [stored(chain(4, family=999))])
    assert inv.stats().entries_total == 204
    assert inv.sweep_expired(now_ms=999) == 0
    purged = inv.sweep_expired(now_ms=5_000, budget=40)
    assert 40 <= purged <= 44  # whole stored segments, about the budget
    while inv.sweep_expired(now_ms=5_000, budget=40):
        pass
    assert inv.stats().entries_total == 4  # only e2's entries without expiry remain


def test_expiry_refreshes_keep_the_heap_bounded_in_keys_not_items() -> None:
    """Each store whose expiry changes adds one heap item holding all its keys. The
    bound counted items: an engine refreshing the expiry of the same 1,024 blocks kept
    every refresh's keys (5,000 refreshes: 5.1 M keys, ~200 MB, for 1,024 entries)."""
    inv = ready_inventory(("e1", A))
    c = chain(512)
    most = 0
    for i in range(400):
        inv.apply("e1", [stored(c, expiry_ms=10**9 + i)])
        most = max(most, sum(len(item[4]) for item in inv._expiry_heap))
    assert inv.stats().entries_total == 512
    assert most <= 4 * 512 + 1024 + 512  # the bound, plus the event that passed it
    assert ids(inv, c, now_ms=10**9 + 398) == [("e1", 512)]
    assert ids(inv, c, now_ms=10**9 + 399) == []


# --------------------------------------------------------------------------- bounds


def test_per_engine_cap_drops_stores_past_it_and_counts_them() -> None:
    inv = ready_inventory(("e1", A), ("e2", A), max_entries_per_engine=5)
    c = chain(8)
    result = inv.apply("e1", [stored(c)])
    assert (result.entries_added, result.dropped_engine_cap, result.dropped_total_cap) == (5, 3, 0)
    assert inv.engine_entries("e1") == 5
    assert ids(inv, c) == [("e1", 5)]
    # Other engines are not affected by e1's cap.
    assert inv.apply("e2", [stored(c[:5])]).dropped_engine_cap == 0
    # Removals still apply and make room again, within the same batch.
    result = inv.apply("e1", [BlockRemoved(c[3:5]), stored(c[5:7])])
    assert (result.entries_removed, result.entries_added, result.dropped_engine_cap) == (2, 2, 0)
    # Re-storing a held block never counts against the cap.
    assert inv.apply("e1", [stored(c[:3])]).dropped_engine_cap == 0


def test_total_cap_drops_stores_past_it() -> None:
    inv = ready_inventory(("e1", A), ("e2", A), max_entries_total=6)
    inv.apply("e1", [stored(chain(4))])
    result = inv.apply("e2", [stored(chain(4, family=1))])
    assert (result.entries_added, result.dropped_total_cap) == (2, 2)
    assert inv.stats().entries_total == 6
    inv.remove_engine("e1")
    assert inv.apply("e2", [stored(chain(4, family=1))]).entries_added == 2


def test_per_rank_part_facts_count_against_the_cap() -> None:
    inv = Inventory(max_entries_per_engine=5)
    inv.add_engine("p", A, publish_mode=PublishMode.PER_RANK_PART, rank_keys=PARTS)
    inv.set_ready("p", True)
    c = chain(4)
    inv.apply("p", [stored(c)], rank_key=PARTS[0])
    result = inv.apply("p", [stored(c)], rank_key=PARTS[1])
    assert (result.dropped_engine_cap, inv.engine_entries("p")) == (3, 5)
    assert ids(inv, c) == [("p", 1)]


# --------------------------------------------------------------------------- bad input


def test_bad_input_is_refused_and_changes_nothing() -> None:
    inv = ready_inventory(("e1", A))
    c = chain(3)
    inv.apply("e1", [stored(c)])
    before = inv.stats()
    bad_batches: list[list[Any]] = [
        [BlockRemoved(c), stored(c, group=-1)],
        [AllBlocksCleared(), stored(c, expiry_ms=-5)],
        [AllBlocksCleared(), "not an event"],
    ]
    for batch in bad_batches:
        with pytest.raises(KvrcError) as err:
            inv.apply("e1", batch)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    assert inv.stats() == before
    assert ids(inv, c) == [("e1", 3)]
    with pytest.raises(KvrcError) as err:
        inv.apply("nobody", [stored(c)])
    assert err.value.code is ErrorCode.NOT_FOUND
    with pytest.raises(KvrcError) as err:
        inv.add_engine("e1", A)
    assert err.value.code is ErrorCode.ALREADY_EXISTS
    long_chain = [b"x"] * (MAX_CHAIN_BLOCKS + 1)
    bad_kwargs: list[dict[str, Any]] = [
        {"min_blocks": -1},
        {"max_candidates": 0},
        {"max_candidates": 10_000},
    ]
    for kwargs in bad_kwargs:
        with pytest.raises(KvrcError) as err:
            inv.lookup(Scope(A), c, now_ms=0, **kwargs)
        assert err.value.code is ErrorCode.INVALID_ARGUMENT
    with pytest.raises(KvrcError) as err:
        inv.lookup(Scope(A), long_chain, now_ms=0)
    assert err.value.code is ErrorCode.INVALID_ARGUMENT


# --------------------------------------------------------------------------- departure


class CountingDict(dict[Any, Any]):
    """A dict that counts the operations the inventory makes on it."""

    ops = 0

    def get(self, key: Any, default: Any = None) -> Any:
        CountingDict.ops += 1
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        CountingDict.ops += 1
        return super().__getitem__(key)

    def __setitem__(self, key: Any, value: Any) -> None:
        CountingDict.ops += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        CountingDict.ops += 1
        super().__delitem__(key)


@pytest.mark.parametrize("others", [1_000, 20_000])
def test_remove_engine_costs_its_own_entries_not_everyones(others: int) -> None:
    inv = ready_inventory(("big", A), ("small", A))
    for i in range(others // 50):
        inv.apply("big", [stored(chain(50, family=i))])
    inv.apply("small", [stored(chain(30, family=0)), stored(chain(20, family=10**6))])
    index = inv._compat[A].scopes[0]  # instrument the index of this scope
    index.by_tier = [CountingDict(d) for d in index.by_tier]
    CountingDict.ops = 0
    assert inv.remove_engine("small") == 50
    # About one get and one set/del per entry, whatever the others hold.
    assert CountingDict.ops <= 3 * 50
    assert ids(inv, chain(30)) == [("big", 30)]
    assert inv.stats().entries_total == others


def test_departure_removes_inventory_and_a_reused_slot_inherits_nothing() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    c = chain(3)
    inv.apply("e1", [stored(c, expiry_ms=50)])
    inv.apply("e2", [stored(c[:1])])
    inv.remove_engine("e1")
    assert not inv.has_engine("e1")
    assert ids(inv, c) == [("e2", 1)]
    inv.add_engine("e3", A)  # takes e1's slot
    inv.set_ready("e3", True)
    assert ids(inv, c) == [("e2", 1)]
    assert inv.sweep_expired(now_ms=100) == 0
    stats = inv.stats()
    assert stats.entries_total == 1 and stats.engines_ready == 2
    with pytest.raises(KvrcError):
        inv.remove_engine("e1")


# --------------------------------------------------------------------------- stats, memory


def test_stats_count_entries_by_tier_and_engines_by_state() -> None:
    inv = ready_inventory(("e1", A), ("e2", A))
    inv.add_engine("e3", B)
    inv.apply("e1", [stored(chain(3)), stored(chain(2, 1), Tier.CPU)])
    inv.apply("e2", [stored(chain(3), Tier.DISK)])
    inv.mark_stale("e2")
    stats = inv.stats()
    assert dict(stats.index_entries_by_tier) == {
        Tier.GPU: 3,
        Tier.CPU: 2,
        Tier.DISK: 3,
        Tier.EXTERNAL: 0,
    }
    assert stats.entries_total == 8
    assert (stats.engines_ready, stats.engines_stale, stats.engines_not_ready) == (1, 1, 1)
    inv.remove_engine("e1")
    assert inv.stats().index_entries_by_tier[Tier.CPU] == 0


def _traced(fn: Any) -> int:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    keep = fn()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del keep
    return used


def test_memory_per_membership_is_compact() -> None:
    """~100k memberships, fresh 32-byte hashes allocated inside the traced window."""
    n_engines, chains_per_engine, length = 8, 200, 64

    def fill() -> Inventory:
        inv = ready_inventory(*((f"e{i}", A) for i in range(n_engines)))
        for e in range(n_engines):
            for k in range(chains_per_engine):
                inv.apply(f"e{e}", [stored(tuple(h(e, k, j) for j in range(length)))])
        return inv

    used = _traced(fill)
    memberships = n_engines * chains_per_engine * length
    # A dict or a set per membership would cost far more than this.
    assert used / memberships <= 150, used / memberships


def test_churn_does_not_grow_memory() -> None:
    inv = ready_inventory(("e1", A))
    live = [chain(32, family=i) for i in range(50)]
    other = [chain(32, family=10_000 + i) for i in range(50)]
    for c in live:
        inv.apply("e1", [stored(c)])

    def churn(rounds: int) -> None:
        for _ in range(rounds):
            for c, o in zip(live, other, strict=True):
                inv.apply("e1", [BlockRemoved(c), stored(o)])
                inv.apply("e1", [BlockRemoved(o), stored(c)])
        assert inv.stats().entries_total == 50 * 32

    churn(20)  # let dicts and lists reach their working size
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    churn(60)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    # Bounded by the live size (dict resizes, dead keys awaiting compaction). Without
    # compaction the dead reverse-index keys would keep ~128 KB a round: ~7.7 MB here.
    assert grown < 600_000, grown


def test_a_tied_groups_answer_is_built_once_and_never_outlives_its_engines() -> None:
    """A tie's Candidates are kept per (matched, engines, count) for the next lookup;
    an engine that leaves, and another that takes its slot, must not be answered from
    them."""
    inv = ready_inventory(("e1", A), ("e2", A), ("e3", A))
    c = chain(6)
    for eid in ("e1", "e2", "e3"):
        inv.apply(eid, [stored(c)])
    first = inv.lookup(Scope(A), c, now_ms=0, max_candidates=2)
    assert [(x.child_engine_id, x.matched_blocks) for x in first.candidates] == [
        ("e1", 6),
        ("e2", 6),
    ]
    again = inv.lookup(Scope(A), c, now_ms=0, max_candidates=2)
    assert all(a is b for a, b in zip(again.candidates, first.candidates, strict=True))
    assert ids(inv, c) == [("e1", 6), ("e2", 6), ("e3", 6)]  # another count: its own
    inv.remove_engine("e2")
    inv.add_engine("e0", A)  # takes e2's slot: the same bits
    inv.set_ready("e0", True)
    inv.apply("e0", [stored(c)])
    assert ids(inv, c, max_candidates=2) == [("e0", 6), ("e1", 6)]
    assert ids(inv, c) == [("e0", 6), ("e1", 6), ("e3", 6)]


# ------------------------------------------------------------- complexity, by counting


class _CountingDict(dict[Any, int]):
    """The index of one tier, counting the entries a call touches (gets and sets)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.gets = 0
        self.sets = 0

    def get(self, key: Any, default: Any = None) -> Any:
        self.gets += 1
        return super().get(key, default)

    def __setitem__(self, key: Any, value: int) -> None:
        self.sets += 1
        super().__setitem__(key, value)


def _count_gpu_tier(inv: Inventory, compat: str = A) -> _CountingDict:
    index = inv._compat[compat].scopes[0]
    counting = _CountingDict(index.by_tier[Tier.GPU])
    index.by_tier[Tier.GPU] = counting
    return counting


def _big_inventory(engines: int = 8, chains: int = 40) -> Inventory:
    inv = ready_inventory(*((f"e{i}", A) for i in range(engines)))
    for i in range(engines):
        for c in range(chains):
            inv.apply(f"e{i}", [stored(chain(32, family=1000 * i + c))])
    return inv


@pytest.mark.parametrize("chains", [5, 40])
def test_lookup_touches_one_entry_per_matched_block_whatever_the_index_size(chains: int) -> None:
    inv = _big_inventory(chains=chains)
    held = chain(32, family=1000 * 3 + 1)  # e3's
    counting = _count_gpu_tier(inv)
    answer = inv.lookup(Scope(A), held, now_ms=0)
    assert [(c.child_engine_id, c.matched_blocks) for c in answer.candidates] == [("e3", 32)]
    assert counting.gets == 32
    assert counting.sets == 0


def test_lookup_stops_at_the_first_block_nobody_holds() -> None:
    inv = _big_inventory()
    counting = _count_gpu_tier(inv)
    assert inv.lookup(Scope(A), chain(64, family=-1), now_ms=0).outcome is LookupOutcome.MISS
    assert counting.gets == 1
    partial = chain(32, family=1000 * 2 + 7)[:10] + chain(22, family=-2)
    answer = inv.lookup(Scope(A), partial, now_ms=0)
    assert answer.best_matched_blocks == 10
    assert counting.gets == 1 + 11  # ten held blocks, then the first unknown one


def test_store_and_remove_touch_one_entry_per_block_of_the_event() -> None:
    inv = _big_inventory()
    counting = _count_gpu_tier(inv)
    new = chain(16, family=-3)
    inv.apply("e0", [stored(new)])
    assert (counting.gets, counting.sets) == (16, 16)
    inv.apply("e0", [BlockRemoved(new[:4])])
    assert counting.gets == 16 + 4


def test_remove_engine_touches_only_its_own_entries() -> None:
    inv = _big_inventory(engines=8, chains=10)
    counting = _count_gpu_tier(inv)
    inv.remove_engine("e5")
    assert counting.gets == 10 * 32  # e5's entries, not the 8 x 10 x 32 of the index


def test_block_keys_are_allocated_at_two_int_digits() -> None:
    """`hash & mask`, not `hash >> 4`: a shifted int keeps its operand's 3 digits (36
    bytes, pymalloc's 48-byte class); a key of 2 digits takes 32, for every indexed block."""
    from coordinator.core.inventory import _key

    hashes = [h(i) for i in range(10_000)]
    keys: list[int] = []
    used = _traced(lambda: keys.extend(map(_key, hashes)))
    per_key = (used - sys.getsizeof(keys)) / len(hashes)
    assert per_key <= 32.5, per_key  # 36 with `>> 4`
    assert all(0 <= _key(x) < 1 << 60 for x in hashes[:100])
